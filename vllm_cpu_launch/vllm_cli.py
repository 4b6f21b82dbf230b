"""vLLM's command-line grammar, read as vLLM reads it, without importing vLLM.

vLLM's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py) turns `_` into `-` in
option names up to the first `.`, merges dotted keys (`--speculative-config.method
ngram`) into one JSON dict, and reads `--config FILE.yaml`: each key becomes `--key`, the
file's options come before the command line's, so the command line wins. argparse accepts
an option's short aliases (`-tp`) and any unambiguous abbreviation of a long option
(`--tensor-parallel 2`). The launcher reads two things this way: whether speculative
decoding is requested (speculative.py) and whether the command runs one worker on one
node (evidence.py). tests/e2e/test_vllm_parser_agreement.py checks both readings against
vLLM's own parser, on each release the tests install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_launch.files import read_checked
from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence


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
    would see them. Raises OSError (FileProblem: no regular file), UnicodeDecodeError,
    RecursionError (nested too deep) or yaml's error for a bad file."""
    import yaml  # only when the command line names a config file

    content = yaml.safe_load(read_checked(path).decode("utf-8"))
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
    except Exception:  # OSError, UnicodeDecodeError, yaml.YAMLError (not imported here)
        in_file = []
    found = in_file + list(on_command_line(argv, options))
    sizes = {item.option: item.value for item in found if item.option != HEADLESS.name}
    headless = any(item.option == HEADLESS.name for item in found)
    return not headless and all((size or "").strip() == "1" for size in sizes.values())

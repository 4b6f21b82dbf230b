"""The tune's result in the user's launcher config, other keys and comments kept."""

from __future__ import annotations

import contextlib
import os
import tempfile

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm_cpu_launch.verbs.tune.verdict import Verdict


def tuned_record(verdict: Verdict, when: str, rounds: int, command: str) -> dict[str, object]:
    return {
        "when": when,
        "iomp": verdict.iomp,
        "result": verdict.result,
        "rounds": rounds,
        "command": command,
    }


def top_level_key(line: str) -> str | None:
    """The key of a `key: ...` line at the top level of a block mapping, else None."""
    if not line or line[0] in " \t#-" or ":" not in line:
        return None
    key = line.partition(":")[0].strip().strip("'\"")
    return key.replace("-", "_") if key and " " not in key else None


def merged_config(old_text: str, updates: Mapping[str, object]) -> str:
    """The config text with `updates` (top-level keys) replaced or added, everything else
    kept as written (comments too). Where the file's form defeats a line edit, checked by
    parsing both, the whole file is written from its parsed content instead."""
    import yaml

    old = yaml.safe_load(old_text) if old_text.strip() else {}
    old = old if isinstance(old, dict) else {}
    wanted = {**{str(k).replace("-", "_"): v for k, v in old.items()}, **updates}
    kept: list[str] = []
    skipping = False
    for line in old_text.splitlines():
        key = top_level_key(line)
        if key is not None:
            skipping = key in updates
        elif line[:1] not in (" ", "\t"):
            skipping = False
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    added = yaml.safe_dump(dict(updates), sort_keys=False, width=4096, allow_unicode=True)
    text = "\n".join([*kept, added]) if kept else added
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        parsed = None
    if (
        isinstance(parsed, dict)
        and {str(k).replace("-", "_"): v for k, v in parsed.items()} == wanted
    ):
        return text
    return yaml.safe_dump(wanted, sort_keys=False, width=4096, allow_unicode=True)


def write_config(path: str, updates: Mapping[str, object]) -> None:
    """Merge `updates` into the config file at path (made if missing), atomically; the file
    must be valid before (it is not overwritten otherwise) and is checked after."""
    from vllm_cpu_launch.settings import read_config_file

    real = os.path.realpath(path)
    old_text, mode = "", 0o644
    if os.path.exists(real):
        read_config_file(real)  # a broken config is reported, not replaced
        with open(real, encoding="utf-8") as stream:
            old_text = stream.read()
        mode = os.stat(real).st_mode & 0o7777
    text = merged_config(old_text, updates)
    directory = os.path.dirname(real)
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".config.yaml.", dir=directory)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.chmod(temporary, mode)
            os.replace(temporary, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as error:
        raise LaunchError(
            EXIT_USAGE, f"{path}: cannot write the launcher config: {error}"
        ) from None
    read_config_file(real)

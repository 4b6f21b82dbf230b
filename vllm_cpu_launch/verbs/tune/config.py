"""The tune's result in the user's launcher config, other keys and comments kept."""

from __future__ import annotations

import contextlib
import os
import tempfile
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.settings import (
    Tuned,
    read_config_file,
    record_fields,
    record_scope,
    tuned_in_file,
)
from vllm_cpu_launch.trust import read_trusted

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from vllm_cpu_launch.settings import Mode, Scope
    from vllm_cpu_launch.verbs.tune.contest import Outcome


def tune_updates(
    path: str,
    outcome: Outcome,
    rounds: int,
    command: str,
    scope: Scope,
    at_load: Mapping[int, Mode] | None = None,
) -> tuple[dict[str, object], tuple[str, ...]]:
    """(updates, keys to remove): this tune's record, then the file's records of other scopes
    as launches read them (settings.tuned_in_file): one from before scoping gets its scope
    written out, and the global `iomp:` it wrote beside it goes."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    load = tuple(sorted((at_load or {}).items()))
    tuned = Tuned(when, outcome.iomp, outcome.result, rounds, command, scope, concurrency=load)
    content = read_config_file(path) if os.path.exists(path) else {}
    had_iomp = "iomp" in content
    others = [item for item in tuned_in_file(content, path) if record_scope(item) != scope]
    records = [record_fields(tuned, scope), *(record_fields(o, record_scope(o)) for o in others)]
    return {"tuned": records}, (("iomp",) if had_iomp and "iomp" not in content else ())


def top_level_key(line: str) -> str | None:
    """The key of a `key: ...` line at the top level of a block mapping, else None."""
    if not line or line[0] in " \t#-" or ":" not in line:
        return None
    key = line.partition(":")[0].strip().strip("'\"")
    return key.replace("-", "_") if key and " " not in key else None


def merged_config(old_text: str, updates: Mapping[str, object], removed: Sequence[str] = ()) -> str:
    """The config text with `updates` (top-level keys) set and `removed` gone, the rest kept
    as written (comments too); where a line edit parses wrong, the parsed content instead."""
    import yaml  # lazy: a verb, only where it writes

    def keyed(parsed: object) -> dict[str, object]:  # the keys as settings reads them
        items = parsed.items() if isinstance(parsed, dict) else ()
        return {str(k).replace("-", "_"): v for k, v in items}

    wanted = {**keyed(yaml.safe_load(old_text) if old_text.strip() else {}), **updates}
    for name in removed:
        wanted.pop(name, None)
    kept: list[str] = []
    skipping = False
    for line in old_text.splitlines():
        key = top_level_key(line)
        if key is not None:
            skipping = key in updates or key in removed
        elif line[:1] not in (" ", "\t"):
            skipping = False
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    added = yaml.safe_dump(dict(updates), sort_keys=False, width=4096, allow_unicode=True)
    text = "\n".join([*kept, added]) if kept else added
    with contextlib.suppress(yaml.YAMLError):
        parsed = yaml.safe_load(text)
        if isinstance(parsed, dict) and keyed(parsed) == wanted:
            return text
    return yaml.safe_dump(wanted, sort_keys=False, width=4096, allow_unicode=True)


def write_config(path: str, updates: Mapping[str, object], removed: Sequence[str] = ()) -> None:
    """Merge `updates` into the config file at path (made if missing) atomically; a broken
    file is reported, not overwritten, and the result is checked."""
    real = os.path.realpath(path)
    old_text, mode = "", 0o644
    if os.path.exists(real):
        read_config_file(real)  # a broken config is reported, not replaced
        old_text = read_trusted(real).decode("utf-8")
        mode = os.stat(real).st_mode & 0o7777
    text = merged_config(old_text, updates, removed)
    directory = os.path.dirname(real)
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".config.yaml.", dir=directory)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.chmod(temporary, mode)
            os.replace(temporary, real)
        finally:  # gone after the replace; left behind by a failure before it
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    except OSError as error:
        raise LaunchError(
            EXIT_USAGE, f"{path}: cannot write the launcher config: {error}"
        ) from None
    read_config_file(real)


def check_writable(path: str) -> None:
    """--write's file can be made: a file created and removed beside it (in the nearest
    directory that exists, which the write makes the rest of) before any run."""
    home = os.path.dirname(os.path.realpath(path))
    directory = home
    while not os.path.lexists(directory):
        directory = os.path.dirname(directory)
    missing = (
        f"its directory {home} does not exist and cannot be made: " if directory != home else ""
    )
    why = f"{directory} is not a directory"
    try:
        if os.path.isdir(directory):
            handle, probe = tempfile.mkstemp(prefix=".vllm-cpu-launch-probe.", dir=directory)
            os.close(handle)
            os.unlink(probe)
            return
    except OSError as error:
        why = f"creating a file in {directory} fails ({error.strerror})"
    raise LaunchError(
        EXIT_USAGE,
        f"--write: the launcher config {path} cannot be written: {missing}{why}; "
        "give --launcher-config FILE in a directory you can write",
    )

"""vllm_cpu_launch/verbs/tune/config.py: what `tune --write` puts in the launcher config,
read back by the launcher (settings.read_config_file, and a fresh launcher process)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from tests.conftest import clean_environ, run_launcher
from vllm_cpu_launch.settings import Mode, Scope, Tuned, read_config_file
from vllm_cpu_launch.verbs.tune.config import (
    check_writable,
    merged_config,
    tune_updates,
    write_config,
)
from vllm_cpu_launch.verbs.tune.contest import CONTENDERS, Summary, outcome_of

from .test_tune import TUNED

GOMP, IOMP = CONTENDERS
# libiomp5 won every round of three by far: with libgomp the default (no SD), it is written.
IOMP_WON = outcome_of([Summary(GOMP, (0.2, 0.2, 0.2)), Summary(IOMP, (0.1, 0.1, 0.1))], GOMP)
COMMAND = "vllm bench serve --model /models/m"


def user_config(tmp_path: Path) -> Path:
    """Where a launcher run with clean_environ(tmp_path) finds its user config."""
    return tmp_path / "no-user-config" / "vllm-cpu-launch" / "config.yaml"


def records_in(path: Path) -> list[Tuned]:
    """The tune records of a config file, as a launch reads them."""
    records = read_config_file(str(path))["tuned"]
    assert isinstance(records, tuple) and all(isinstance(r, Tuned) for r in records)
    return list(records)


def test_merge_keeps_other_keys_and_comments_and_replaces_an_old_result() -> None:
    old = (
        "# mine\nstrict: true\niomp: always   # was\ntuned:\n  when: x\n  iomp: always\n"
        "kmp-blocktime: 5\n"
    )
    text = merged_config(old, {"iomp": "never", "tuned": TUNED})
    assert "# mine" in text and "was" not in text
    assert yaml.safe_load(text) == {
        "strict": True,
        "iomp": "never",
        "tuned": TUNED,
        "kmp-blocktime": 5,
    }
    flow = merged_config("{strict: true, iomp: always}\n", {"iomp": "never"})
    assert yaml.safe_load(flow) == {"strict": True, "iomp": "never"}
    assert yaml.safe_load(merged_config("", {"iomp": "auto"})) == {"iomp": "auto"}


def test_a_written_tune_is_what_the_next_launch_follows(tmp_path: Path, vllm_env: Path) -> None:
    """No SD: the default is libgomp. A tune that found libiomp5 faster for this model,
    written where the launcher reads its user config, makes the next launch preload it."""
    path = user_config(tmp_path)
    serve = ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "serve", "/models/m"]
    before = run_launcher(serve, clean_environ(tmp_path))
    assert before.returncode == 0 and "libiomp5" not in before.stdout, before.stdout
    write_config(str(path), *tune_updates(str(path), IOMP_WON, 3, COMMAND, Scope("/models/m")))
    after = run_launcher(serve, clean_environ(tmp_path))
    assert after.returncode == 0, after.stderr
    (record,) = records_in(path)
    assert record.iomp == Mode.ALWAYS and record.command == COMMAND
    assert f"tune of {record.when} (model /models/m; {path}) applied" in after.stdout
    assert "libiomp5" in after.stdout
    other = run_launcher([*serve[:-1], "/models/other"], clean_environ(tmp_path))
    assert "libiomp5" not in other.stdout  # measured for another model: not applied


def test_a_tune_replaces_its_scope_keeps_the_others_and_scopes_an_old_record(
    tmp_path: Path,
) -> None:
    """A record from before scoping (beside its global `iomp:`) is written out scoped to
    the command it measured, and that `iomp:` goes; a record of the same scope is replaced,
    one of another scope kept; the user's other keys and comments stay."""
    path = tmp_path / "config.yaml"
    old = {**TUNED, "command": "vllm bench latency --model /models/old"}
    path.write_text("# mine\nstrict: true\n" + yaml.safe_dump({"iomp": "never", "tuned": old}))
    write_config(str(path), *tune_updates(str(path), IOMP_WON, 3, COMMAND, Scope("/models/m")))
    text = path.read_text()
    assert text.startswith("# mine\nstrict: true\n") and "\niomp:" not in text
    content = read_config_file(str(path))
    assert content["strict"] is True and "iomp" not in content
    scopes = [(r.scope and r.scope.model, r.iomp) for r in records_in(path)]
    assert scopes == [("/models/m", Mode.ALWAYS), ("/models/old", Mode.NEVER)]
    # Again for the same model: one record of it, the newest; the other model's kept.
    kept = outcome_of([Summary(GOMP, (0.1, 0.2)), Summary(IOMP, (0.2, 0.1))], GOMP)
    write_config(str(path), *tune_updates(str(path), kept, 2, COMMAND, Scope("/models/m")))
    assert [(r.scope and r.scope.model, r.iomp, r.rounds) for r in records_in(path)] == [
        ("/models/m", Mode.AUTO, 2),
        ("/models/old", Mode.NEVER, 3),
    ]


def test_writing_through_a_link_keeps_the_link_and_the_files_mode(tmp_path: Path) -> None:
    """A config linked from elsewhere (a dotfiles checkout) is written where it lies, with
    the permissions it had; the link stays a link."""
    target = tmp_path / "dotfiles" / "launcher.yaml"
    target.parent.mkdir()
    target.write_text("# private\ntcmalloc: never\n")
    target.chmod(0o640)  # not the 0600 of a new temporary file
    link = tmp_path / "config.yaml"
    link.symlink_to(target)
    write_config(str(link), *tune_updates(str(link), IOMP_WON, 3, COMMAND, Scope("/models/m")))
    assert link.is_symlink() and link.resolve() == target
    assert target.stat().st_mode & 0o7777 == 0o640
    assert target.read_text().startswith("# private\ntcmalloc: never\n")
    assert read_config_file(str(link))["tcmalloc"] == "never"
    assert sorted(os.listdir(target.parent)) == ["launcher.yaml"]  # no temporary left


def test_a_config_in_directories_to_be_made_is_checked_without_making_them(
    tmp_path: Path,
) -> None:
    """--write's check probes the nearest directory that exists and leaves nothing there;
    the write then makes the rest."""
    path = tmp_path / "a" / "b" / "config.yaml"
    check_writable(str(path))
    assert os.listdir(tmp_path) == []
    write_config(str(path), *tune_updates(str(path), IOMP_WON, 3, COMMAND, Scope("/models/m")))
    (record,) = records_in(path)
    assert record.scope == Scope("/models/m") and record.result == IOMP_WON.result

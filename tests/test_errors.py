"""The exit codes (vllm_cpu_launch/errors.py) are the contract's: docs/design.md's and the
help's, each code once, and a user's mistake exits with its code as one error line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import LAUNCHER, clean_environ
from vllm_cpu_launch import errors

ROOT = Path(__file__).resolve().parent.parent


def codes() -> dict[str, int]:
    return {name: value for name, value in vars(errors).items() if name.startswith("EXIT_")}


def test_each_exit_code_is_the_one_design_md_and_the_help_give(tmp_path: Path) -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    documented = {int(code) for code in re.findall(r"`(\d+)`\s", section)}
    help_text = subprocess.run(
        [*LAUNCHER, "--help"],
        capture_output=True,
        text=True,
        env=clean_environ(tmp_path),
        check=True,
    ).stdout
    helped = {
        int(code) for code in re.findall(r"\b(\d+) [a-z-]", help_text.split("exit codes:")[1])
    }
    assert len(set(codes().values())) == len(codes())  # no two names for one code
    assert {0, *codes().values()} == documented == helped


def test_a_usage_mistake_is_one_error_line_and_its_code(tmp_path: Path) -> None:
    done = subprocess.run(
        [*LAUNCHER, "--iomp", "sometimes", "--dry-run", "serve", "m"],
        capture_output=True,
        text=True,
        env=clean_environ(tmp_path),
    )
    assert done.returncode == errors.EXIT_USAGE
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("vllm-cpu-launch: error: ")
    assert "Traceback" not in done.stderr

"""The real vLLM CPU environment, shared by the end-to-end tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SKIP_VARIABLE = "VLLM_CPU_LAUNCH_SKIP_E2E"
sys.path.insert(0, str(SCRIPTS))

from vllm_server import ENV_SETUP_LIMIT_S, prepare_env_command  # noqa: E402


def run_script(command: Sequence[str], limit_s: float) -> str:
    """Run one of the repo's scripts and return the last line it printed (its result)."""
    try:
        completed = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command)} did not finish within {limit_s:.0f} s")
    if completed.returncode != 0 or not completed.stdout.strip():
        pytest.fail(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr}")
    return completed.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The cached vLLM CPU environment, built on first use."""
    return Path(run_script(prepare_env_command(), ENV_SETUP_LIMIT_S))

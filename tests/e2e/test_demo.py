"""End to end: `scripts/demo`, the README's first command, as a newcomer runs it: the real
model served through the launcher, its answer, the drafts accepted, libiomp5 in every vLLM
process. The vLLM environment and the model are the cached ones the other e2e tests use
(made first by their fixtures); the demo's own venv (.venv-demo) is made on its first run.
Set VLLMCPULAUNCH_SKIP_E2E=1 to skip this module.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from vllm_cpu_launch.libraries import SYSTEM_ROOT_VARIABLE

from .conftest import REAL_VLLM, SCRIPTS

pytestmark = REAL_VLLM

DEMO_LIMIT_S = 900
# A process the demo lists: its title, then the libiomp5 it maps (or NOT LOADED).
PROCESS = re.compile(r"^   PID \d+ +(.*)\n +libiomp5: (.*)$", re.MULTILINE)
ACCEPTED = re.compile(r"^   draft tokens accepted \(/metrics\): (\d+) of (\d+) \(", re.MULTILINE)


def test_the_demo_shows_the_models_answer_the_drafts_accepted_and_libiomp5(
    vllm_env: Path, real_model: Path
) -> None:
    steering = ("LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in steering and not key.startswith(("KMP_", "VLLM_CPU_", "VLLMCPULAUNCH_"))
    }
    # The tests' host (tests/conftest.py), not this machine's own libraries.
    env[SYSTEM_ROOT_VARIABLE] = os.environ[SYSTEM_ROOT_VARIABLE]
    result = subprocess.run(
        [str(SCRIPTS / "demo")],
        env={**env, "VLLMCPULAUNCH_VLLM_ENV": str(vllm_env)},
        capture_output=True,
        text=True,
        timeout=DEMO_LIMIT_S,
        check=False,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    # The plan shown names the model served by its own name (once `tiny-llama`).
    assert "--served-model-name smollm2-135m-instruct" in result.stdout, result.stdout
    (answer,) = [line for line in result.stdout.splitlines() if line.startswith("   answer: ")]
    assert "The capital of Germany is Berlin." in answer, answer
    (counts,) = ACCEPTED.findall(result.stdout)
    assert 0 < int(counts[0]) <= int(counts[1]), counts
    processes = dict(PROCESS.findall(result.stdout))
    assert any(t.startswith("VLLM::EngineCore") for t in processes), result.stdout
    assert any(t.startswith("VLLM::Worker") for t in processes), result.stdout
    planned = str(vllm_env / "lib" / "libiomp5.so")
    assert set(processes.values()) == {planned}, processes
    assert "   exit code 0; processes left: none" in result.stdout

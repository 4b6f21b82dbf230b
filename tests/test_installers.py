"""Conformance: the launcher against environments the real installers made.

For every layout in tests/installers.py (pip, virtualenv, uv plain and relocatable,
uv tool, pipx, pip --user with and without PYTHONUSERBASE, conda-style prefixes; short
and long paths): the plan chooses that environment's own libiomp5.so, and a real exec
maps it in the stand-in vLLM. Without intel-openmp, the "Fix:" the launcher prints and
doctor's recommendation are run as printed, and the next plan finds the library.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import clean_environ, read_record, run_launcher
from .installers import (
    FIX,
    LAYOUTS,
    SD,
    Installed,
    build_wheelhouse,
    chosen_iomp,
    dry_run,
    externally_managed_user,
    install_launcher,
    offline,
    pip_venv,
    pip_venv_without_pip,
    uv_venv,
)

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 intel-openmp")


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheelhouse(tmp_path_factory.mktemp("installers") / "wheelhouse")


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return install_launcher(tmp_path_factory.mktemp("launcher") / "venv")


@pytest.fixture
def environ(tmp_path: Path, wheelhouse: Path) -> Iterator[dict[str, str]]:
    (tmp_path / "home").mkdir()
    yield offline(clean_environ(tmp_path), wheelhouse)
    # Installed environments are large (intel-openmp is 260 MB unpacked): drop them now.
    for child in tmp_path.iterdir():
        if child.name != "home":
            shutil.rmtree(child, ignore_errors=True)


def install(layout: str, tmp_path: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    where, installer = LAYOUTS[layout]
    installed = installer(tmp_path / where, environ, with_iomp)
    environ.update(installed.environ)
    return installed


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_installer_gets_its_own_library_chosen_and_mapped(
    layout: str, tmp_path: Path, environ: dict[str, str], launcher: list[str]
) -> None:
    installed = install(layout, tmp_path, environ, with_iomp=True)
    assert installed.library.is_file(), f"{layout} put no libiomp5.so at {installed.library}"
    environ["PATH"] = f"{installed.vllm.parent}:{environ['PATH']}"
    plan = dry_run(launcher, environ)
    iomp = chosen_iomp(plan)
    assert (iomp["path"], iomp["origin"], iomp["flavor"]) == (
        str(installed.library),
        "vllm-environment",
        "intel",
    ), plan
    assert plan["warnings"] == [], plan["warnings"]

    record_file = tmp_path / "record.json"
    result = run_launcher(["-q", *SD], {**environ, "RECORD_TO": str(record_file)}, launcher)
    assert result.returncode == 0, result.stderr
    record = read_record(record_file)
    assert record["LD_PRELOAD"] == str(installed.library)
    assert os.path.realpath(installed.library) in record["mapped"]  # type: ignore[operator]
    assert record["argv"] == SD


# Layouts whose Fix is checked: each kind of advice fixes.py gives, once.
FIX_LAYOUTS = {
    "pip-venv": pip_venv,
    "venv-without-pip": pip_venv_without_pip,
    "uv-venv": lambda r, e, i: uv_venv(r, e, i),
    "externally-managed": externally_managed_user,
}


@pytest.mark.parametrize(
    "layout",
    [
        "pip-venv",
        "venv-without-pip",
        "uv-venv",
        "uv-tool",
        "pipx",
        "pip-user",
        "pip-user-custom-base",
        "externally-managed",
    ],
)
def test_the_printed_fix_installs_the_library_where_the_next_plan_finds_it(
    layout: str, tmp_path: Path, environ: dict[str, str], launcher: list[str]
) -> None:
    if layout == "externally-managed" and not Path("/usr/lib/python3/dist-packages/pip").is_dir():
        pytest.skip("needs Debian's python3 with pip (python3-pip), externally managed")
    installer = FIX_LAYOUTS.get(layout) or LAYOUTS[layout][1]
    installed = installer(tmp_path / layout, environ, False)
    environ.update(installed.environ)
    environ["PATH"] = f"{installed.vllm.parent}:{environ['PATH']}"
    plan = dry_run(launcher, environ)
    assert plan["preload"] == []
    (warning,) = (w for w in plan["warnings"] if "not found" in w)
    match = FIX.search(warning)
    assert match, warning
    fix = match.group(1)

    report = json.loads(run_launcher(["doctor", "--json"], environ, launcher).stdout)
    advice = {r["id"]: r for r in report["recommendations"]}
    assert advice["install-intel-openmp"]["command"] == fix  # one source for both

    result = subprocess.run(
        ["sh", "-c", fix], env=environ, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{fix}\n{result.stderr}"
    iomp = chosen_iomp(dry_run(launcher, environ))
    assert iomp["path"] == str(installed.library)


def test_a_moved_venv_names_its_missing_interpreter(
    tmp_path: Path, environ: dict[str, str], launcher: list[str]
) -> None:
    original = pip_venv(tmp_path / "before", environ, True)
    moved = tmp_path / "after"
    shutil.move(tmp_path / "before", moved)
    vllm = moved / "bin" / "vllm"
    result = run_launcher(["--vllm", str(vllm), *SD], environ, launcher)
    assert result.returncode == 126
    (line,) = result.stderr.splitlines()
    interpreter = original.vllm.parent / "python"  # pip writes its sys.executable
    assert line.startswith("vllm-cpu-launch: error: ")
    assert f"runs the interpreter {interpreter}, which does not exist" in line
    assert f"its environment {moved} was moved" in line

    report = json.loads(
        run_launcher(["--vllm", str(vllm), "doctor", "--json"], environ, launcher).stdout
    )
    assert report["vllm"]["found"] is True
    assert report["vllm"]["executable"] == str(vllm)
    assert str(interpreter) in report["vllm"]["error"]
    ids = [r["id"] for r in report["recommendations"]]
    assert "vllm-broken" in ids and "vllm-not-found" not in ids
    assert "see above" not in json.dumps(report)


def test_nothing_found_is_the_only_not_found(
    tmp_path: Path, environ: dict[str, str], launcher: list[str]
) -> None:
    environ["PATH"] = str(tmp_path / "empty")
    report = json.loads(run_launcher(["doctor", "--json"], environ, launcher).stdout)
    assert report["vllm"]["found"] is False and report["vllm"]["executable"] is None
    (advice,) = (r for r in report["recommendations"] if r["id"] == "vllm-not-found")
    assert "see above" not in advice["text"] and "vllm not found" in advice["text"]

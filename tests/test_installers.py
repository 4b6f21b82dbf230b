"""Conformance: the pipx_launcher against environments the real installers made.

For every layout in tests/installers.py (pip, virtualenv, uv plain and relocatable,
uv tool, pipx, pip --user with and without PYTHONUSERBASE, conda-style prefixes; short
and long paths): the plan chooses that environment's own libiomp5.so, and a real exec
maps it in the stand-in vLLM. Without intel-openmp, the "Fix:" the pipx_launcher prints and
doctor's recommendation are run as printed, and the next plan finds the library.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from .conftest import read_record, run_launcher
from .installers import (
    LAYOUTS,
    SD,
    Installed,
    chosen_iomp,
    dry_run,
    externally_managed_user,
    pip_venv,
    pip_venv_without_pip,
    printed_fix,
    run_fix,
    uv_venv,
)

pytestmark = [
    pytest.mark.installers,
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 intel-openmp"),
]


def install(
    layout: str, tmp_path: Path, offline_environ: dict[str, str], with_iomp: bool
) -> Installed:
    where, installer = LAYOUTS[layout]
    installed = installer(tmp_path / where, offline_environ, with_iomp)
    offline_environ.update(installed.environ)
    return installed


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_installer_gets_its_own_library_chosen_and_mapped(
    layout: str, tmp_path: Path, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    installed = install(layout, tmp_path, offline_environ, with_iomp=True)
    assert installed.library.is_file(), f"{layout} put no libiomp5.so at {installed.library}"
    offline_environ["PATH"] = f"{installed.vllm.parent}:{offline_environ['PATH']}"
    plan = dry_run(pipx_launcher, offline_environ)
    iomp = chosen_iomp(plan)
    assert (iomp["path"], iomp["origin"], iomp["flavor"]) == (
        str(installed.library),
        "vllm-environment",
        "intel",
    ), plan
    assert plan["warnings"] == [], plan["warnings"]

    record_file = tmp_path / "record.json"
    result = run_launcher(
        ["-q", *SD], {**offline_environ, "RECORD_TO": str(record_file)}, pipx_launcher
    )
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
        "conda-prefix",
        "conda-long-prefix-env-shebang",
    ],
)
def test_the_printed_fix_installs_the_library_where_the_next_plan_finds_it(
    layout: str, tmp_path: Path, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    if layout == "externally-managed" and not Path("/usr/lib/python3/dist-packages/pip").is_dir():
        pytest.skip("needs Debian's python3 with pip (python3-pip), externally managed")
    installer = FIX_LAYOUTS.get(layout) or LAYOUTS[layout][1]
    installed = installer(tmp_path / layout, offline_environ, False)
    offline_environ.update(installed.environ)
    offline_environ["PATH"] = f"{installed.vllm.parent}:{offline_environ['PATH']}"
    plan = dry_run(pipx_launcher, offline_environ)
    assert plan["preload"] == []
    fix = printed_fix(plan, "not found")

    report = json.loads(run_launcher(["doctor", "--json"], offline_environ, pipx_launcher).stdout)
    advice = {r["id"]: r for r in report["recommendations"]}
    assert advice["install-intel-openmp"]["command"] == fix  # one source for both

    run_fix(fix, offline_environ)
    iomp = chosen_iomp(dry_run(pipx_launcher, offline_environ))
    assert iomp["path"] == str(installed.library)


def test_a_moved_venv_names_its_missing_interpreter(
    tmp_path: Path, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    original = pip_venv(tmp_path / "before", offline_environ, True)
    moved = tmp_path / "after"
    shutil.move(tmp_path / "before", moved)
    vllm = moved / "bin" / "vllm"
    result = run_launcher(["--vllm", str(vllm), *SD], offline_environ, pipx_launcher)
    assert result.returncode == 126
    (line,) = result.stderr.splitlines()
    interpreter = original.vllm.parent / "python"  # pip writes its sys.executable
    assert line.startswith("vllm-cpu-launch: error: ")
    assert f"runs the interpreter {interpreter}, which does not exist" in line
    assert f"its environment {moved} was moved" in line

    report = json.loads(
        run_launcher(
            ["--vllm", str(vllm), "doctor", "--json"], offline_environ, pipx_launcher
        ).stdout
    )
    assert report["vllm"]["found"] is True
    assert report["vllm"]["executable"] == str(vllm)
    assert str(interpreter) in report["vllm"]["error"]
    ids = [r["id"] for r in report["recommendations"]]
    assert "vllm-broken" in ids and "vllm-not-found" not in ids
    assert "see above" not in json.dumps(report)


def test_nothing_found_is_the_only_not_found(
    tmp_path: Path, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    offline_environ["PATH"] = str(tmp_path / "empty")
    report = json.loads(run_launcher(["doctor", "--json"], offline_environ, pipx_launcher).stdout)
    assert report["vllm"]["found"] is False and report["vllm"]["executable"] is None
    (advice,) = (r for r in report["recommendations"] if r["id"] == "vllm-not-found")
    assert "see above" not in advice["text"] and "vllm not found" in advice["text"]

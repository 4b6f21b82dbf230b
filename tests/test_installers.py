"""Conformance: the pipx_launcher against environments the real installers made.

For every layout in tests/installers.py (pip, virtualenv, uv plain and relocatable,
uv tool, pipx, pip --user with and without PYTHONUSERBASE, conda-style prefixes; short
and long paths): the plan chooses that environment's own libiomp5.so, and a real exec
maps it in the stand-in vLLM. Without intel-openmp, the "Fix:" the pipx_launcher prints is
run as printed in tests/test_fixes.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import pytest
from checkout import checkout_copy

from .conftest import LAUNCHER, SystemHost, read_record, run_launcher
from .installers import (
    BASE_PYTHON,
    LAYOUTS,
    NEWEST_IOMP,
    SD,
    STANDIN,
    Installed,
    chosen_iomp,
    dry_run,
    newcomer_shell,
    newest_iomp_wheels,
    pip_venv,
    readme_install_blocks,
    run_block,
    run_tool,
)

DEFAULT_PYTHON_MINOR = 11  # the Python the e2e environment is made with (3.11 here)
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
    layout: str,
    tmp_path: Path,
    offline_environ: dict[str, str],
    pipx_launcher: list[str],
    system_host: SystemHost,
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
    assert record["LD_PRELOAD"] == system_host.preload(installed.library)
    assert os.path.realpath(installed.library) in record["mapped"]  # type: ignore[operator]
    assert record["argv"] == SD


# Reads the maps of the process the launcher execs: which libiomp5 the loader mapped. The
# maps name the host's files too, whatever bytes their names hold: read as bytes.
MAPPED_IOMP = """\
import os
maps = open("/proc/self/maps", "rb").read().splitlines()
print(*sorted({os.fsdecode(line.split()[-1]) for line in maps if b"libiomp5" in line}))
"""


def test_the_newest_intel_openmp_is_found_checked_and_preloaded(
    tmp_path: Path, offline_environ: dict[str, str], wheelhouse: Path
) -> None:
    """intel-openmp 2026.2.0 (2026-10), installed by pip into a fresh venv with what it
    requires (intel-cmplr-lib-ur 2026.2.0, resolved offline from the cached wheels), is
    found in that environment, checked as Intel's runtime, preloaded by the plan, and
    mapped by a real exec, as vLLM's pinned 2024.2.1 is above."""
    venv = tmp_path / "venv"
    offline_environ["PIP_FIND_LINKS"] = f"{wheelhouse} {newest_iomp_wheels()}"
    run_tool([BASE_PYTHON, "-m", "venv", str(venv)], offline_environ)
    python = str(venv / "bin" / "python")
    run_tool([python, "-m", "pip", "install", STANDIN, NEWEST_IOMP], offline_environ)
    listed = run_tool([python, "-m", "pip", "list", "--format", "json"], offline_environ)
    versions = {item["name"]: item["version"] for item in json.loads(listed)}
    assert versions["intel-openmp"] == versions["intel-cmplr-lib-ur"] == "2026.2.0"
    library = venv / "lib" / "libiomp5.so"
    plan = dry_run(list(LAUNCHER), offline_environ, "--vllm", str(venv / "bin" / "vllm"))
    iomp = chosen_iomp(plan)
    assert (iomp["path"], iomp["origin"], iomp["flavor"]) == (
        str(library),
        "vllm-environment",
        "intel",
    ), plan
    assert plan["warnings"] == [], plan["warnings"]
    program = ["exec", "--", python, "-c", MAPPED_IOMP]
    result = run_launcher(["-q", "--iomp", "always", *program], offline_environ)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.split() == [str(library)]


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


# The launcher's floor (setup.cfg's python_requires), where this machine has it.
PYTHON_FLOOR = sorted(glob.glob("/root/.pyenv/versions/3.10.*/bin/python3.10"))
PYTHONS = [pytest.param(BASE_PYTHON, id="base")] + [
    pytest.param(python, id="3.10") for python in PYTHON_FLOOR[:1]
]


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("block", ["launcher", "wheel"])
def test_the_readmes_install_block_installs_a_working_launcher(
    block: str, python: str, tmp_path: Path
) -> None:
    """The README's lines, as written, by the real pip (and build) in a fresh shell whose
    HOME is new and whose `python3` is the base Python or the floor the README names
    (3.10): afterwards the block's environment (`~/.venvs/vllm-cpu-launch`, the wheel's
    `~/.venvs/from-wheel`) runs the launcher and holds the plugin's entry point."""
    lines = readme_install_blocks()[block]
    environ = newcomer_shell(tmp_path / "home", python)
    run_block(lines, checkout_copy(tmp_path / "vllm-cpu-launch"), environ)
    venv = (
        tmp_path / "home" / ".venvs" / {"launcher": "vllm-cpu-launch", "wheel": "from-wheel"}[block]
    )
    version = run_launcher(["--version"], environ, [str(venv / "bin" / "vllm-cpu-launch")])
    assert version.returncode == 0 and version.stdout.startswith("vllm-cpu-launch "), version
    (entry_points,) = venv.glob("lib/python3.*/site-packages/vllm_cpu_launch-*/entry_points.txt")
    assert "vllm_cpu_launch = vllm_cpu_launch.plugin:register" in entry_points.read_text()


def test_the_readmes_vllm_block_is_what_the_newcomer_e2e_runs() -> None:
    """The vLLM block installs vllm-cpu and removes the unusable packages exactly as
    scripts/vllm_env.py does for every e2e test (tests/e2e/test_newcomer.py runs the block
    itself, as written)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from vllm_env import DEFAULT_RELEASE, UNUSABLE_PACKAGES, requirement

    assert readme_install_blocks()["vllm"] == [
        f"python3.{DEFAULT_PYTHON_MINOR} -m venv ~/vllm-env",
        f"~/vllm-env/bin/pip install {requirement(DEFAULT_RELEASE)}",
        f"~/vllm-env/bin/pip uninstall -y {' '.join(UNUSABLE_PACKAGES)}",
        "~/vllm-env/bin/pip install .",
    ]

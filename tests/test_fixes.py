"""The command that installs a missing library (vllm_cpu_launch/fixes.py), run as the
launcher prints it: "Every Fix: the launcher prints is a command someone will paste: run
it in a test". Intel OpenMP's, into each kind of environment the real installers make
(tests/installers.py: pip, ensurepip, uv, pipx, pip --user, PEP 668, conda-style), after
which the next plan finds the library; tcmalloc's, by apt-get (simulated, as root) and
conda (named: conda cannot be fetched here).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_cpu_launch.libraries import TCMALLOC, Host, find_library

from .conftest import (
    DEB_CACHE,
    bare_system,
    clean_environ,
    install_recorder,
    make_environment,
    run_launcher,
)
from .hardening import NGRAM
from .installers import (
    LAYOUTS,
    chosen_iomp,
    dry_run,
    externally_managed_user,
    offline,
    pip_venv,
    pip_venv_without_pip,
    printed_fix,
    run_fix,
    uv_venv,
)
from .test_cli import launcher
from .test_libraries import CMEEL_ALIAS, arm_environment, arm_plan, cmeel_wheels, site_packages

__all__ = ["cmeel_wheels"]  # the fixture, for pytest

# Layouts whose Fix is checked: each kind of advice fixes.py gives, once.
FIX_LAYOUTS = {
    "pip-venv": pip_venv,
    "venv-without-pip": pip_venv_without_pip,
    "uv-venv": lambda r, e, i: uv_venv(r, e, i),
    "externally-managed": externally_managed_user,
}


@pytest.mark.installers
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 intel-openmp")
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


def tcmalloc_fix(tmp_path: Path, vllm: Path, strict: bool) -> str:
    """The Fix of the launcher's one message about a missing tcmalloc (`--tcmalloc always`)."""
    args = ["--strict"] * strict + ["--tcmalloc", "always", "--vllm", str(vllm), "serve", "m"]
    record = str(tmp_path / "record.json")
    # A host without a system tcmalloc: the message this test reads is that host's.
    result = launcher(tmp_path, [*args, "-sc", NGRAM], RECORD_TO=record, **bare_system(tmp_path))
    assert result.returncode == (3 if strict else 0), result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "tcmalloc not found" in line]
    assert "intel-openmp" not in line, line
    return line.split(" Fix: ", 1)[1].split("  (", 1)[0]


@pytest.mark.parametrize("strict", [True, False])
def test_missing_tcmalloc_prints_a_fix_that_installs_tcmalloc(
    tmp_path: Path, vllm_env: Path, debian_root: Path, strict: bool
) -> None:
    """The printed Fix, simulated by apt-get as root, installs the package whose files,
    unpacked as they would be installed, the launcher's search then finds."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("the Debian/Ubuntu fix: needs apt-get, run as root")
    fix = tcmalloc_fix(tmp_path, vllm_env / "bin" / "vllm", strict)
    assert fix == "apt-get install libtcmalloc-minimal4"
    simulated = subprocess.run(
        # --reinstall: on a machine that has it installed, apt simulates installing it too
        [*shlex.split(fix), "--simulate", "--reinstall"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    package = fix.split()[-1]
    assert simulated.returncode == 0, simulated.stderr
    assert f"Inst {package} " in simulated.stdout, simulated.stdout
    (deb,) = DEB_CACHE.glob(f"{package}_*.deb")  # the package debian_root downloaded
    installed = tmp_path / "installed"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(installed)], check=True, timeout=120)
    host = Host({}, "x86_64", os.geteuid(), str(tmp_path / "no-launcher"), root=str(installed))
    search = find_library(TCMALLOC, host, None)
    assert search.chosen is not None and search.chosen.origin == "system", search.candidates
    assert search.chosen.path.startswith(str(installed / "usr" / "lib"))


def test_missing_tcmalloc_in_a_conda_environment_names_condas_package(tmp_path: Path) -> None:
    """conda-forge's gperftools goes into the environment's lib/, which is searched
    (conda itself cannot be fetched here to run it)."""
    environment = make_environment(tmp_path / "conda-env")
    (environment / "conda-meta").mkdir()
    fix = tcmalloc_fix(tmp_path, install_recorder(environment), True)
    assert fix == f"conda install --prefix {environment} --channel conda-forge gperftools"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 wheels")
def test_on_aarch64_the_printed_fix_installs_cmeel_libomp_where_the_plan_looks(
    tmp_path: Path, cmeel_wheels: Path
) -> None:
    """Nothing installed: the warning's fix is cmeel-libomp by uv (no pip in a uv venv).
    Run as printed on this x86-64 machine, it installs the x86-64 wheel, which the plan
    then finds in its place and turns down for its ELF machine: the stand-in's one limit."""
    root = arm_environment(tmp_path, cmeel_wheels, platform=None)
    forced = arm_plan(tmp_path, root, "always")
    assert forced["preload"] == [] and forced["missing"] == ["iomp"]
    (warning,) = forced["warnings"]
    assert warning.startswith("LLVM's libomp (a libiomp5.so) not found")
    fix = warning.rpartition("Fix: ")[2].partition("  (")[0]
    assert fix == f"uv pip install --python {root / 'bin' / 'python'} cmeel-libomp"
    environ = offline(clean_environ(tmp_path), cmeel_wheels)
    subprocess.run(["sh", "-c", fix], env=environ, check=True, timeout=300, capture_output=True)
    after = arm_plan(tmp_path, root, "always")
    (found,) = after["candidates"]
    assert found["origin"] == "cmeel-libomp-package"
    assert found["path"] == str(site_packages(root) / CMEEL_ALIAS)
    assert found["reason"] == "built for x86_64; this host is aarch64"

"""vLLM stand-ins installed by the real installers, the way people install vLLM.

Each installer writes its own wrapper for the stand-in's `vllm` console script and puts
intel-openmp where it puts everything else: nothing here lays out an environment by
hand, except the conda prefix (conda itself cannot be fetched here), which is a real
Python prefix with `conda-meta/` into which the real pip installs.

All installs are offline: the wheels (the stand-in, built here by pip, and
intel-openmp with its one dependency, downloaded once and cached like the vLLM
environment) come from a local wheelhouse through PIP_FIND_LINKS/UV_FIND_LINKS, so a
"Fix:" the launcher prints is run exactly as printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from checkout import checkout_copy

from vllm_cpu_launch.records import record

from .conftest import RECORDER, REPO, clean_environ, run_launcher

IOMP_WHEELS = ("intel-openmp==2024.2.1", "intel-cmplr-lib-ur==2024.2.1")
WHEEL_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-cpu-launch" / "wheels"
)
# The newest intel-openmp (2026-10): its wheel requires intel-cmplr-lib-ur of the same
# release, which requires tcmlib and umf; all four cached apart from vLLM's pinned pair, so
# that the other tests' wheelhouse keeps offering 2024.2.1 alone.
NEWEST_IOMP = "intel-openmp==2026.2.0"
NEWEST_IOMP_CACHE = WHEEL_CACHE / "intel-openmp-2026.2.0"
STANDIN = "vllm-recorder"  # the stand-in distribution; its console script is `vllm`
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)  # no intel-openmp there
TOOLS = Path(sys.executable).parent  # uv, virtualenv and pipx from the test extra
INSTALL_LIMIT_S = 600.0
NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
SD = ["serve", "m", "--speculative-config", NGRAM]
FIX = re.compile(r"Fix: (.+?)(?:  \(|$)")  # the command, before "  (where...)" if any
# Longer than the kernel's 127/255-byte #! limits: installers switch to /bin/sh trampolines.
LONG = "x" * 150


def run_tool(command: list[str], environ: Mapping[str, str], cwd: Path | None = None) -> str:
    """Run an installer (in `cwd`, if given); its failure is the test's failure, with what
    it said."""
    result = subprocess.run(
        command,
        cwd=cwd,
        env=dict(environ),
        capture_output=True,
        text=True,
        timeout=INSTALL_LIMIT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def build_wheelhouse(directory: Path) -> Path:
    """intel-openmp's wheels (downloaded once, cached) and the stand-in, built by pip."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    if len(list(WHEEL_CACHE.glob("intel_*.whl"))) < len(IOMP_WHEELS):
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
        run_tool([*download, "-d", str(WHEEL_CACHE), *IOMP_WHEELS], os.environ)
    directory.mkdir(parents=True)
    for wheel in WHEEL_CACHE.glob("intel_*.whl"):
        (directory / wheel.name).symlink_to(wheel)
    return standin_wheel(directory, STANDIN, "1.0")


def newest_iomp_wheels() -> Path:
    """NEWEST_IOMP and what it requires, resolved by pip and downloaded once (cached)."""
    ready = NEWEST_IOMP_CACHE / "complete"
    if not ready.exists():
        NEWEST_IOMP_CACHE.mkdir(parents=True, exist_ok=True)
        download = [sys.executable, "-m", "pip", "download", "-q", "-d", str(NEWEST_IOMP_CACHE)]
        run_tool([*download, NEWEST_IOMP], os.environ)
        ready.write_text("")
    return NEWEST_IOMP_CACHE


def standin_wheel(directory: Path, name: str, version: str) -> Path:
    """Build, with pip, a distribution NAME==VERSION whose console script `vllm` is the
    recorder, into directory (the wheelhouse); returns directory."""
    source = directory.parent / f"standin-source-{name}-{version}"
    package = source / "vllm_recorder"
    package.mkdir(parents=True, exist_ok=True)  # built again by another test: the same files
    body = "".join(f"    {line}\n" for line in RECORDER.splitlines())
    (package / "__init__.py").write_text(f"def main():\n{body}")
    (source / "pyproject.toml").write_text(
        "[build-system]\nrequires = ['setuptools>=61']\nbuild-backend = 'setuptools.build_meta'\n"
        f"[project]\nname = '{name}'\nversion = '{version}'\n"
        "[project.scripts]\nvllm = 'vllm_recorder:main'\n"
    )
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]  # setuptools from PyPI
    run_tool([*build, "-w", str(directory), str(source)], os.environ)
    return directory


def offline(environ: Mapping[str, str], wheelhouse: Path) -> dict[str, str]:
    """The installers' environment: the wheelhouse instead of an index, tools on PATH."""
    return {
        **environ,
        "PATH": f"{TOOLS}:{environ.get('PATH', os.defpath)}",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheelhouse),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "UV_NO_INDEX": "1",
        "UV_FIND_LINKS": str(wheelhouse),
        "UV_LINK_MODE": "copy",  # a hard link would share (and chown) uv's cache files
        "UV_CACHE_DIR": str(Path.home() / ".cache" / "uv"),
        "UV_PYTHON_DOWNLOADS": "never",
    }


@record
class Installed:
    """A stand-in vLLM as an installer left it."""

    vllm: Path  # the console script as a user runs it
    library: Path  # where the installer put libiomp5.so (whether or not it did)
    environ: dict[str, str]  # the variables the install used (PIPX_HOME, PYTHONUSERBASE...)


def packages(with_iomp: bool) -> list[str]:
    return [STANDIN, "intel-openmp"] if with_iomp else [STANDIN]


def pip_venv(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    run_tool([BASE_PYTHON, "-m", "venv", str(root)], environ)
    run_tool([str(root / "bin" / "python"), "-m", "pip", "install", *packages(with_iomp)], environ)
    return Installed(root / "bin" / "vllm", root / "lib" / "libiomp5.so", {})


def pip_venv_without_pip(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    """`python -m venv --without-pip`, the stand-in installed into it by an outside pip."""
    run_tool([BASE_PYTHON, "-m", "venv", "--without-pip", str(root)], environ)
    python = str(root / "bin" / "python")
    run_tool(
        [sys.executable, "-m", "pip", "--python", python, "install", *packages(with_iomp)], environ
    )
    return Installed(root / "bin" / "vllm", root / "lib" / "libiomp5.so", {})


def virtualenv(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    run_tool([str(TOOLS / "virtualenv"), "-q", str(root)], environ)
    run_tool([str(root / "bin" / "pip"), "install", *packages(with_iomp)], environ)
    return Installed(root / "bin" / "vllm", root / "lib" / "libiomp5.so", {})


def uv_venv(
    root: Path, environ: dict[str, str], with_iomp: bool, *flags: str, python: str = BASE_PYTHON
) -> Installed:
    run_tool([str(TOOLS / "uv"), "venv", "-q", "--python", python, *flags, str(root)], environ)
    python = str(root / "bin" / "python")
    run_tool(
        [str(TOOLS / "uv"), "pip", "install", "-q", "--python", python, *packages(with_iomp)],
        environ,
    )
    return Installed(root / "bin" / "vllm", root / "lib" / "libiomp5.so", {})


def uv_relocatable_moved(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    """A relocatable venv keeps working after a move: its trampoline is relative."""
    first = uv_venv(root.with_name(root.name + "-before-move"), environ, with_iomp, "--relocatable")
    shutil.move(first.vllm.parent.parent, root)
    return Installed(root / "bin" / "vllm", root / "lib" / "libiomp5.so", {})


def uv_tool(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    """`uv tool install`: its own pip-less venv, a link in UV_TOOL_BIN_DIR."""
    variables = {"UV_TOOL_DIR": str(root / "tools"), "UV_TOOL_BIN_DIR": str(root / "bin")}
    extra = ["--with", "intel-openmp"] if with_iomp else []
    command = [str(TOOLS / "uv"), "tool", "install", "-q", "--python", BASE_PYTHON, *extra, STANDIN]
    run_tool(command, {**environ, **variables})
    library = root / "tools" / STANDIN / "lib" / "libiomp5.so"
    return Installed(root / "bin" / "vllm", library, variables)


def pipx(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    """`pipx install` then `pipx inject`: a venv under PIPX_HOME, a link in PIPX_BIN_DIR."""
    variables = {"PIPX_HOME": str(root / "pipx"), "PIPX_BIN_DIR": str(root / "bin")}
    merged = {**environ, **variables}
    run_tool([str(TOOLS / "pipx"), "install", "--python", BASE_PYTHON, STANDIN], merged)
    if with_iomp:
        run_tool([str(TOOLS / "pipx"), "inject", STANDIN, "intel-openmp"], merged)
    library = root / "pipx" / "venvs" / STANDIN / "lib" / "libiomp5.so"
    return Installed(root / "bin" / "vllm", library, variables)


def pip_user(root: Path, environ: dict[str, str], with_iomp: bool, custom: bool) -> Installed:
    """`pip install --user`, into ~/.local or into PYTHONUSERBASE."""
    variables = {"PYTHONUSERBASE": str(root / "userbase")} if custom else {}
    base = root / "userbase" if custom else Path(environ["HOME"]) / ".local"
    command = [BASE_PYTHON, "-m", "pip", "install", "--user", *packages(with_iomp)]
    run_tool(command, {**environ, **variables})
    return Installed(base / "bin" / "vllm", base / "lib" / "libiomp5.so", variables)


def conda_prefix(
    root: Path, environ: dict[str, str], with_iomp: bool, env_shebang: bool
) -> Installed:
    """A conda-style prefix: a real Python of its own (the base interpreter's binary,
    its standard library linked in, its own empty site-packages) and `conda-meta/`;
    the real pip installs into it. With `env_shebang`, the script's first line becomes
    what conda writes for prefixes too long for `#!`: `#!/usr/bin/env python3.N`
    (conda/core/portability.py, replace_long_shebang)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (root / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath(BASE_PYTHON), root / "bin" / version)
    (root / "bin" / "python").symlink_to(version)
    library = root / "lib" / version
    (library / "site-packages").mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (library / entry.name).symlink_to(entry)
    (root / "conda-meta").mkdir()
    (root / "conda-meta" / "history").write_text(
        f"==> 2026-12-01 00:00:00 <==\n+defaults::{version}\n"
    )
    python = str(root / "bin" / version)
    run_tool(
        [sys.executable, "-m", "pip", "--python", python, "install", *packages(with_iomp)], environ
    )
    script = root / "bin" / "vllm"
    if env_shebang:
        lines = script.read_text().splitlines(keepends=True)
        script.write_text(f"#!/usr/bin/env {version}\n" + "".join(lines[1:]))
    variables = {"PATH": f"{root / 'bin'}:{environ['PATH']}"} if env_shebang else {}
    return Installed(script, root / "lib" / "libiomp5.so", variables)


def externally_managed_user(root: Path, environ: dict[str, str], with_iomp: bool) -> Installed:
    """Debian's own python3 (PEP 668 marker): vLLM with `--user --break-system-packages`."""
    command = ["/usr/bin/python3", "-m", "pip", "install", "--user", "--break-system-packages"]
    run_tool([*command, *packages(with_iomp)], environ)
    base = Path(environ["HOME"]) / ".local"
    return Installed(base / "bin" / "vllm", base / "lib" / "libiomp5.so", {})


Installer = Callable[[Path, dict[str, str], bool], Installed]
# Every layout of the conformance suite: name -> (where to install under tmp, installer).
LAYOUTS: dict[str, tuple[str, Installer]] = {
    "pip-venv": ("venv", pip_venv),
    "pip-venv-long-path": (f"{LONG}/venv", pip_venv),
    # U+00A0 is white space to Python's str.split(), not to the kernel or the loader.
    "pip-venv-no-break-space": ("no\u00a0break/venv", pip_venv),
    "virtualenv": ("virtualenv", virtualenv),
    "virtualenv-long-path": (f"{LONG}/virtualenv", virtualenv),
    "uv-venv": ("uv", lambda r, e, i: uv_venv(r, e, i)),
    "uv-venv-long-path": (f"{LONG}/uv", lambda r, e, i: uv_venv(r, e, i)),
    "uv-relocatable": ("uv-reloc", lambda r, e, i: uv_venv(r, e, i, "--relocatable")),
    "uv-relocatable-moved": ("uv-moved", uv_relocatable_moved),
    "uv-tool": ("uv-tool", uv_tool),
    "pipx": ("pipx", pipx),
    "pip-user": ("user", lambda r, e, i: pip_user(r, e, i, custom=False)),
    "pip-user-custom-base": ("user", lambda r, e, i: pip_user(r, e, i, custom=True)),
    "conda-prefix": ("conda", lambda r, e, i: conda_prefix(r, e, i, env_shebang=False)),
    "conda-long-prefix-env-shebang": (
        f"{LONG}/conda",
        lambda r, e, i: conda_prefix(r, e, i, env_shebang=True),
    ),
}


def install_launcher(root: Path) -> list[str]:
    """The launcher installed by pipx from this checkout, in a venv of its own without
    intel-openmp, so that a library found proves the target's environment was found,
    not the launcher's. (Its dependencies come from PyPI or pip's cache.)"""
    variables = {"PIPX_HOME": str(root / "pipx"), "PIPX_BIN_DIR": str(root / "bin")}
    source = checkout_copy(root / "source")
    command = [str(TOOLS / "pipx"), "install", "--python", BASE_PYTHON, str(source)]
    run_tool(command, {**os.environ, **variables})
    return [str(root / "bin" / "vllm-cpu-launch")]


def dry_run(launcher: list[str], environ: dict[str, str], *args: str) -> dict[str, Any]:
    """The launcher's plan (--dry-run --json) for an SD `serve`."""
    result = run_launcher(["--dry-run", "--json", *args, *SD], environ, launcher)
    assert result.returncode == 0, result.stderr
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


def chosen_iomp(plan: dict[str, Any]) -> dict[str, str]:
    (iomp,) = (p for p in plan["preload"] if p["kind"] == "iomp")
    return dict(iomp)


def run_fix(command: str, offline_environ: dict[str, str]) -> None:
    result = subprocess.run(
        ["sh", "-c", command],
        env=offline_environ,
        capture_output=True,
        text=True,
        timeout=INSTALL_LIMIT_S,
        check=False,
    )
    assert result.returncode == 0, f"{command}\n{result.stderr}"


def printed_fix(plan: dict[str, Any], needle: str) -> str:
    (warning,) = (w for w in plan["warnings"] if needle in w)
    match = FIX.search(warning)
    assert match, warning
    return match.group(1)


# ---------------------------------------------------------------- the README's install lines

README_BLOCK = re.compile(r"<!-- install: (\w+) -->\n```bash\n(.*?)```", re.DOTALL)


def readme_install_blocks() -> dict[str, list[str]]:
    """The README's install blocks (`<!-- install: NAME -->` before a bash block), by
    name: their command lines, exactly as written."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return {name: body.strip().splitlines() for name, body in README_BLOCK.findall(text)}


def newcomer_shell(home: Path, python: str = BASE_PYTHON) -> dict[str, str]:
    """A fresh shell: HOME of its own, `python3` that Python (the base one by default; no
    venv active, no PYTHONPATH), PyPI as configured on this machine."""
    bin_directory = home / "bin"
    bin_directory.mkdir(parents=True, exist_ok=True)
    (bin_directory / "python3").symlink_to(python)
    steering = ("PYTHONPATH", "VIRTUAL_ENV", "PIP_NO_INDEX", "PIP_FIND_LINKS", "LD_PRELOAD")
    environ = {k: v for k, v in os.environ.items() if k not in steering}
    environ.update(HOME=str(home), PATH=f"{bin_directory}:{environ.get('PATH', os.defpath)}")
    return environ


def run_block(lines: list[str], checkout: Path, environ: Mapping[str, str]) -> None:
    """The block's lines, one bash script, in the checkout, stopping at the first failure."""
    run_tool(["bash", "-ec", "\n".join(lines)], environ, cwd=checkout)


# ---------------------------------------------------------------- fixtures (conftest.py plugin)


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheelhouse(tmp_path_factory.mktemp("installers") / "wheelhouse")


@pytest.fixture(scope="session")
def pipx_launcher(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return install_launcher(tmp_path_factory.mktemp("launcher") / "venv")


@pytest.fixture
def offline_environ(tmp_path: Path, wheelhouse: Path) -> Iterator[dict[str, str]]:
    """The caller's environment for installers and the launcher: offline, HOME in tmp_path."""
    (tmp_path / "home").mkdir()
    yield offline(clean_environ(tmp_path), wheelhouse)
    # Installed environments are large (intel-openmp is 260 MB unpacked): drop them now.
    for child in tmp_path.iterdir():
        if child.name != "home":
            shutil.rmtree(child, ignore_errors=True)

"""The command that installs Intel OpenMP (or tcmalloc) where the started vLLM will find it.

Each installer's environment needs its own: pip where the environment has pip, uv
where it was made by uv without pip, ensurepip first in another pip-less venv or conda
prefix, pipx's `inject` for a pipx venv, `--user` (with `--break-system-packages` under
PEP 668) for a base interpreter. Each form printed here is run by
tests/test_installers.py in an environment the real installer made. tcmalloc comes from
no Python package: conda's gperftools or the system's package (tcmalloc_command). Read
only when a library is missing: the exec path never gets here.
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import TYPE_CHECKING

from vllm_cpu_launch.libraries import TCMALLOC
from vllm_cpu_launch.target import python_libraries

if TYPE_CHECKING:
    from vllm_cpu_launch.target import Target

PACKAGE = "intel-openmp"
LLVM_PACKAGE = "cmeel-libomp"  # LLVM's libomp, x86-64 and aarch64 wheels (libraries.cmeel_libomp)


def externally_managed(prefix: str) -> bool:
    """PEP 668: the distribution manages this interpreter; pip refuses to install."""
    return any(
        os.path.exists(os.path.join(d, "EXTERNALLY-MANAGED")) for d in python_libraries(prefix)
    )


def has_pip(prefix: str) -> bool:
    return any(
        os.path.isdir(os.path.join(d, "site-packages", "pip")) for d in python_libraries(prefix)
    )


def made_by_uv(prefix: str) -> bool:
    """uv writes `uv = VERSION` into the pyvenv.cfg of every environment it creates."""
    try:
        with open(os.path.join(prefix, "pyvenv.cfg"), encoding="utf-8") as stream:
            return any(line.split("=")[0].strip() == "uv" for line in stream)
    except OSError:
        return False


def install_command(target: Target, package: str = PACKAGE) -> tuple[str, str]:
    """(command, where it installs) for an OpenMP runtime's wheel (Intel's by default) in
    the target's environment.

    The command is "" when the target names no interpreter to install with.
    """
    python, prefix = target.interpreter, target.prefix
    if not python or not prefix:
        return "", "into the Python environment that runs vLLM"
    quoted = shlex.quote(python)
    if target.user_base:
        managed = " --break-system-packages" if externally_managed(prefix) else ""
        return f"{quoted} -m pip install --user{managed} {package}", f"into {target.user_base}"
    venv = os.path.exists(os.path.join(prefix, "pyvenv.cfg"))
    own_packages = venv or os.path.isdir(os.path.join(prefix, "conda-meta"))
    if venv and os.path.exists(os.path.join(prefix, "pipx_metadata.json")):
        name = shlex.quote(os.path.basename(prefix))
        return f"pipx inject {name} {package}", f"into pipx's venv {prefix}"
    if own_packages and not has_pip(prefix):
        if made_by_uv(prefix):
            return f"uv pip install --python {quoted} {package}", f"into {prefix} (no pip there)"
        install = f"{quoted} -m ensurepip && {quoted} -m pip install {package}"
        return install, f"into {prefix} (no pip there yet)"
    if not venv and externally_managed(prefix):
        # intel-openmp and cmeel-libomp hold only libraries (no Python modules): nothing
        # of the distribution's can break; the launcher searches the user base too.
        command = f"{quoted} -m pip install --user --break-system-packages {package}"
        return command, "into your user base (this Python is externally managed, PEP 668)"
    return f"{quoted} -m pip install {package}", f"into {prefix}"


def tcmalloc_command(target: Target | None, path_variable: str | None) -> tuple[str, str]:
    """(command, how or where it installs) for tcmalloc, in a place the launcher searches.

    A conda environment gets conda-forge's gperftools in its own lib/ (searched as the
    vLLM environment's); elsewhere Debian's and Ubuntu's libtcmalloc-minimal4 puts
    libtcmalloc_minimal.so.4 in the loader's directory. Other systems get no command
    (tests/test_cli.py runs the apt-get one, simulated, and finds its files). apt-get is
    looked for on `path_variable`, the PATH of the host the plan is for.
    """
    prefix = target.prefix if target else None
    if prefix and os.path.isdir(os.path.join(prefix, "conda-meta")):
        command = f"conda install --prefix {shlex.quote(prefix)} --channel conda-forge gperftools"
        return command, f"into {prefix}"
    if shutil.which("apt-get", path=path_variable):
        return "apt-get install libtcmalloc-minimal4", "as root, from Debian's or Ubuntu's archive"
    return "", (
        "with the system's package manager (gperftools' libtcmalloc_minimal.so.4: "
        "gperftools-libs on Fedora and RHEL), or name it with --tcmalloc-path"
    )


def fix_hint(target: Target, kind: str, package: str, path_variable: str | None) -> str:
    """The install command for `kind` (an OpenMP runtime: `package`) and where it
    installs, as one phrase for a message."""
    if kind == TCMALLOC:
        command, where = tcmalloc_command(target, path_variable)
        return f"{command}  ({where})" if command else f"install tcmalloc {where}"
    command, where = install_command(target, package)
    return f"{command}  ({where})" if command else f"pip install {package}  ({where})"

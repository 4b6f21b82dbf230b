"""The command that installs Intel OpenMP (or tcmalloc) where the started vLLM will find it,
as each installer's environment needs it (tests/test_fixes.py runs each one).
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import TYPE_CHECKING

from vllm_cpu_launch.libraries import TCMALLOC
from vllm_cpu_launch.runtimes import INTEL
from vllm_cpu_launch.target import python_libraries

if TYPE_CHECKING:
    from vllm_cpu_launch.target import Target

PACKAGE = INTEL.wheel  # each runtime family's wheel: runtimes.Family.wheel


def in_libraries(prefix: str, name: str) -> bool:
    return any(os.path.exists(os.path.join(d, name)) for d in python_libraries(prefix))


def made_by_uv(prefix: str) -> bool:
    """uv writes `uv = VERSION` into the pyvenv.cfg of every environment it creates."""
    try:
        with open(os.path.join(prefix, "pyvenv.cfg"), encoding="utf-8") as stream:
            return any(line.split("=")[0].strip() == "uv" for line in stream)
    except OSError:
        return False


def install_command(target: Target, package: str = PACKAGE) -> tuple[str, str]:
    """(command, where it installs) for an OpenMP runtime's wheel in the target's
    environment: pip, uv, ensurepip first, pipx's `inject`, or `--user` under PEP 668."""
    python, prefix = target.interpreter, target.prefix
    if not python or not prefix:
        return "", "into the Python environment that runs vLLM"
    quoted = shlex.quote(python)
    managed = in_libraries(prefix, "EXTERNALLY-MANAGED")
    if target.user_base:
        forced = " --break-system-packages" if managed else ""
        return f"{quoted} -m pip install --user{forced} {package}", f"into {target.user_base}"
    venv = os.path.exists(os.path.join(prefix, "pyvenv.cfg"))
    if venv and os.path.exists(os.path.join(prefix, "pipx_metadata.json")):
        name = shlex.quote(os.path.basename(prefix))
        return f"pipx inject {name} {package}", f"into pipx's venv {prefix}"
    own_packages = venv or os.path.isdir(os.path.join(prefix, "conda-meta"))
    if own_packages and not in_libraries(prefix, "site-packages/pip"):
        if made_by_uv(prefix):
            return f"uv pip install --python {quoted} {package}", f"into {prefix} (no pip there)"
        install = f"{quoted} -m ensurepip && {quoted} -m pip install {package}"
        return install, f"into {prefix} (no pip there yet)"
    if not venv and managed:
        # intel-openmp and cmeel-libomp hold only libraries (no Python modules): nothing
        # of the distribution's can break; the launcher searches the user base too.
        command = f"{quoted} -m pip install --user --break-system-packages {package}"
        return command, "into your user base (this Python is externally managed, PEP 668)"
    return f"{quoted} -m pip install {package}", f"into {prefix}"


def tcmalloc_command(target: Target | None, path_variable: str | None) -> tuple[str, str]:
    """(command, how or where it installs) for tcmalloc where the launcher searches: conda's
    gperftools in a conda environment, else Debian's where apt-get is on `path_variable`."""
    prefix = target.prefix if target else None
    if prefix and os.path.isdir(os.path.join(prefix, "conda-meta")):
        command = f"conda install --prefix {shlex.quote(prefix)} --channel conda-forge gperftools"
        return command, f"into {prefix}"
    if shutil.which("apt-get", path=path_variable):
        return "apt-get install libtcmalloc-minimal4", "as root, from Debian's or Ubuntu's archive"
    where = "gperftools' libtcmalloc_minimal.so.4: gperftools-libs on Fedora and RHEL"
    return "", f"with the system's package manager ({where}), or name it with --tcmalloc-path"


def fix_hint(target: Target, kind: str, package: str, path_variable: str | None) -> str:
    """The install command for `kind` (an OpenMP runtime: `package`) as one phrase."""
    if kind == TCMALLOC:
        command, where = tcmalloc_command(target, path_variable)
        return f"{command}  ({where})" if command else f"install tcmalloc {where}"
    command, where = install_command(target, package)
    return f"{command}  ({where})" if command else f"pip install {package}  ({where})"

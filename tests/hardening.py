"""Helpers for the hardening tests, hostile inputs and broken environments (sections of
test_cli, test_libraries, test_plan, test_target, test_settings and test_trust): fake vLLM
environments, a recording target, runners.

Everything here is real: the launcher runs as `python -m vllm_cpu_launch` in a child
process and execs a real program (a Python script with a `#!` line, laid out like a
venv console script) that records what it received. Timeouts are hang guards only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_cpu_launch.libraries import SYSTEM_ROOT_VARIABLE

from .conftest import HOST_CPUS_VARIABLE, IMPORT_PATH

PYTHON = sys.executable
LAUNCHER: tuple[str, ...] = (PYTHON, "-m", "vllm_cpu_launch")
# The real Intel OpenMP of the `intel-openmp` wheel in the test venv; it is also the
# launcher's own environment's library (origin "launcher-environment").
REAL_IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"
GUARD = 120.0  # seconds; a hang guard, never a speed assertion
ERROR_PREFIX = "vllm-cpu-launch: error: "
NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
STEERING = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "CONDA_PREFIX",
    "VIRTUAL_ENV",
    "CMPLR_ROOT",
    "XDG_CACHE_HOME",
)

# The recording stand-in for `vllm`. It first notes which of fds 0-4 are open (before it
# opens anything itself), then does what the HARDENING_* variables ask, and writes one
# JSON record (atomically, so a reader never sees half of it).
RECORDER = r"""
import json, os, signal, socket, sys, time

fds = {}
for number in range(5):
    try:
        fds[str(number)] = os.readlink(f"/proc/self/fd/{number}")
    except OSError:
        fds[str(number)] = None
status = dict(
    line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line
)
record = {
    "pid": os.getpid(),
    "argv0": os.fsencode(sys.argv[0]).hex(),
    "argv": [os.fsencode(a).hex() for a in sys.argv[1:]],
    "env": {k: os.environ.get(k) for k in ("LD_PRELOAD", "KMP_BLOCKTIME", "LISTEN_PID",
                                           "LISTEN_FDS", "PATH", "HOME")},
    "fds": fds,
    "SigBlk": status.get("SigBlk", "").strip(),
}
if os.environ.get("HARDENING_ACCEPT"):
    listener = socket.socket(fileno=3)
    listener.settimeout(60)
    record["listener"] = list(listener.getsockname())
    connection, _ = listener.accept()
    connection.sendall(f"pid {os.getpid()} listen_pid {os.environ.get('LISTEN_PID')}".encode())
    connection.close()
if os.environ.get("HARDENING_PIPE_FD"):
    os.write(int(os.environ["HARDENING_PIPE_FD"]), f"pipe from {os.getpid()}".encode())
signals_file = os.environ.get("HARDENING_SIGNALS")
if signals_file:
    def caught(number, frame):
        with open(signals_file, "w") as stream:
            stream.write(signal.Signals(number).name)
        os._exit(128 + number)
    signal.signal(signal.SIGTERM, caught)
    signal.signal(signal.SIGINT, caught)
path = os.environ["HARDENING_RECORD"]
with open(path + ".part", "w") as stream:
    json.dump(record, stream)
os.replace(path + ".part", path)
if signals_file:
    deadline = time.monotonic() + 120  # hang guard: no signal came
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(99)
if os.environ.get("HARDENING_KILL"):
    number = int(os.environ["HARDENING_KILL"])
    if number != signal.SIGKILL:
        signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
sys.exit(int(os.environ.get("HARDENING_EXIT", "0")))
"""


def base_environ(home: Path, **extra: str) -> dict[str, str]:
    """The test's environment without anything that steers the launcher; own HOME/XDG.
    The host is one without system libraries (an empty system root, docs/testing.md): what
    these tests assert is the libraries they lay out, whatever this machine has."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in STEERING
        and not key.startswith(("KMP_", "VLLMCPULAUNCH_", "ONEAPI_", "JOURNAL_", "HARDENING_"))
    }
    home.mkdir(parents=True, exist_ok=True)
    environ["HOME"] = str(home)
    environ["XDG_CONFIG_HOME"] = str(home / "xdg-config")
    environ["PYTHONPATH"] = IMPORT_PATH
    (home / "bare-system").mkdir(exist_ok=True)
    environ[SYSTEM_ROOT_VARIABLE] = str(home / "bare-system")
    environ[HOST_CPUS_VARIABLE] = os.environ[HOST_CPUS_VARIABLE]  # conftest's: own
    environ.update(extra)
    return environ


def make_env(root: Path, iomp: bool = True, interpreter: str | None = None) -> Path:
    """A venv-like tree: `bin/python` (a link to a real interpreter) and `lib/`."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "bin" / "python").symlink_to(interpreter or os.path.realpath(PYTHON))
    if iomp:
        shutil.copyfile(REAL_IOMP, root / "lib" / "libiomp5.so")
    return root


def install_recorder(environment: Path, name: str = "vllm") -> Path:
    """A console script like pip writes one: `#!<env>/bin/python`, then the recorder.
    For an interpreter path with spaces, which a `#!` line cannot hold, pip's other form:
    `#!/bin/sh` and a line that execs the interpreter, quoted."""
    script = environment / "bin" / name
    python = environment / "bin" / "python"
    if " " in str(python):
        head = "#!/bin/sh\n'''exec' \"" + str(python) + '" "$0" "$@"\n\' \'\'\''
    else:
        head = f"#!{python}"
    script.write_text(f"{head}\n{RECORDER}")
    script.chmod(0o755)
    return script


def fake_vllm(root: Path, iomp: bool = True) -> Path:
    """`<root>/bin/vllm` in a fresh venv-like tree (with the real libiomp5.so by default)."""
    return install_recorder(make_env(root, iomp=iomp))


def isolated_launcher(root: Path) -> tuple[str, ...]:
    """The launcher under an interpreter link in `<root>/bin`, so that nothing lies
    "beside the launcher's Python" unless a test puts it there. Its sys.prefix is the
    base interpreter's; PYTHONPATH (see `isolated_environ`) brings the package and PyYAML."""
    (root / "bin").mkdir(parents=True, exist_ok=True)
    link = root / "bin" / "python"
    link.symlink_to(os.path.realpath(PYTHON))
    return (str(link), "-m", "vllm_cpu_launch")


def isolated_environ(home: Path, **extra: str) -> dict[str, str]:
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    return base_environ(home, PYTHONPATH=os.pathsep.join((IMPORT_PATH, site)), **extra)


def run(
    args: Sequence[str | bytes],
    environ: Mapping[str, str] | None,
    launcher: Sequence[str] = LAUNCHER,
    prefix: Sequence[str] = (),
    cwd: Path | str | None = None,
    timeout: float = GUARD,
) -> subprocess.CompletedProcess[bytes]:
    """Run the launcher to completion (stdin from /dev/null), capturing both streams."""
    return subprocess.run(
        [*prefix, *launcher, *args],
        env=None if environ is None else dict(environ),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def text(stream: bytes) -> str:
    return stream.decode("utf-8", "backslashreplace")


def read_record(path: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def record_argv(record: Mapping[str, Any]) -> list[bytes]:
    return [bytes.fromhex(item) for item in record["argv"]]


def single_error(result: subprocess.CompletedProcess[bytes], code: int) -> str:
    """Assert the exit code and exactly one launcher error line, no traceback."""
    stderr = text(result.stderr)
    assert "Traceback" not in stderr, stderr
    assert result.returncode == code, (result.returncode, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(ERROR_PREFIX), stderr
    return lines[0]


def dry_run_plan(
    args: Sequence[str],
    environ: Mapping[str, str],
    launcher: Sequence[str] = LAUNCHER,
    prefix: Sequence[str] = (),
    cwd: Path | str | None = None,
) -> dict[str, Any]:
    """The plan the launcher prints for `--dry-run --json ARGS`."""
    result = run(["--dry-run", "--json", *args], environ, launcher, prefix, cwd)
    stderr = text(result.stderr)
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


def patch_elf(
    source: Path, destination: Path, ei_class: int | None = None, e_machine: int | None = None
) -> Path:
    """A copy of a real ELF file with its class byte or machine field rewritten."""
    data = bytearray(source.read_bytes())
    if ei_class is not None:
        data[4] = ei_class
    if e_machine is not None:
        data[18:20] = e_machine.to_bytes(2, "little")
    destination.write_bytes(bytes(data))
    return destination


@contextmanager
def public_directory() -> Iterator[Path]:
    """A fresh directory under /tmp that uid 65534 can traverse (mode 0755)."""
    path = Path(tempfile.mkdtemp(prefix="vcl-hardening-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def children_of(pid: int) -> set[int]:
    """The live children of a process, from /proc/PID/task/*/children."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(n) for n in (task / "children").read_text().split())
        except OSError:
            continue
    return found

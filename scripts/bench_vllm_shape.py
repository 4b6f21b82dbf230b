"""The host shape a map's servers run in (issue 46): a CPU limit, a cpuset, other tenants.

scripts/bench_vllm.py's `--shape`. A shape is made real for the whole run, not faked: a CFS
quota is a cgroup of its own (cgroup v1's cpu controller, or v2's `cpu.max`) that each server
enters before vLLM or the launcher starts, so both read it as a container's limit; a cpuset is
the server's CPU affinity, as `taskset` or a container's cpuset gives it; a tenant is another
process, outside the server's cgroup, spinning on the CPU for the whole run. Everything made
is undone on the way out (the tenants killed, the cgroup removed).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from script_cli import ScriptError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the kernel's default CFS period
# Enter the cgroup (if any), keep the first N allowed CPUs (if any), then exec the server:
# argv = [cgroup.procs path or "", CPU count or "0", command...].
ENTER = (
    "import os, sys\n"
    "procs, cpus, command = sys.argv[1], int(sys.argv[2]), sys.argv[3:]\n"
    "if procs:\n"
    "    with open(procs, 'w') as f: f.write(str(os.getpid()))\n"
    "if cpus:\n"
    "    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cpus])\n"
    "os.execvp(command[0], command)\n"
)
TENANT = "while True: pass"  # a busy loop: another tenant's CPU-bound work


@dataclass(frozen=True)
class Shape:
    """What the server gets of the host: a CFS quota in CPUs, the first `cpus` CPUs of its
    affinity, and busy loops of another tenant beside it."""

    key: str
    quota: float | None = None
    cpus: int | None = None
    tenants: int = 0

    def words(self) -> str:
        said = []
        if self.quota is not None:
            said.append(f"a CFS quota of {self.quota:g} CPUs (its own cgroup)")
        if self.cpus is not None:
            said.append(f"a cpuset of {self.cpus} CPU{'s' if self.cpus != 1 else ''}")
        if self.tenants:
            loops = "loop" if self.tenants == 1 else "loops"
            said.append(f"{self.tenants} busy {loops} of another process beside it")
        return ", ".join(said) or "the whole host, idle"


SHAPES = {
    s.key: s
    for s in (
        Shape("idle"),
        Shape("quota-1.0", quota=1.0),
        Shape("quota-1.5", quota=1.5),
        Shape("cpuset-1", cpus=1),
        Shape("tenants-1", tenants=1),
        Shape("tenants-2", tenants=2),
    )
}


def _v1_cpu_root() -> Path | None:
    """cgroup v1's cpu controller hierarchy, where mounted."""
    for name in ("cpu", "cpu,cpuacct"):
        if (CGROUP_ROOT / name / "cpu.cfs_quota_us").exists():
            return CGROUP_ROOT / name
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value, encoding="ascii")
    except OSError as error:
        raise ScriptError(
            f"cannot write {value!r} to {path} ({error.strerror}); Fix: run the shaped map as "
            "root on a host whose cgroup cpu controller is writable, or leave out --shape"
        ) from None


def _quota_cgroup(quota: float, name: str) -> tuple[Path, Path]:
    """A cgroup limited to `quota` CPUs: (its directory, the cgroup.procs file to enter)."""
    v1 = _v1_cpu_root()
    directory = (v1 if v1 is not None else CGROUP_ROOT) / name
    try:
        directory.mkdir()
    except OSError as error:
        raise ScriptError(
            f"cannot make the cgroup {directory} ({error.strerror}); Fix: run as root, or "
            "leave out --shape"
        ) from None
    quota_us = str(round(quota * PERIOD_US))
    if v1 is not None:
        _write(directory / "cpu.cfs_period_us", str(PERIOD_US))
        _write(directory / "cpu.cfs_quota_us", quota_us)
    else:
        _write(directory / "cpu.max", f"{quota_us} {PERIOD_US}")
    return directory, directory / "cgroup.procs"


def prefix(shape: Shape, procs: Path | None) -> list[str]:
    """What goes before a server's command to start it in the shape."""
    if procs is None and shape.cpus is None:
        return []
    return [sys.executable, "-c", ENTER, str(procs or ""), str(shape.cpus or 0)]


@contextlib.contextmanager
def shaped(shape: Shape) -> Iterator[list[str]]:
    """The shape made real for the block: yields the prefix each server's command needs."""
    if shape.cpus is not None and shape.cpus > len(os.sched_getaffinity(0)):
        raise ScriptError(f"--shape {shape.key}: this host has fewer CPUs than {shape.cpus}")
    tenants: list[subprocess.Popen[bytes]] = []
    directory = None
    try:
        procs = None
        if shape.quota is not None:
            directory, procs = _quota_cgroup(shape.quota, f"bench-vllm-{os.getpid()}")
        for _ in range(shape.tenants):
            tenants.append(
                subprocess.Popen(
                    [sys.executable, "-c", TENANT],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield prefix(shape, procs)
    finally:
        for tenant in tenants:
            tenant.kill()
            tenant.wait(timeout=60)
        if directory is not None:
            with contextlib.suppress(OSError):
                directory.rmdir()

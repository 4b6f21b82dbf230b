"""The CPUs a launch really gets, read once (docs/design.md, "The shape"): the CPUs it may
run on, the cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`, the
tightest along the process's cgroup path, as vLLM's `_cgroup_cpu_limit` reads it, under the
mount points /proc/self/mountinfo names), the NUMA nodes of those CPUs and the memory nodes
allowed. `root` is where /proc and /sys lie (a test's tree; "/" for a launch).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.messages import StrEnum
from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any, TypeVar

    _T = TypeVar("_T")

CGROUP, MOUNTINFO, STATUS = "proc/self/cgroup", "proc/self/mountinfo", "proc/self/status"
STAT = "proc/stat"
# How long other work is watched at start: 30 ticks of a CPU at the kernel's 100 Hz, so one
# busy loop (30) stands clear of an idle CPU (0-2), and a start waits no more than that.
WATCH_S = 0.3
# Other work's CPUs' worth of time at start under which the host counts as idle: the map's
# idle host read 0.0-0.1, one tenant's busy loop 1.0 (docs/benchmarks.md, the shapes map).
IDLE_BELOW = 0.25
NODES = "sys/devices/system/node"
# vLLM's own way to say which memory nodes its workers bind to (cpu_resource_utils.py).
VISIBLE_NODES = "CPU_VISIBLE_MEMORY_NODES"
# The CPUs `servers` gave a server, in its environment: verify checks its processes keep to them.
SERVER_CPUS = "VLLMCPULAUNCH_SERVER_CPUS"
# The first release read whose get_visible_memory_node() takes Mems_allowed_list without
# the allowed CPUs (vLLM #43240): 0.27.0 and 0.32.0 read, 0.34 unchanged; before, unread.
MEMS_READER = (0, 27)


class Unreadable(Exception):
    """A file of the shape that cannot be read or makes no sense: its message says which."""


@record
class Shape:
    cpus: tuple[int, ...]  # sched_getaffinity
    quota: float | None = None  # CPUs' worth of time the cgroup quota allows; None: no limit
    quota_unknown: str | None = None  # why the quota could not be read
    nodes: tuple[int, ...] = ()  # the NUMA nodes of `cpus`
    memory_nodes: tuple[int, ...] = ()  # Mems_allowed_list
    nodes_unknown: str | None = None  # why the nodes could not be read


class HostCpus(StrEnum):
    """What --host-cpus says of the CPUs vLLM gets: read at start, or told (a dedicated host
    whose start the plan must not judge by a passing job; a host other work shares)."""

    AUTO = "auto"
    OWN = "own"
    SHARED = "shared"


class HostUse(StrEnum):
    """Whose the CPUs are at start, the condition the rules were measured under: vLLM's own
    (idle at start, a cpuset smaller than the host, or said), its share under a cgroup
    quota, shared with other work, or unknown (the watch could not be read)."""

    OWN = "own"
    QUOTA = "quota"
    SHARED = "shared"
    UNKNOWN = "unknown"


@record
class Use:
    kind: HostUse
    why: str  # what showed it: the quota, the cpuset, the watch, or the setting


@record
class Others:
    """Other work's CPU time on the CPUs a launch may run on, watched at its start (every
    process but this one; steal, a hypervisor's other guests, counts): whether vLLM's
    threads will spin on CPUs someone else needs."""

    cpus: float | None  # CPUs' worth of time over the watch; None: unknown
    watch_s: float = WATCH_S
    unknown: str | None = None  # why it could not be read

    @property
    def idle(self) -> bool:
        return self.cpus is not None and self.cpus < IDLE_BELOW


def read_text(root: str, path: str, missing: str | None = "") -> str | None:
    """The file's text; `missing` where it does not exist (Unreadable if that is "")."""
    where = os.path.join(root, path.lstrip("/"))
    try:
        with open(where, encoding="utf-8") as stream:
            return stream.read().strip()
    except FileNotFoundError:
        if missing == "":
            raise Unreadable(f"{where}: missing") from None
        return missing
    except (OSError, UnicodeDecodeError) as error:
        raise Unreadable(f"{where}: {getattr(error, 'strerror', None) or error}") from None


def id_list(text: str, where: str) -> tuple[int, ...]:
    """(0, 1, 2, 4) for the kernel's "0-2,4"."""
    ids: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            ids.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise Unreadable(f"{where}: {text!r} is no list of numbers") from None
    return tuple(sorted(ids))


def id_words(ids: Iterable[int]) -> str:
    """The kernel's "0-2,4" for (0, 1, 2, 4)."""
    runs: list[list[int]] = []
    for n in sorted(ids):
        if runs and runs[-1][-1] == n - 1:
            runs[-1][1:] = [n]
        else:
            runs.append([n])
    return ",".join("-".join(map(str, run)) for run in runs)


def cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """{"2": (root in the hierarchy, mount point)} of cgroup v2, "1" of v1's cpu controller."""
    mounts: dict[str, tuple[str, str]] = {}
    for fields in (line.split() for line in mountinfo.splitlines()):
        rest = fields[fields.index("-") + 1 :] if "-" in fields else []
        if len(fields) > 4 and len(rest) > 2:
            v1 = rest[0] == "cgroup" and "cpu" in rest[2].split(",")
            version = "2" if rest[0] == "cgroup2" else "1" if v1 else None
            if version:
                mounts.setdefault(version, (fields[3], fields[4]))
    return mounts


def quota_v2(root: str, directory: str) -> float | None:
    path = os.path.join(directory, "cpu.max")
    text = read_text(root, path, None)
    fields = (text or "").split()
    if text is None or fields[:1] == ["max"]:
        return None
    return ratio(fields[0], fields[1] if len(fields) == 2 else "", path)


def quota_v1(root: str, directory: str) -> float | None:
    path = os.path.join(directory, "cpu.cfs_quota_us")
    quota = read_text(root, path, None)
    if quota is None or (quota.lstrip("-").isdigit() and int(quota) <= 0):  # -1: no limit
        return None
    period = os.path.join(directory, "cpu.cfs_period_us")
    return ratio(quota, read_text(root, period) or "", path)


def ratio(quota: str, period: str, where: str) -> float:
    if not (quota.isdigit() and period.isdigit() and int(period) > 0):
        raise Unreadable(f"{where}: quota {quota!r} over period {period!r} is no CPU limit")
    return int(quota) / int(period)


def cgroup_quota(root: str) -> float | None:
    """The tightest quota along the process's cgroup path, each hierarchy's up to its root."""
    mounts = cgroup_mounts(read_text(root, MOUNTINFO) or "")
    if not mounts:
        raise Unreadable(f"no cgroup file system with the cpu controller in /{MOUNTINFO}")
    limits: list[float] = []
    for line in (read_text(root, CGROUP) or "").splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        version = "2" if controllers == "" else "1" if "cpu" in controllers.split(",") else ""
        if version in mounts:
            within, point = mounts[version]
            parts = os.path.relpath(path, within).split("/") if path.startswith(within) else []
            parts = [part for part in parts if part not in ("", ".")]
            read = quota_v2 if version == "2" else quota_v1
            found = (read(root, os.path.join(point, *parts[:n])) for n in range(len(parts) + 1))
            limits += [limit for limit in found if limit is not None]
    return min(limits, default=None)


def node_cpus(root: str) -> dict[int, tuple[int, ...]]:
    """{node: its CPUs} as the kernel lists them (empty where it lists no nodes)."""
    try:
        names = os.listdir(os.path.join(root, NODES))
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise Unreadable(f"{os.path.join(root, NODES)}: {error.strerror}") from None
    nodes = sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())
    path = f"{NODES}/node{{}}/cpulist"
    return {n: id_list(read_text(root, path.format(n)) or "", path.format(n)) for n in nodes}


def cpu_nodes(root: str, cpus: tuple[int, ...]) -> tuple[int, ...]:
    """The NUMA nodes that hold any of `cpus` (none where the kernel lists no nodes)."""
    return tuple(n for n, listed in node_cpus(root).items() if set(listed) & set(cpus))


def memory_nodes(root: str) -> tuple[int, ...]:
    lines = (read_text(root, STATUS) or "").splitlines()
    found = [line[18:].strip() for line in lines if line.startswith("Mems_allowed_list:")]
    if not found:
        raise Unreadable(f"/{STATUS}: no Mems_allowed_list")
    return id_list(found[0], f"/{STATUS} Mems_allowed_list")


def attempt(read: Callable[[], _T], empty: _T) -> tuple[_T, str | None]:
    try:
        return read(), None
    except Unreadable as error:
        return empty, str(error)


def read_shape(cpus: Iterable[int], root: str = "/") -> Shape:
    """The shape of the CPUs `cpus` (the process's sched_getaffinity, read by its caller)."""
    allowed = tuple(sorted(cpus))
    quota, quota_unknown = attempt(lambda: cgroup_quota(root), None)
    none: tuple[int, ...] = ()
    nodes, cpus_unknown = attempt(lambda: cpu_nodes(root, allowed), none)
    memory, memory_unknown = attempt(lambda: memory_nodes(root), none)
    unknown = "; ".join(filter(None, (cpus_unknown, memory_unknown))) or None
    return Shape(allowed, quota, quota_unknown, nodes, memory, unknown)


def shape_line(shape: Shape) -> str:
    """ "2 CPUs (0-1), limited to 1.0 by the cgroup quota, NUMA node 0": doctor, --dry-run."""
    count, nodes, quota = len(shape.cpus), shape.nodes, shape.quota
    said = [
        f"{count} CPU{'s' * (count != 1)} ({id_words(shape.cpus)})",
        f"limited to {round(quota, 2)} by the cgroup quota" if quota else "no cgroup quota",
        f"NUMA node{'s' * (len(nodes) > 1)} {id_words(nodes)}" if nodes else "no NUMA nodes listed",
    ]
    if shape.quota_unknown:
        said[1] = f"quota unknown ({shape.quota_unknown})"
    if shape.nodes_unknown:
        said[2] = f"NUMA nodes unknown ({shape.nodes_unknown})"
    if nodes and shape.memory_nodes and shape.memory_nodes != nodes:
        said.append(f"memory nodes {id_words(shape.memory_nodes)} allowed")
    return ", ".join(said)


def shape_json(shape: Shape | None) -> dict[str, Any] | None:
    if shape is None:
        return None
    keys = ("cpus", "quota", "quota_unknown", "nodes", "memory_nodes", "nodes_unknown")
    said = {key: getattr(shape, key) for key in keys}
    return {
        **said,
        **{k: list(v) for k, v in said.items() if isinstance(v, tuple)},
        "line": shape_line(shape),
    }


def visible_nodes(shape: Shape, environ: Mapping[str, str], release: tuple[int, ...]) -> str | None:
    """CPU_VISIBLE_MEMORY_NODES for vLLM (#43240): the allowed CPUs' nodes, where they differ
    from the memory nodes allowed, the caller set none and the release reads the latter."""
    wanted = tuple(n for n in shape.nodes if n in shape.memory_nodes)
    if environ.get(VISIBLE_NODES) or release < MEMS_READER or shape.nodes_unknown:
        return None
    return ",".join(map(str, wanted)) if wanted and wanted != shape.memory_nodes else None


def visible_nodes_problem(shape: Shape, environ: Mapping[str, str]) -> str | None:
    """The caller's CPU_VISIBLE_MEMORY_NODES (kept) where vLLM would bind to no CPU by it."""
    value = environ.get(VISIBLE_NODES)
    if not value or shape.nodes_unknown:
        return None
    try:
        named = [int(node) for node in value.split(",")]  # as vLLM reads it
    except ValueError:
        return f"{VISIBLE_NODES}={value} (yours, kept): vLLM reads a comma list of node numbers"
    empty = [n for n in named if n in shape.memory_nodes and n not in shape.nodes]
    if not empty:
        return None
    return (
        f"{VISIBLE_NODES}={value} (yours, kept): node {id_words(empty)} holds none of the "
        f"CPUs this process may run on ({id_words(shape.cpus)}): a vLLM worker bound there "
        f"gets no CPU; set it to {','.join(map(str, shape.nodes)) or 'their nodes'} or unset it"
    )


def busy_seconds(cpus: tuple[int, ...], root: str = "/") -> float:
    """Seconds the CPUs `cpus` spent busy since boot (/proc/stat: all but idle and iowait,
    steal included: a hypervisor's other guests are other work too)."""
    total = 0
    for line in (read_text(root, STAT) or "").splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            try:
                ticks = [int(field) for field in fields[:8]]  # user .. steal
            except ValueError:
                raise Unreadable(f"/{STAT}: {line!r} is no line of counters") from None
            total += sum(ticks) - sum(ticks[3:5])
    return total / os.sysconf("SC_CLK_TCK")


def others_over(busy_s: float, known_s: float, wall_s: float) -> float:
    """Other work's CPUs' worth of time: the busy seconds less those of known processes."""
    return round(max(0.0, (busy_s - known_s) / wall_s), 2) if wall_s > 0 else 0.0


def read_others(cpus: tuple[int, ...], root: str = "/", watch_s: float = WATCH_S) -> Others:
    """Other work on `cpus` over `watch_s` seconds, less this process's own CPU time."""
    import time  # lazy: only a speculative start watches the host

    try:
        wall, own, busy = time.monotonic(), time.process_time(), busy_seconds(cpus, root)
        time.sleep(watch_s)
        busy = busy_seconds(cpus, root) - busy
        own, wall = time.process_time() - own, time.monotonic() - wall
    except Unreadable as error:
        return Others(None, watch_s, str(error))
    return Others(others_over(busy, own, wall), watch_s)


def others_line(others: Others) -> str:
    """ "other work used 1.02 CPUs over 0.3 s at start": --dry-run, doctor."""
    if others.cpus is None:
        return f"other work at start unknown ({others.unknown})"
    state = "idle" if others.idle else "shared"
    return f"other work used {others.cpus:.2f} CPUs over {others.watch_s:g} s at start: {state}"


def host_use(
    shape: Shape, said: HostCpus, told: str, online: int | None, watch: Callable[[], Others]
) -> Use:
    """Whose the CPUs are (HostUse): `--host-cpus shared` (`told`: the setting in words)
    first, then a quota below the CPUs, a cpuset below the host's `online` CPUs, `--host-cpus
    own`, else other work watched for a moment (`watch`, only then: it takes WATCH_S)."""
    count, quota = len(shape.cpus), shape.quota
    if said == HostCpus.SHARED:
        return Use(HostUse.SHARED, told)
    if quota is not None and quota < count:
        return Use(HostUse.QUOTA, f"a cgroup quota of {round(quota, 2)} of {count} CPUs")
    if online and count < online:
        return Use(HostUse.OWN, f"a cpuset of {count} of the host's {online} CPUs")
    if said == HostCpus.OWN:
        return Use(HostUse.OWN, told)
    others = watch()
    if others.cpus is None:
        return Use(HostUse.UNKNOWN, others_line(others))
    return Use(HostUse.OWN if others.idle else HostUse.SHARED, others_line(others))

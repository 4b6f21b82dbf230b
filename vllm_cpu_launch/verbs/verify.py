"""`vllm-cpu-launch verify PID`: does a running vLLM run the OpenMP runtime its plan chose?

For the process and all its descendants it reads which OpenMP runtimes are mapped
(/proc/PID/maps) and in which order they were loaded (the link map, linkmap.py): the
first one serves the process's GOMP_*/omp_* calls. It reads the LD_PRELOAD/KMP_*
variables the process started with (/proc/PID/environ; for a process vLLM renamed,
whose title overwrote them, what it inherited instead), whether its command line
requests speculative decoding (children inherit the verdict of their parent: vLLM's
workers are spawned with a command line of their own), and, where the API server
answers, the plugin's readings from inside each process on its /metrics. The processes
that run model code are judged: vLLM's engine cores and workers (by the titles vLLM
gives them), or, where there are none (an engine in the front end), the process itself;
the others, the API server first, are reported, since vLLM's plugin cannot change the
runtime of the process that loads it.

libgomp is a choice, not a problem, where the plan that started the tree made it: its
mark (VLLMCPULAUNCH_PLANNED) where a process still shows it, or the user's `iomp: never`,
re-read from PID's start-up environment and the config files it names, as the plan read
them (docs/design.md, "verify", says why those are the evidence). Exit 1 when SD is
requested and a judged process is served by libgomp (or loads no runtime) where no plan
chose to leave Intel OpenMP out; 0 when all is well; 2 when the process cannot be found
or read.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from vllm_cpu_launch.cli import FLAG_OPTIONS, parse_options, write_stdout
from vllm_cpu_launch.command import SpeculativeRequest, detect
from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError, StrEnum
from vllm_cpu_launch.handoff import (
    INFO_METRIC,
    LAUNCHER,
    LD_PRELOAD,
    PLANNED_VARIABLE,
    PLUGIN,
    Library,
    library_of,
    vllm_reads,
)
from vllm_cpu_launch.linkmap import LinkMap, read_link_map
from vllm_cpu_launch.plan import described_request, schema
from vllm_cpu_launch.settings import (
    CONFIG_VARIABLE,
    Mode,
    deprecated_name,
    load_settings,
    said_setting,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from vllm_cpu_launch.command import SpeculativeRequest


class Judgement(StrEnum):
    """What verify makes of one process: its JSON `verdict`."""

    OK = "ok"  # served as its plan (or the user) chose
    PROBLEM = "problem"  # SD served by libgomp no plan chose, or no runtime without a word
    SKIPPED = "skipped"  # nothing to judge yet
    REPORTED = "reported"  # runs no model code: shown, not judged


VARIABLES = (
    LD_PRELOAD,
    "KMP_BLOCKTIME",
    "KMP_AFFINITY",
    "OMP_NUM_THREADS",
    "VLLM_CPU_OMP_THREADS_BIND",
    PLANNED_VARIABLE,
)
# What vLLM calls its processes (setproctitle "VLLM::NAME", vllm/utils/system_utils.py):
# the engine core and the workers run the model; the API server and the DP coordinator
# do not.
MODEL_ROLES = {"EngineCore": "engine-core", "Worker": "worker"}

USAGE = """\
usage: vllm-cpu-launch verify [--json] [--speculative] PID

Check a running vLLM (PID, e.g. systemctl show -p MainPID --value UNIT) and all its
descendants: which OpenMP runtimes each has loaded and which one serves it (the first in
its link map), the LD_PRELOAD/KMP_* it started with (or, where vLLM's process title
overwrote them, what it inherited), whether speculative decoding is requested, and the
plugin's readings from inside on the server's /metrics (--port from its command line).
The processes that run the model are judged (vLLM's engine cores and workers; where
there are none, PID itself and its children); the API server and other helpers are
reported. libgomp that the plan chose
(the launcher's or the plugin's mark VLLMCPULAUNCH_PLANNED, or iomp: never in PID's
environment or config files) is fine.
Exit 0 when every judged process is served by Intel or LLVM OpenMP, or the libgomp it
runs was chosen, or SD is not requested; 1 when one is served by libgomp nothing chose;
2 when PID cannot be found or read (as the user vLLM runs as, verify can read it).
  --speculative   judge as if SD is requested: vLLM's offline API (LLM(...)) and
                  `vllm bench` take it in Python or a config, not on their command line
"""


def mapped_runtimes(maps: str) -> list[tuple[Library, str]]:
    """(runtime, path) for each OpenMP runtime in a /proc/PID/maps text, in map order."""
    found: dict[str, Library] = {}
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].removesuffix(" (deleted)")
        kind = library_of(path)
        if kind.runtime and path not in found:
            found[path] = kind
    return [(kind, path) for path, kind in found.items()]


def read_proc(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as stream:
        return stream.read()


def environment_of(raw: bytes) -> dict[str, str]:
    """The variables in /proc/PID/environ (NUL-separated, as started; what a process title
    written over it left)."""
    result = {}
    for entry in raw.split(b"\0"):
        key, separator, value = entry.partition(b"=")
        if separator and key:
            result[key.decode("utf-8", "surrogateescape")] = value.decode(
                "utf-8", "surrogateescape"
            )
    return result


def vllm_arguments(cmdline: Sequence[str], cwd: str | None) -> list[str]:
    """The vLLM part of a command line, with `--config FILE` made absolute (its cwd)."""
    arguments = list(cmdline[1:])
    for index, word in enumerate(arguments):
        if os.path.basename(word) in ("vllm", "vllm-cpu-launch"):
            arguments = arguments[index + 1 :]
            break
    if cwd:
        for index, word in enumerate(arguments[:-1]):
            if word == "--config" and not os.path.isabs(arguments[index + 1]):
                arguments[index + 1] = os.path.join(cwd, arguments[index + 1])
    return arguments


def cwd_of(process: psutil.Process) -> str | None:
    try:
        return process.cwd()
    except psutil.Error:
        return None


def speculative_of(process: psutil.Process) -> SpeculativeRequest:
    try:
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        cmdline = []
    return detect(vllm_arguments(cmdline, cwd_of(process)))


@dataclass(frozen=True)
class Choice:
    """Why the plan left Intel OpenMP out: `by` "the plan" (its mark) or "the user"."""

    by: str
    why: str

    def keeps_libgomp(self) -> str:
        verb = "kept by" if self.by == "the plan" else "chosen by"
        return f"libgomp {verb} {self.by} ({self.why})"


LOAD_ORDER = "in load order (the link map, as pldd reads it)"


@dataclass(frozen=True)
class Order:
    """The OpenMP runtimes of one process in load order (else in map order), the one that
    serves its GOMP_*/omp_* calls (None where the order is unknown), how it was read."""

    runtimes: list[tuple[Library, str]]
    serves: tuple[Library, str] | None
    how: str


def load_order(link_map: LinkMap, maps: str) -> Order:
    """Which runtime serves: the first OpenMP runtime in the link map. The preloads come
    right after the program and every library's references search the global scope first,
    so a preloaded runtime serves the others' calls; one loaded first by a library serves
    every later one. Each is named by the file mapped at its l_addr, as maps names it."""
    if link_map.objects is None:
        how = (
            f"load order unreadable: {link_map.unreadable}; in /proc/PID/maps (address) "
            "order, which does not say which serves"
        )
        return Order(mapped_runtimes(maps), None, how)
    files = mapped_files(maps)
    ordered: dict[str, Library] = {}
    for address, name in link_map.objects:
        path = files.get(address, name)
        kind = library_of(path)
        if kind.runtime and path not in ordered:
            ordered[path] = kind
    runtimes = [(kind, path) for path, kind in ordered.items()]
    return Order(runtimes, runtimes[0] if runtimes else None, LOAD_ORDER)


def mapped_files(maps: str) -> dict[int, str]:
    """The file mapped from offset 0 at each start address of a /proc/PID/maps text."""
    files: dict[int, str] = {}
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/") and int(fields[2], 16) == 0:
            start = int(fields[0].partition("-")[0], 16)
            files.setdefault(start, fields[5].removesuffix(" (deleted)"))
    return files


def judge(
    order: Order,
    environment: dict[str, str],
    is_root: bool,
    wanted: bool,
    chosen: Choice | None = None,
) -> tuple[Judgement, str]:
    """(verdict, reason) for one process: ok, problem, or skipped (runs no OpenMP)."""
    runtimes = order.runtimes
    kinds = [kind for kind, _ in runtimes]
    preload = environment.get(LD_PRELOAD, "")
    preloaded_iomp = Library.INTEL in vllm_reads(preload)
    described = described_runtimes(runtimes)
    if not runtimes:
        if not is_root:
            return Judgement.SKIPPED, "no OpenMP runtime loaded"
        if not wanted:
            return Judgement.OK, "no OpenMP runtime loaded yet"
        if chosen:
            return (
                Judgement.OK,
                f"no OpenMP runtime loaded yet; none preloaded, as {chosen.by} chose "
                f"({chosen.why})",
            )
        if preloaded_iomp:
            return Judgement.PROBLEM, f"LD_PRELOAD names {preload} but no OpenMP runtime is loaded"
        return Judgement.PROBLEM, "started without Intel OpenMP in LD_PRELOAD"
    if not wanted:
        return Judgement.OK, f"speculative decoding not requested; runs {described}"
    if order.serves is not None:
        return judge_served(order.serves, runtimes, chosen)
    if not any(kind.kmp for kind in kinds) and chosen:
        return Judgement.OK, f"{chosen.keeps_libgomp()}: {described}"
    if not any(kind.kmp for kind in kinds):
        return Judgement.PROBLEM, f"runs GNU libgomp only ({described})"
    # The load order unread: a visible LD_PRELOAD without Intel OpenMP says libgomp was
    # bound first. vLLM's renamed processes (VLLM::Worker...) have their start-up
    # environment overwritten by the process title, so an absent LD_PRELOAD there tells
    # nothing.
    if Library.GNU in kinds and LD_PRELOAD in environment and not preloaded_iomp:
        return (
            Judgement.PROBLEM,
            f"Intel OpenMP loaded but not preloaded, so libgomp serves ({described})",
        )
    return Judgement.OK, described


def judge_served(
    serves: tuple[Library, str], runtimes: list[tuple[Library, str]], chosen: Choice | None
) -> tuple[Judgement, str]:
    """With SD requested and the load order read: the serving runtime decides."""
    kind, path = serves
    others = [runtime for runtime in runtimes if runtime != serves]
    also = f"; also mapped, not serving: {described_runtimes(others)}" if others else ""
    if kind is not Library.GNU:
        return Judgement.OK, f"{kind.title} serves ({path}){also}"
    if chosen:
        return Judgement.OK, f"{chosen.keeps_libgomp()}: {described_runtimes(runtimes)}"
    late = next((other.title for other, _ in others if other is not Library.GNU), None)
    if late is None:
        return Judgement.PROBLEM, f"runs GNU libgomp only ({described_runtimes(runtimes)})"
    return Judgement.PROBLEM, (
        f"GNU libgomp serves ({path}, first in the link map){also}: {late} was loaded "
        "after it, not preloaded"
    )


def users_choice(start_environment: dict[str, str], cwd: str | None) -> Choice | None:
    """Why libgomp is the user's own choice, `iomp: never`, read as the plan read it: from
    PID's start-up environment and the config files it names (a relative
    VLLMCPULAUNCH_CONFIG is PID's working directory's); None where it is not."""
    environ = dict(start_environment)
    for name in (CONFIG_VARIABLE, deprecated_name(CONFIG_VARIABLE)):
        if environ.get(name) and cwd and not os.path.isabs(environ[name]):
            environ[name] = os.path.join(cwd, environ[name])
    settings = load_settings({}, environ, errors=[])  # what is broken is left out
    if settings.iomp != Mode.NEVER:
        return None
    return Choice("the user", said_setting(settings, "iomp"))


def vllm_title(cmdline: Sequence[str]) -> str | None:
    """The NAME of a process vLLM renamed "VLLM::NAME" (setproctitle), else None."""
    title = cmdline[0] if cmdline else ""
    prefix, separator, name = title.partition("::")
    return name if separator and prefix and " " not in prefix else None


def role_of(cmdline: Sequence[str], is_root: bool) -> str:
    """engine-core or worker (model code), api-server (so titled, or PID itself where it
    runs `vllm serve`), main (PID itself otherwise: a script, a program), other."""
    name = vllm_title(cmdline)
    if name is not None:
        for start, role in MODEL_ROLES.items():
            if name.startswith(start):
                return role
        if name.startswith("APIServer"):
            return "api-server"
    if not is_root:
        return "other"
    serves = any(
        os.path.basename(word) == "vllm" and cmdline[index + 1 : index + 2] == ["serve"]
        for index, word in enumerate(cmdline)
    )
    return "api-server" if serves or "vllm.entrypoints.openai.api_server" in cmdline else "main"


def permission_denied(pid: int) -> str:
    """What to do where /proc/PID cannot be read: as root that is a missing capability
    (a container's root has no CAP_SYS_PTRACE by default), not a missing root."""
    try:
        owner = f"uid {os.stat(f'/proc/{pid}').st_uid}"
    except OSError:
        owner = "its user"
    problem = f"verify: cannot read /proc/{pid} (maps, environ): permission denied"
    if os.geteuid() == 0:
        return (
            f"{problem} although verify runs as root: reading another user's process needs "
            "the CAP_SYS_PTRACE capability, which containers drop by default; run verify "
            f"as the user vLLM runs as ({owner})"
        )
    return f"{problem}; run verify as the user vLLM runs as ({owner}), or as root"


def read_process(process: psutil.Process) -> tuple[str, dict[str, str], list[str], int] | None:
    """(maps, environment, command line, parent PID) of a process; None if it is gone."""
    try:
        maps = read_proc(process.pid, "maps").decode("utf-8", "surrogateescape")
        environment = environment_of(read_proc(process.pid, "environ"))
        cmdline = process.cmdline()
        ppid = process.ppid()
    except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except PermissionError:
        raise LaunchError(EXIT_USAGE, permission_denied(process.pid)) from None
    while cmdline and not cmdline[-1]:  # a process title padded with NULs (VLLM::Worker)
        cmdline.pop()
    return maps, environment, cmdline, ppid


@dataclass(frozen=True)
class Inherited:
    """What a renamed process inherited at spawn: the start-up environment (VARIABLES) of
    its nearest ancestor that vLLM did not rename."""

    from_pid: int
    environment: dict[str, str]


def inherited_by(process: psutil.Process) -> Inherited | None:
    """vLLM's title overwrites /proc/PID/environ; the nearest unrenamed ancestor's start-up
    environment is what reached it at spawn (less what that ancestor changed later)."""
    try:
        for ancestor in process.parents():
            if vllm_title(ancestor.cmdline()) is None:
                whole = environment_of(read_proc(ancestor.pid, "environ"))
                shown = {name: whole[name] for name in VARIABLES if name in whole}
                return Inherited(ancestor.pid, shown)
    except (OSError, psutil.Error):
        return None
    return None


@dataclass(frozen=True)
class Seen:
    """What inspect read of one process: the variables of VARIABLES that show in its
    environ, whether SD is requested, its link map, and, for a process vLLM renamed, what
    it inherited."""

    pid: int
    ppid: int
    cmdline: list[str]
    role: str
    maps: str
    environment: dict[str, str]
    speculative: bool
    link_map: LinkMap
    inherited: Inherited | None = None
    renamed: str | None = None


# The plugin's reading from inside each vLLM process, published by the front end on
# vLLM's /metrics (docs/design.md, "verify"): one series per process, labelled so.
DEFAULT_PORT = 8000  # vLLM's `--port` default
NO_INSIDE = "the plugin is not installed, or /metrics unreachable"


@dataclass(frozen=True)
class Inside:
    """What the server's /metrics said: its address (None without an API server in the
    tree), and the plugin's series by process ID (None where none could be read)."""

    url: str | None
    readings: dict[int, dict[str, str]] | None


def metrics_url(cmdline: Sequence[str]) -> str:
    """/metrics of the API server, from its `--host`/`--port` (`--port=N` too)."""
    given: dict[str, str] = {}
    for index, word in enumerate(cmdline):
        name, equals, value = word.partition("=")
        if name in ("--host", "--port"):
            given[name] = value if equals else "".join(cmdline[index + 1 : index + 2])
    host = given.get("--host") or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # all addresses: ask here
    port = given.get("--port") or str(DEFAULT_PORT)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def openmp_readings(text: str) -> dict[int, dict[str, str]]:
    """The labels of each `vllm_cpu_launch_openmp_info{...} 1.0` line, by its pid label
    (Prometheus text format: label values escape backslash, quote and newline)."""
    label = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
    escapes = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
    readings = {}
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if name != INFO_METRIC or not brace:
            continue
        labels, _, _ = rest.rpartition("}")
        pairs = {
            match.group(1): re.sub(
                r"\\.", lambda e: escapes.get(e.group(0), e.group(0)), match.group(2)
            )
            for match in label.finditer(labels)
        }
        if pairs.get("pid", "").isdigit():
            readings[int(pairs["pid"])] = pairs
    return readings


def read_inside(url: str) -> dict[int, dict[str, str]] | None:
    """GET /metrics (2 s): the plugin's series, or None where none could be read."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return openmp_readings(text) or None


def inside_of(seen: Sequence[Seen]) -> Inside:
    servers = [one for one in seen if one.role == "api-server"]
    if not servers:
        return Inside(None, None)
    url = metrics_url(servers[0].cmdline)
    return Inside(url, read_inside(url))


def inspect(pid: int, speculative: bool = False) -> dict[str, Any]:
    """The verify report for PID and its descendants (see docs/operating.md); with
    `speculative`, SD counts as requested whatever the command lines say."""
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except (psutil.NoSuchProcess, ValueError, OverflowError):
        raise LaunchError(EXIT_USAGE, f"verify: no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise LaunchError(EXIT_USAGE, permission_denied(pid)) from None
    root_request = (
        SpeculativeRequest(True, "--speculative, given to verify")
        if speculative
        else speculative_of(root)
    )
    seen: list[Seen] = []
    users = None
    for process in [root, *descendants]:
        is_root = process.pid == pid
        read = read_process(process)
        if read is None:
            if is_root:
                raise LaunchError(EXIT_USAGE, f"verify: process {pid} exited")
            continue  # a child that ended meanwhile
        maps, environment, cmdline, ppid = read
        if is_root:
            users = users_choice(environment, cwd_of(process))
        request = root_request
        if not is_root and not request.requested:
            request = speculative_of(process)
        shown = {name: environment[name] for name in VARIABLES if name in environment}
        title = vllm_title(cmdline)
        inherited = inherited_by(process) if title is not None else None
        role = role_of(cmdline, is_root)
        link_map = read_link_map(process.pid)
        seen.append(
            Seen(
                process.pid,
                ppid,
                cmdline,
                role,
                maps,
                shown,
                request.requested,
                link_map,
                inherited,
                cmdline[0] if title is not None else None,
            )
        )
    return assemble(pid, root_request, seen, users, inside_of(seen))


def assemble(
    pid: int,
    root_request: SpeculativeRequest,
    seen: Sequence[Seen],
    users: Choice | None = None,
    inside: Inside = Inside(None, None),
) -> dict[str, Any]:
    """The report from what was read: each process judged or reported, PID first.
    `users`: why libgomp is the user's own choice (users_choice), if it is; `inside`: the
    plugin's readings from /metrics."""
    # Where vLLM runs the model in engine-core and worker processes, only they are judged.
    split = any(one.role in MODEL_ROLES.values() for one in seen)
    # A plan that keeps libgomp marks it. The launcher's mark is in PID's environment as
    # it started; the plugin sets its own in the front end after start-up, so only the
    # processes vLLM spawns show it (its renamed ones in the tail of their environment
    # that the title leaves; docs/design.md, "verify"). Else the user's own choice.
    # Only a planner's bare mark is a choice: NOT_FOUND_MARK kept libgomp for want of Intel
    # OpenMP, and STARTED_MARK kept none.
    marks = [
        mark
        for one in seen
        if (mark := one.environment.get(PLANNED_VARIABLE, "")) in (LAUNCHER, PLUGIN)
    ]
    chosen = Choice("the plan", f"{PLANNED_VARIABLE}={marks[0]}") if marks else users
    processes = []
    for one in seen:
        order = load_order(one.link_map, one.maps)
        if split and one.role not in MODEL_ROLES.values():
            runs = described_runtimes(order.runtimes) or "no OpenMP runtime loaded"
            verdict, reason = Judgement.REPORTED, f"{runs}; runs no model code, so not judged"
        else:
            verdict, reason = judge(order, one.environment, one.pid == pid, one.speculative, chosen)
        processes.append(
            {
                "pid": one.pid,
                "ppid": one.ppid,
                "cmdline": one.cmdline,
                "role": one.role,
                "runtimes": [runtime_entry(*runtime) for runtime in mapped_runtimes(one.maps)],
                "load_order": [runtime_entry(*runtime) for runtime in order.runtimes],
                "serves": None if order.serves is None else runtime_entry(*order.serves),
                "order": order.how,
                "env": one.environment,
                "environment": environment_entry(
                    one, None if order.serves is None else order.serves[0]
                ),
                "inside": (inside.readings or {}).get(one.pid),
                "speculative": one.speculative,
                "verdict": verdict,
                "reason": reason,
            }
        )
    problems = [p for p in processes if p["verdict"] == Judgement.PROBLEM]
    return {
        "pid": pid,
        "speculative": {"requested": root_request.requested, "source": root_request.source},
        "ok": not problems,
        "inside": {"url": inside.url, "read": inside.readings is not None},
        "processes": processes,
    }


# What vLLM writes into a worker's environment at spawn when it binds its threads
# (vllm/utils/ompmultiprocessing.py, configure_omp_envs, vllm-cpu 0.32.0), by what
# LD_PRELOAD names; OMP_NUM_THREADS is the worker's CPU count. Under
# VLLM_CPU_OMP_THREADS_BIND=nobind it writes none of them.
VLLM_BINDS = {
    Library.INTEL: "OMP_NUM_THREADS, KMP_AFFINITY=granularity=fine,explicit,proclist=[...], "
    "KMP_BLOCKTIME=5, KMP_TPAUSE=0",
    Library.GNU: "OMP_NUM_THREADS, GOMP_CPU_AFFINITY",
    None: "OMP_NUM_THREADS, OMP_PLACES, OMP_PROC_BIND=true",
}


def vllm_sets(environment: dict[str, str], serves: Library | None) -> str:
    """What vLLM overwrites in a worker it spawns, from the environment it spawns it with:
    vLLM goes by LD_PRELOAD, which a worker served by Intel or LLVM OpenMP had (that is
    how the runtime came first), and by the bind setting, which may have been set after
    start-up where it does not show."""
    bind = environment.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind == "nobind":
        return "nothing (VLLM_CPU_OMP_THREADS_BIND=nobind): the worker keeps what it inherited"
    found = vllm_reads(environment.get(LD_PRELOAD, ""))
    kmp = (serves is not None and serves.kmp) or Library.INTEL in found
    kind = Library.INTEL if kmp else Library.GNU if Library.GNU in found else None
    unless = (
        f"VLLM_CPU_OMP_THREADS_BIND={bind}"
        if bind is not None
        else "unless VLLM_CPU_OMP_THREADS_BIND=nobind was set after start-up, where it does "
        "not show"
    )
    return f"{VLLM_BINDS[kind]}, over what it inherited ({unless})"


def environment_entry(one: Seen, serves: Library | None) -> dict[str, Any]:
    """Whether /proc/PID/environ could be read; where vLLM's title overwrote it, what the
    process inherited at spawn and, for a worker, what vLLM wrote over that."""
    if one.renamed is None:
        return {"readable": True}
    why = (
        f"vLLM renamed the process ({one.renamed}) and the title overwrote "
        f"/proc/{one.pid}/environ: only its tail shows"
    )
    entry: dict[str, Any] = {"readable": False, "why": why, "inherited": None}
    basis = dict(one.environment)
    if one.inherited is not None:
        entry["inherited"] = {"from_pid": one.inherited.from_pid, "env": one.inherited.environment}
        basis = {**one.inherited.environment, **one.environment}
    if one.role == "worker":
        entry["vllm_sets"] = vllm_sets(basis, serves)
    return entry


def runtime_entry(kind: Library, path: str) -> dict[str, str]:
    return {"kind": kind.value, "path": path}


def described_runtimes(runtimes: Sequence[tuple[Library, str]]) -> str:
    return ", ".join(f"{kind.title} {path}" for kind, path in runtimes)


COMMAND_WIDTH = 100


def shortened(command: str) -> str:
    """A long command cut with a visible marker; --json keeps it whole."""
    if len(command) <= COMMAND_WIDTH:
        return command
    rest = len(command) - COMMAND_WIDTH
    return f"{command[:COMMAND_WIDTH]}... [{rest} more characters; --json shows them all]"


def verify_as_text(report: dict[str, Any]) -> str:
    speculative = described_request(
        report["speculative"]["requested"], report["speculative"]["source"]
    )
    lines = [f"speculative decoding: {speculative}"]
    for process in report["processes"]:
        command = shortened(shlex.join(process["cmdline"])) or "?"
        role = f"{process['role']} (parent {process['ppid']})"
        lines.append(f"{process['pid']:>7}  {process['verdict']:<8} {role}: {command}")
        lines.append(f"{'':>9}{process['reason']}")
        lines.extend(f"{'':>9}{line}" for line in process_lines(process))
    lines.append(inside_note(report["inside"]))
    problems = sum(p["verdict"] == Judgement.PROBLEM for p in report["processes"])
    judged = sum(p["verdict"] != Judgement.REPORTED for p in report["processes"])
    if problems:
        lacks = "process lacks" if judged == 1 else "processes lack"
        lines.append(
            f"PROBLEM: {problems} of {judged} judged {lacks} Intel OpenMP serving it while "
            "speculative decoding is requested and no plan chose libgomp; start vLLM through "
            "vllm-cpu-launch, or install vllm-cpu-launch into vLLM's environment (its plugin)"
        )
    else:
        noun = "process" if judged == 1 else "processes"
        lines.append(f"ok: {judged} {noun} judged, {len(report['processes'])} checked")
    return "\n".join(lines)


NONE_SET = "no LD_PRELOAD, KMP_* or OMP_NUM_THREADS set"


def inside_text(labels: dict[str, str]) -> str:
    """One series of the plugin's, as a sentence."""
    runtime, library = labels.get("runtime", ""), labels.get("library", "")
    serves = f"{runtime} serves ({library})"
    if runtime == "none":
        serves = (
            f"no OpenMP runtime serves (runtime none{', library ' if library else ''}{library})"
        )
    threads = labels.get("threads") or "?"
    return (
        f"read from inside ({labels.get('role', '?')}, /metrics): {serves}, block time "
        f"{labels.get('blocktime_ms') or '-'} ms, {threads} thread"
        f"{'' if threads == '1' else 's'}, bind {labels.get('bind') or 'unset'}"
    )


def inside_note(inside: dict[str, Any]) -> str:
    """Once per report: where the readings from inside came from, or why there are none."""
    if inside["read"]:
        return f"read from inside: the plugin's series on {inside['url']}"
    if inside["url"] is None:
        return "no inside reading (no API server in this tree to ask its /metrics)"
    return f"no inside reading from {inside['url']} ({NO_INSIDE})"


def variables_text(environment: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in environment.items())


def process_lines(process: dict[str, Any]) -> list[str]:
    """Which runtime serves and how that was read; the environment, or why it is unreadable
    and what was inherited instead."""
    order = ", ".join(
        f"{Library(r['kind']).title} {r['path']}{' (serves)' if r == process['serves'] else ''}"
        for r in process["load_order"]
    )
    lines = [f"OpenMP runtimes, {process['order']}: {order or 'none'}"]
    if process["inside"] is not None:
        lines.append(inside_text(process["inside"]))
    mapped = process["runtimes"]
    if {r["path"] for r in mapped} != {r["path"] for r in process["load_order"]}:
        lines.append(f"mapped (/proc/PID/maps): {', '.join(r['path'] for r in mapped)}")
    environment = process["environment"]
    shown = variables_text(process["env"])
    if environment["readable"]:
        return [*lines, shown or NONE_SET]
    left = shown or "none of LD_PRELOAD, KMP_*, OMP_NUM_THREADS in it"
    lines.append(f"environment unreadable: {environment['why']}: {left}")
    inherited = environment["inherited"]
    if inherited is not None:
        lines.append(
            f"inherited at spawn from PID {inherited['from_pid']}'s start-up environment (changes "
            f"it made after start-up, e.g. the plugin's, do not show there): "
            f"{variables_text(inherited['env']) or NONE_SET}"
        )
    if "vllm_sets" in environment:
        lines.append(f"vLLM sets in the worker at spawn: {environment['vllm_sets']}")
    return lines


def parse_pid(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise LaunchError(EXIT_USAGE, f"verify: {text!r} is not a process ID")
    if int(text) == 0:
        raise LaunchError(
            EXIT_USAGE,
            f"verify: {text!r} is not a process ID: 0 is what `systemctl show -p MainPID "
            "--value UNIT` prints for a unit that is not running; start the unit (systemctl "
            "status UNIT says why it stopped), then verify its MainPID",
        )
    return int(text)


def main(values: dict[str, object], args: list[str]) -> int:
    flags = {**FLAG_OPTIONS, "--speculative": "speculative"}
    more, rest = parse_options(args, {}, flags, verb="verify")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    if len(rest) != 1:
        raise LaunchError(
            EXIT_USAGE, "verify needs one PID: vllm-cpu-launch verify [--json] [--speculative] PID"
        )
    report = inspect(parse_pid(rest[0]), bool(merged.get("speculative")))
    if merged.get("json"):
        write_stdout(json.dumps({"schema": schema("verify"), **report}, indent=2))
    else:
        write_stdout(verify_as_text(report))
    return 0 if report["ok"] else EXIT_PROBLEM

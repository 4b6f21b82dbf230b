"""`vllm-cpu-launch verify PID`: does a running vLLM run the OpenMP runtime its plan chose?

It reads PID's tree from /proc (maps, environ, the link map) and the plugin's readings on
/metrics; docs/design.md ("verify") says what is evidence and why.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import socket
import struct
import time
from typing import TYPE_CHECKING

import psutil

from vllm_cpu_launch import handoff, settings
from vllm_cpu_launch.command import SpeculativeRequest, read_command, read_config
from vllm_cpu_launch.elf import Kind, identify, kind_of
from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import LD_PRELOAD, PLANNED_VARIABLE
from vllm_cpu_launch.launch import FLAG_OPTIONS, parse_options, write_stdout
from vllm_cpu_launch.linkmap import LinkMap, read_link_map
from vllm_cpu_launch.messages import StrEnum
from vllm_cpu_launch.plan import described_request, schema
from vllm_cpu_launch.records import record
from vllm_cpu_launch.runtimes import vllm_reads_gnu, vllm_reads_kmp
from vllm_cpu_launch.shape import SERVER_CPUS, Unreadable, id_list, id_words, read_text

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from typing import Any

    from vllm_cpu_launch.command import ConfigFile, VllmCommand

    # Reads a --config file; in one verify, each file once (functools.cache of read_config).
    Configs = Callable[[str], ConfigFile]

Runtime = tuple[Kind, str]


@record
class Choice:
    """Why Intel OpenMP was left out: `by` "the plan" (its mark) or "the user"."""

    by: str
    why: str


class Judgement(StrEnum):
    """A process's JSON `verdict` (docs/operating.md, "verify", says when each applies)."""

    OK = "ok"
    PROBLEM = "problem"
    SKIPPED = "skipped"
    REPORTED = "reported"  # runs no model code: shown, not judged
    UNREADABLE = "unreadable"  # a descendant closed to verify: said why, not judged


BIND = "VLLM_CPU_OMP_THREADS_BIND"
VARIABLES = (
    *(LD_PRELOAD, "KMP_BLOCKTIME", "KMP_AFFINITY", "OMP_NUM_THREADS", BIND, PLANNED_VARIABLE),
    SERVER_CPUS,
)
# What vLLM calls its processes (setproctitle "VLLM::NAME", vllm/utils/system_utils.py):
# the engine core and the workers run the model; the API server and DP coordinator do not.
MODEL_ROLES = {"EngineCore": "engine-core", "Worker": "worker"}

USAGE = """\
usage: vllm-cpu-launch verify [--json] [--speculative] PID

Check a running vLLM (PID, e.g. systemctl show -p MainPID --value UNIT) and its descendants:
the OpenMP runtimes each loaded and the one that serves it (the first in its link map to
define GOMP_parallel, by the libraries' own ELF files, never their names), the
LD_PRELOAD/KMP_* it started with (or inherited, where vLLM's title overwrote them), whether
speculative decoding is requested, and the plugin's readings on the server's /metrics. It
judges the processes that run the model (engine cores and workers, else PID and its
children) and reports the others. Exit 1 when SD is requested and a judged process is
served by libgomp, or PID has loaded no OpenMP runtime yet, and no plan chose that (the
mark VLLMCPULAUNCH_PLANNED, or iomp: never in PID's environment or config files), else 0;
2 when PID cannot be found or read (the message says why; a descendant is "unreadable").
  --speculative   judge as if SD is requested: vLLM's offline API (LLM(...)) and
                  `vllm bench` take it in Python or a config, not on their command line
"""


def runtimes_in(paths: Iterable[str]) -> tuple[list[Runtime], Runtime | None]:
    """The OpenMP runtimes among `paths` (elf.identify), and the first that defines
    GOMP_parallel: a library named like one, or needing one, is none."""
    found = {path: identify(path) for path in dict.fromkeys(paths)}
    runtimes = [(kind, path) for path, (kind, _) in found.items() if kind.runtime]
    return runtimes, next((r for r in runtimes if found[r[1]][1]), None)


def environment_of(pid: int) -> dict[str, str]:
    """/proc/PID/environ: as the process started, or what a title written over it left."""
    with open(f"/proc/{pid}/environ", "rb") as stream:  # bytes not UTF-8 kept
        entries = stream.read().decode("utf-8", "surrogateescape").split("\0")
    pairs = (entry.partition("=") for entry in entries)
    return {key: value for key, equals, value in pairs if equals and key}


def cwd_of(pid: int) -> str:
    """Relative file names on its command line and in its environment are relative to it."""
    try:
        return psutil.Process(pid).cwd()
    except psutil.Error:
        return ""


def vllm_command(cmdline: Sequence[str], pid: int, configs: Configs) -> VllmCommand:
    """The vLLM part of a process's command line, `--config FILE` made relative to its cwd
    and read through `configs`."""
    arguments = list(cmdline[1:])
    for index, word in enumerate(arguments):
        if os.path.basename(word) in ("vllm", "vllm-cpu-launch"):
            arguments = arguments[index + 1 :]
            break
    for index, word in enumerate(arguments[:-1]):
        if word == "--config":
            arguments[index + 1] = os.path.join(cwd_of(pid), arguments[index + 1])
    return read_command(arguments, configs)


def load_order(
    link_map: LinkMap, maps: str
) -> tuple[list[Runtime], list[Runtime], Runtime | None, str]:
    """(as mapped, in load order, the one that serves or None, how the order was read): the
    first in the link map to define GOMP_parallel serves; the preloads follow the program,
    and every library's references search the global scope first."""
    paths = []
    files: dict[int, str] = {}  # a link map names each library by l_addr: its file's start
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.append(fields[5].removesuffix(" (deleted)"))
            if int(fields[2], 16) == 0:
                files.setdefault(int(fields[0].partition("-")[0], 16), paths[-1])
    mapped = runtimes_in(paths)[0]
    if link_map.objects is None:
        how = (
            f"load order unreadable: {link_map.unreadable}; in /proc/PID/maps (address) "
            "order, which does not say which serves"
        )
        return mapped, mapped, None, how
    runtimes, serves = runtimes_in(files.get(a, name) for a, name in link_map.objects)
    return mapped, runtimes, serves, "in load order (the link map, as pldd reads it)"


def judge(
    runtimes: list[Runtime], serves: Runtime | None, one: Seen, is_root: bool, chosen: Choice | None
) -> tuple[Judgement, str]:
    """Under SD the runtime that serves decides; libgomp, or none, is fine if it was chosen."""
    kinds = [kind for kind, _ in runtimes]
    preload = one.environment.get(LD_PRELOAD, "")
    preloaded_iomp = vllm_reads_kmp(preload)
    described = described_runtimes(runtimes)
    if not kinds:
        if not is_root:
            return Judgement.SKIPPED, "no OpenMP runtime loaded"
        if not one.speculative:
            return Judgement.OK, "no OpenMP runtime loaded yet"
        if chosen:
            none = f"none preloaded, as {chosen.by} chose ({chosen.why})"
            return Judgement.OK, f"no OpenMP runtime loaded yet; {none}"
        if preloaded_iomp:
            return Judgement.PROBLEM, f"LD_PRELOAD names {preload} but no OpenMP runtime is loaded"
        return Judgement.PROBLEM, "started without Intel OpenMP in LD_PRELOAD"
    if not one.speculative:
        return Judgement.OK, f"speculative decoding not requested; runs {described}"
    # libgomp: a runtime of GNU's interface, no KMP one (on which vLLM measured SD).
    gnu_only = not any(kind.kmp for kind in kinds)
    # Where the link map could not be read, libgomp serves when it is all that is mapped.
    if chosen and (not serves[0].kmp if serves else gnu_only):
        verb = "kept by" if chosen.by == "the plan" else "chosen by"
        return Judgement.OK, f"libgomp {verb} {chosen.by} ({chosen.why}): {described}"
    if gnu_only:
        return Judgement.PROBLEM, f"runs GNU libgomp only ({described})"
    if serves is None:
        # A visible LD_PRELOAD without Intel OpenMP says libgomp was bound first. vLLM's
        # renamed processes (VLLM::Worker...) have their start-up environment overwritten
        # by the process title, so an absent LD_PRELOAD there tells nothing.
        gnu = not all(kind.kmp for kind in kinds)
        if gnu and LD_PRELOAD in one.environment and not preloaded_iomp:
            why = f"Intel OpenMP loaded but not preloaded, so libgomp serves ({described})"
            return Judgement.PROBLEM, why
        return Judgement.OK, described
    kind, path = serves
    others = [runtime for runtime in runtimes if runtime != serves]
    also = f"; also mapped, not serving: {described_runtimes(others)}" if others else ""
    if kind.kmp:
        return Judgement.OK, f"{kind.title} serves ({path}){also}"
    late = next((other.title for other, _ in others if other.kmp), "another")
    return Judgement.PROBLEM, (
        f"GNU libgomp serves ({path}, first in the link map){also}: {late} was loaded "
        "after it, not preloaded"
    )


def vllm_title(cmdline: Sequence[str]) -> str | None:
    """The NAME of a process vLLM renamed "VLLM::NAME" (setproctitle), else None."""
    prefix, separator, name = (cmdline[0] if cmdline else "").partition("::")
    return name if separator and prefix and " " not in prefix else None


def role_of(cmdline: Sequence[str], is_root: bool) -> str:
    """By vLLM's title; else PID itself is the api-server where it runs `vllm serve`."""
    name = vllm_title(cmdline) or ""
    for start, role in {**MODEL_ROLES, "APIServer": "api-server"}.items():
        if name.startswith(start):
            return role
    if not is_root:
        return "other"
    serves = any(
        os.path.basename(word) == "vllm" and cmdline[index + 1 : index + 2] == ["serve"]
        for index, word in enumerate(cmdline)
    )
    return "api-server" if serves or "vllm.entrypoints.openai.api_server" in cmdline else "main"


PF_KTHREAD = 0x00200000  # /proc/PID/stat's flags: a kernel thread, which runs no program
CAP_SYS_PTRACE = 19


def kernel_thread(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as stream:  # flags: the 7th field after the name
        return bool(int(stream.read().rpartition(b")")[2].split()[6]) & PF_KTHREAD)


def may_ptrace() -> bool:
    """CAP_SYS_PTRACE among verify's effective capabilities."""
    with open("/proc/self/status") as stream:
        effective = next(line for line in stream if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> CAP_SYS_PTRACE & 1)


def permission_denied(pid: int) -> str:
    """Why /proc/PID is closed to verify, true of this case (the kernel's ptrace check), and
    the fix: another user's; undumpable (its files then belong to root); as root, a process
    with capabilities verify lacks (containers drop CAP_SYS_PTRACE)."""
    problem = f"cannot read /proc/{pid} (maps, environ): permission denied"
    try:
        uid = psutil.Process(pid).uids().real
        undumpable = os.stat(f"/proc/{pid}/maps").st_uid != uid
    except (OSError, psutil.Error):
        return f"{problem}; run verify as the user vLLM runs as, or as root"
    root = os.geteuid() == 0
    if undumpable:
        fix = "" if root else "; run verify as root"
        return (
            f"{problem}: process {pid} (uid {uid}) made itself undumpable (PR_SET_DUMPABLE 0, "
            f"or it runs a setuid or file-capability program), which closes it to all but "
            f"root with CAP_SYS_PTRACE{fix}"
        )
    advice = f"run verify as the user vLLM runs as (uid {uid})"
    if not root:
        return f"{problem}; {advice}, or as root"
    if uid != 0:
        return (
            f"{problem} although verify runs as root: reading another user's process needs "
            f"the CAP_SYS_PTRACE capability, which containers drop by default; {advice}"
        )
    if may_ptrace():
        return (
            f"{problem} although verify runs as root with CAP_SYS_PTRACE, and process {pid} "
            "as root too: a policy past users and capabilities refuses it (a security "
            "module, or the kernel's own)"
        )
    return (
        f"{problem} although verify runs as root, as process {pid} does: either it holds "
        "capabilities verify lacks or it made itself undumpable, and reading it then needs "
        "CAP_SYS_PTRACE, which containers drop by default; run verify with CAP_SYS_PTRACE"
    )


def inherited_by(process: psutil.Process) -> dict[str, Any] | None:
    """{from_pid, env}: the nearest unrenamed ancestor's start-up VARIABLES, which reached a
    renamed process at spawn (less what that ancestor changed later)."""
    try:
        for ancestor in process.parents():
            if vllm_title(ancestor.cmdline()) is None:
                whole = environment_of(ancestor.pid)
                shown = {name: whole[name] for name in VARIABLES if name in whole}
                return {"from_pid": ancestor.pid, "env": shown}
    except (OSError, psutil.Error):
        return None
    return None


@record
class Seen:
    """What inspect read of one process (environment: those of VARIABLES that show)."""

    pid: int
    ppid: int
    cmdline: list[str]
    role: str
    maps: str
    environment: dict[str, str]
    speculative: bool
    link_map: LinkMap
    inherited: dict[str, Any] | None = None  # {from_pid, env}, where vLLM renamed it
    unreadable: str | None = None  # why its maps and environ are closed to verify


def seen_of(
    process: psutil.Process, root: int, request: SpeculativeRequest, configs: Configs
) -> tuple[Seen, dict[str, str]] | None:
    """What verify reads of one process, and its whole environ; None if it is gone. A
    descendant closed to verify is said so; PID closed is an error."""
    pid = process.pid
    unreadable = None
    try:
        cmdline, ppid = process.cmdline(), process.ppid()  # open to all users
        try:
            with open(f"/proc/{pid}/maps", "rb") as stream:
                maps = stream.read().decode("utf-8", "surrogateescape")
            environment = environment_of(pid)
        except PermissionError:
            if pid == root:
                raise LaunchError(EXIT_USAGE, f"verify: {permission_denied(pid)}") from None
            maps, environment, unreadable = "", {}, permission_denied(pid)
    except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    while cmdline and not cmdline[-1]:  # a process title padded with NULs (VLLM::Worker)
        cmdline.pop()
    command = None if request.requested or pid == root else vllm_command(cmdline, pid, configs)
    wanted = request.requested or bool(command and command.speculative.requested)
    renamed = vllm_title(cmdline) is not None and not unreadable
    inherited = inherited_by(process) if renamed else None
    shown = {name: environment[name] for name in VARIABLES if name in environment}
    role = role_of(cmdline, pid == root)
    link_map = LinkMap(None, unreadable) if unreadable else read_link_map(pid)
    seen = Seen(pid, ppid, cmdline, role, maps, shown, wanted, link_map, inherited, unreadable)
    return seen, environment


# The plugin's readings by PID on the API server's /metrics, (url, readings, why not read):
# url None where there is no API server, readings None where none could be read.
Inside = tuple[str | None, dict[int, dict[str, str]] | None, str | None]
NO_API_SERVER: Inside = (None, None, None)
# A label of a Prometheus text line; its value escapes backslash, quote and newline.
LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
METRICS_SECONDS = 5  # for the whole request: a server that drips a byte a second included
METRICS_LIMIT = 8 << 20  # vLLM's /metrics is some 100 kB
ALL_ADDRESSES = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # a server on all addresses: ask here


class NotRead(Exception):
    """Why /metrics was not read."""


def held_sockets(pids: Iterable[int]) -> set[int]:
    """The inodes of the sockets these processes hold open (those verify may read)."""
    held = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        held.add(int(link[8:-1]))
    return held


def tcp_listeners(pid: int, port: int) -> Iterator[tuple[str, int]]:
    """(address, inode) of each TCP socket listening (state 0A) on `port` in PID's network
    namespace; /proc/net/tcp* give an address as 32-bit words in the host's byte order."""
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as stream:
            for line in stream.readlines()[1:]:
                fields = line.split()
                address, _, hex_port = fields[1].partition(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    words = (address[i : i + 8] for i in range(0, len(address), 8))
                    raw = b"".join(struct.pack("=I", int(word, 16)) for word in words)
                    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                    yield socket.inet_ntop(family, raw), int(fields[9])


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def tcp_connection(server: int, port: str, pids: Iterable[int], deadline: float) -> socket.socket:
    """To the socket on `port` that a process of the tree listens on, in verify's network."""
    if not (port.isascii() and port.isdigit()):
        raise NotRead(f"--port {port!r} is no port number")
    held = held_sockets(pids)
    listening = [address for address, inode in tcp_listeners(server, int(port)) if inode in held]
    if not listening:
        raise NotRead(
            f"no process of this tree listens on port {port}; verify reads /metrics only "
            "from a socket vLLM holds"
        )
    try:
        if os.readlink(f"/proc/{server}/ns/net") != os.readlink("/proc/self/ns/net"):
            raise NotRead(f"process {server} is in another network namespace: run verify in it")
    except OSError as error:
        raise NotRead(f"cannot read /proc/{server}/ns/net ({error.strerror})") from None
    address = ALL_ADDRESSES.get(listening[0], listening[0])
    return socket.create_connection((address, int(port)), timeout=remaining(deadline))


def uds_connection(path: str, pids: Iterable[int], deadline: float) -> socket.socket:
    """To `--uds PATH`, kept only where the process that listens there is of the tree."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(remaining(deadline))
        connection.connect(path)
        peer = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except BaseException:
        connection.close()
        raise
    if peer[0] not in pids:
        connection.close()
        raise NotRead(f"process {peer[0]}, not one of this tree, listens on {path}")
    return connection


def fetched(connection: socket.socket, deadline: float) -> str:
    """GET /metrics, all of it by `deadline` (each wait shortened to what is left)."""
    connection.settimeout(remaining(deadline))
    connection.sendall(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    response = b""
    while chunk := connection.recv(1 << 16):
        response += chunk
        if len(response) > METRICS_LIMIT:
            raise NotRead(f"it sent more than {METRICS_LIMIT >> 20} MiB")
        connection.settimeout(remaining(deadline))
    head, _, body = response.partition(b"\r\n\r\n")
    status = head.partition(b"\r\n")[0].decode("ascii", "replace")
    if status.split(" ")[1:2] != ["200"]:
        raise NotRead(f"it answered {status!r}")
    return body.decode("utf-8", "replace")


def inside_of(seen: Sequence[Seen], configs: Configs) -> Inside:
    """The plugin's series from the API server's /metrics: at its `--uds`, or its `--port`
    (command line and --config), read only from a socket the tree holds, in 5 s in all."""
    servers = [one for one in seen if one.role == "api-server"]
    if not servers:
        return NO_API_SERVER
    given = vllm_command(servers[0].cmdline, servers[0].pid, configs).listen
    pids = {one.pid for one in seen if not one.unreadable}
    deadline = time.monotonic() + METRICS_SECONDS
    uds = os.path.join(cwd_of(servers[0].pid), given["--uds"]) if "--uds" in given else None
    host = given.get("--host") or "127.0.0.1"
    host = ALL_ADDRESSES.get(host, host)
    port = given.get("--port") or "8000"  # vLLM's `--port` default
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
    if uds:
        url = f"http://localhost/metrics on unix socket {uds}"
    try:
        connection = (
            uds_connection(uds, pids, deadline)
            if uds
            else tcp_connection(servers[0].pid, port, pids, deadline)
        )
        with connection:
            text = fetched(connection, deadline)
    except NotRead as refusal:
        return url, None, str(refusal)
    except TimeoutError:
        return url, None, f"no whole answer within {METRICS_SECONDS} s"
    except OSError as error:
        return url, None, f"cannot read it: {error.strerror or error}"
    readings = {}
    for line in text.splitlines():  # `vllm_cpu_launch_openmp_info{...} 1.0`, by its pid label
        name, brace, rest = line.partition("{")
        labels = rest.rpartition("}")[0] if name == handoff.INFO_METRIC and brace else ""
        pairs = {
            key: re.sub(r"\\.", lambda e: ESCAPES.get(e[0], e[0]), value)
            for key, value in LABEL.findall(labels)
        }
        if pairs.get("pid", "").isdigit():
            readings[int(pairs["pid"])] = pairs
    why = None if readings else f"no {handoff.INFO_METRIC} in it: the plugin is not installed"
    return url, readings or None, why


def inspect(pid: int, speculative: bool = False) -> dict[str, Any]:
    """The report on PID's tree; `speculative`: SD counts as requested whatever is asked."""
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
        cmdline = root.cmdline()
        thread = kernel_thread(pid)
    except (psutil.NoSuchProcess, FileNotFoundError, ValueError, OverflowError):
        raise LaunchError(EXIT_USAGE, f"verify: no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise LaunchError(EXIT_USAGE, f"verify: {permission_denied(pid)}") from None
    if thread:
        raise LaunchError(
            EXIT_USAGE,
            f"verify: process {pid} ({root.name()}) is a kernel thread, which runs no program: "
            "give vLLM's PID (systemctl show -p MainPID --value UNIT)",
        )
    given = SpeculativeRequest(True, "--speculative, given to verify")
    configs = functools.cache(read_config)  # each --config file of the tree read once
    request = given if speculative else vllm_command(cmdline, pid, configs).speculative
    read = seen_of(root, pid, request, configs)
    if read is None:
        raise LaunchError(EXIT_USAGE, f"verify: process {pid} exited")
    # libgomp is the user's choice where `iomp: never` is in the settings as the plan read
    # them: from PID's start-up environment and the config files it names (from its cwd).
    environ = read[1]
    for name in (settings.CONFIG_VARIABLE, settings.deprecated_name(settings.CONFIG_VARIABLE)):
        if environ.get(name):
            environ[name] = os.path.join(cwd_of(pid), environ[name])
    loaded = settings.load_settings({}, environ, errors=[])  # what is broken is left out
    never = loaded.iomp == settings.Mode.NEVER
    users = Choice("the user", settings.said_setting(loaded, "iomp")) if never else None
    children = (seen_of(process, pid, request, configs) for process in descendants)
    seen = [read[0], *(child[0] for child in children if child is not None)]
    return assemble(pid, request, seen, users, inside_of(seen, configs))


def assemble(
    pid: int,
    root_request: SpeculativeRequest,
    seen: Sequence[Seen],
    users: Choice | None = None,
    inside: Inside = NO_API_SERVER,
) -> dict[str, Any]:
    """The report from what was read (PID first); `users`: the user's choice of libgomp."""
    url, readings, why = inside
    split = any(one.role in MODEL_ROLES.values() for one in seen)
    # A plan that keeps libgomp marks it (docs/design.md, "verify"). Only a bare mark is a
    # choice: NOT_FOUND_MARK kept libgomp for want of Intel OpenMP, STARTED_MARK kept none.
    marks = (one.environment.get(PLANNED_VARIABLE) for one in seen)
    mark = next((mark for mark in marks if mark in {p.value for p in handoff.Planner}), None)
    chosen = Choice("the plan", f"{PLANNED_VARIABLE}={mark}") if mark else users
    processes = []
    for one in seen:
        mapped, runtimes, serves, how = load_order(one.link_map, one.maps)
        if one.unreadable:
            verdict, reason, how = Judgement.UNREADABLE, one.unreadable, one.unreadable
        elif split and one.role not in MODEL_ROLES.values():
            runs = described_runtimes(runtimes) or "no OpenMP runtime loaded"
            verdict, reason = Judgement.REPORTED, f"{runs}; runs no model code, so not judged"
        else:
            verdict, reason = judge(runtimes, serves, one, one.pid == pid, chosen)
        processes.append(
            {
                "pid": one.pid,
                "ppid": one.ppid,
                "cmdline": one.cmdline,
                "role": one.role,
                "runtimes": [runtime_entry(*runtime) for runtime in mapped],
                "load_order": [runtime_entry(*runtime) for runtime in runtimes],
                "serves": None if serves is None else runtime_entry(*serves),
                "order": how,
                "env": one.environment,
                "environment": environment_entry(one, serves),
                "inside": (readings or {}).get(one.pid),
                "speculative": one.speculative,
                "verdict": verdict,
                "reason": reason,
            }
        )
    cpus = server_cpus(seen)
    return {
        "pid": pid,
        "speculative": {"requested": root_request.requested, "source": root_request.source},
        "ok": all(process["verdict"] != Judgement.PROBLEM for process in processes)
        and not (cpus or {}).get("outside"),
        "inside": {"url": url, "read": readings is not None, "why": why},
        "processes": processes,
        "cpus": cpus,
    }


def server_cpus(seen: Sequence[Seen]) -> dict[str, Any] | None:
    """A server `servers` planned (its SERVER_CPUS in the tree's environments): the processes
    whose Cpus_allowed_list (/proc/PID/status) goes outside the CPUs it was given."""
    inherited = (({} if one.inherited is None else one.inherited["env"]) for one in seen)
    marks = [*(one.environment for one in seen), *inherited]
    planned = next((mark[SERVER_CPUS] for mark in marks if mark.get(SERVER_CPUS)), None)
    if planned is None:
        return None
    outside: dict[int, str] = {}
    try:
        given = set(id_list(planned, SERVER_CPUS))
        for one in seen:
            lines = (read_text("/", f"proc/{one.pid}/status", None) or "").splitlines()
            listed = [line.split(":", 1)[1] for line in lines if line.startswith("Cpus_allowed_l")]
            allowed = (
                set(id_list(listed[0].strip(), f"/proc/{one.pid}/status")) if listed else given
            )
            if allowed - given:
                outside[one.pid] = id_words(allowed)
    except Unreadable as error:
        return {"planned": planned, "outside": outside, "why": str(error)}
    return {"planned": planned, "outside": outside, "why": None}


# What vLLM writes into a worker's environment at spawn when it binds its threads
# (vllm/utils/ompmultiprocessing.py, configure_omp_envs, vllm-cpu 0.32.0), by what
# LD_PRELOAD names; OMP_NUM_THREADS is the worker's CPU count. Under
# VLLM_CPU_OMP_THREADS_BIND=nobind it writes none of them.
VLLM_BINDS = {  # by whether vLLM takes it for Intel's (KMP), GNU's, or none
    True: "OMP_NUM_THREADS, KMP_AFFINITY=granularity=fine,explicit,proclist=[...], "
    "KMP_BLOCKTIME=5, KMP_TPAUSE=0",
    False: "OMP_NUM_THREADS, GOMP_CPU_AFFINITY",
    None: "OMP_NUM_THREADS, OMP_PLACES, OMP_PROC_BIND=true",
}
NOBIND = f"{BIND}=nobind"


def environment_entry(one: Seen, serves: Runtime | None) -> dict[str, Any]:
    """Where vLLM's title overwrote environ: what was inherited, and what vLLM wrote over it."""
    if one.unreadable:
        return {"readable": False, "why": one.unreadable, "inherited": one.inherited}
    if vllm_title(one.cmdline) is None:
        return {"readable": True}
    why = (
        f"vLLM renamed the process ({one.cmdline[0]}) and the title overwrote "
        f"/proc/{one.pid}/environ: only its tail shows"
    )
    entry: dict[str, Any] = {"readable": False, "why": why, "inherited": one.inherited}
    if one.role != "worker":
        return entry
    # vLLM goes by LD_PRELOAD, which a worker served by Intel or LLVM OpenMP had (that is
    # how the runtime came first), and by the bind setting, set after start-up perhaps.
    basis = {**(one.inherited or {}).get("env", {}), **one.environment}
    bind = basis.get(BIND)
    if bind == "nobind":
        entry["vllm_sets"] = f"nothing ({NOBIND}): the worker keeps what it inherited"
        return entry
    preload = basis.get(LD_PRELOAD, "")
    kmp = (serves is not None and serves[0].kmp) or vllm_reads_kmp(preload)
    kind = True if kmp else False if vllm_reads_gnu(preload) else None
    unless = f"unless {NOBIND} was set after start-up, where it does not show"
    if bind is not None:
        unless = f"{BIND}={bind}"
    entry["vllm_sets"] = f"{VLLM_BINDS[kind]}, over what it inherited ({unless})"
    return entry


def runtime_entry(kind: Kind, path: str) -> dict[str, str]:
    return {"kind": kind.value, "path": path}


def described_runtimes(runtimes: Sequence[Runtime]) -> str:
    return ", ".join(f"{kind.title} {path}" for kind, path in runtimes)


def shortened(command: str, width: int = 100) -> str:
    """A long command cut with a visible marker; --json keeps it whole."""
    if len(command) <= width:
        return command
    return f"{command[:width]}... [{len(command) - width} more characters; --json shows them all]"


def verify_as_text(report: dict[str, Any]) -> str:
    """The report for people: a block per process, where the inside readings came from."""
    lines = [f"speculative decoding: {described_request(**report['speculative'])}"]
    for process in report["processes"]:
        command = shortened(shlex.join(process["cmdline"])) or "?"
        role = f"{process['role']} (parent {process['ppid']})"
        lines.append(f"{process['pid']:>7}  {process['verdict']:<8} {role}: {command}")
        lines.extend(f"{'':>9}{line}" for line in [process["reason"], *process_lines(process)])
    inside = report["inside"]
    if inside["read"]:
        lines.append(f"read from inside: the plugin's series on {inside['url']}")
    elif inside["url"] is None:
        lines.append("no inside reading (no API server in this tree to ask its /metrics)")
    else:
        lines.append(f"no inside reading from {inside['url']} ({inside['why']})")
    cpus = report["cpus"]
    if cpus and cpus["outside"]:
        away = ", ".join(f"PID {pid} may run on CPUs {c}" for pid, c in cpus["outside"].items())
        lines.append(
            f"PROBLEM: {away}, outside the CPUs {cpus['planned']} its server was given "
            f"({SERVER_CPUS}); start it as `servers` renders it (its unit's drop-in, or taskset -c)"
        )
    elif cpus:
        said = f"not all checked ({cpus['why']})" if cpus["why"] else "every process within"
        lines.append(f"CPUs: {said} {cpus['planned']}, its server's ({SERVER_CPUS})")
    verdicts = [process["verdict"] for process in report["processes"]]
    problems, unread = verdicts.count(Judgement.PROBLEM), verdicts.count(Judgement.UNREADABLE)
    judged = len(verdicts) - verdicts.count(Judgement.REPORTED) - unread
    if problems:
        lacks = "process lacks" if judged == 1 else "processes lack"
        lines.append(
            f"PROBLEM: {problems} of {judged} judged {lacks} Intel OpenMP serving it while "
            "speculative decoding is requested and no plan chose libgomp; start vLLM through "
            "vllm-cpu-launch, or install vllm-cpu-launch into vLLM's environment (its plugin)"
        )
    else:
        noun = "process" if judged == 1 else "processes"
        unreadable = f", {unread} unreadable" if unread else ""
        lines.append(f"ok: {judged} {noun} judged, {len(verdicts) - unread} checked{unreadable}")
    return "\n".join(lines)


NONE_SET = "no LD_PRELOAD, KMP_* or OMP_NUM_THREADS set"


def variables_text(environment: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in environment.items())


def process_lines(process: dict[str, Any]) -> list[str]:
    """A process's runtimes and environment, or why it is unreadable and what it inherited."""
    order = ", ".join(
        f"{kind_of(r['kind']).title} {r['path']}{' (serves)' if r == process['serves'] else ''}"
        for r in process["load_order"]
    )
    lines = [f"OpenMP runtimes, {process['order']}: {order or 'none'}"]
    labels = process["inside"]
    if labels is not None:
        runtime, library = labels.get("runtime", ""), labels.get("library", "")
        serves = f"{runtime} serves ({library})"
        if runtime == "none":
            named = f", library {library}" if library else ""
            serves = f"no OpenMP runtime serves (runtime none{named})"
        threads = labels.get("threads") or "?"
        lines.append(
            f"read from inside ({labels.get('role', '?')}, /metrics): {serves}, block time "
            f"{labels.get('blocktime_ms') or '-'} ms, {threads} thread"
            f"{'' if threads == '1' else 's'}, bind {labels.get('bind') or 'unset'}"
        )
    if process["verdict"] == Judgement.UNREADABLE:
        return lines[1:]  # its reason says what could not be read
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


def main(values: dict[str, object], args: list[str]) -> int:
    """The verb; exit 1 (EXIT_PROBLEM) where a judged process has a problem."""
    flags = {**FLAG_OPTIONS, "--speculative": "speculative"}
    more, rest = parse_options(args, {}, flags, verb="verify")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    if len(rest) != 1:
        usage = "vllm-cpu-launch verify [--json] [--speculative] PID"
        raise LaunchError(EXIT_USAGE, f"verify needs one PID: {usage}")
    if not (rest[0].isascii() and rest[0].isdigit()):
        raise LaunchError(EXIT_USAGE, f"verify: {rest[0]!r} is not a process ID")
    if int(rest[0]) == 0:
        raise LaunchError(
            EXIT_USAGE,
            f"verify: {rest[0]!r} is not a process ID: 0 is what `systemctl show -p MainPID "
            "--value UNIT` prints for a unit that is not running; start the unit (systemctl "
            "status UNIT says why it stopped), then verify its MainPID",
        )
    report = inspect(int(rest[0]), bool(merged.get("speculative")))
    if merged.get("json"):
        write_stdout(json.dumps({"schema": schema("verify"), **report}, indent=2))
    else:
        write_stdout(verify_as_text(report))
    return 0 if report["ok"] else EXIT_PROBLEM

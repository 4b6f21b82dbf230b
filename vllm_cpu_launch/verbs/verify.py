"""`vllm-cpu-launch verify PID`: does a running vLLM run the OpenMP runtime its plan chose?

It reads PID's tree from /proc (maps, environ, the link map) and the plugin's readings on
/metrics; docs/design.md ("verify") says what is evidence and why.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import urllib.request
from typing import TYPE_CHECKING

import psutil

from vllm_cpu_launch import handoff, settings
from vllm_cpu_launch.cli import FLAG_OPTIONS, parse_options, write_stdout
from vllm_cpu_launch.command import Option, SpeculativeRequest, detect, on_command_line
from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError, StrEnum, record
from vllm_cpu_launch.handoff import LD_PRELOAD, PLANNED_VARIABLE, Library, vllm_reads
from vllm_cpu_launch.linkmap import LinkMap, read_link_map
from vllm_cpu_launch.plan import described_request, schema
from vllm_cpu_launch.trust import identify

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from typing import Any

Runtime = tuple[Library, str]


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


BIND = "VLLM_CPU_OMP_THREADS_BIND"
VARIABLES = (LD_PRELOAD, "KMP_BLOCKTIME", "KMP_AFFINITY", "OMP_NUM_THREADS", BIND, PLANNED_VARIABLE)
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
2 when PID cannot be found or read (run as vLLM's user).
  --speculative   judge as if SD is requested: vLLM's offline API (LLM(...)) and
                  `vllm bench` take it in Python or a config, not on their command line
"""


def runtimes_in(paths: Iterable[str]) -> tuple[list[Runtime], Runtime | None]:
    """The OpenMP runtimes among `paths` (trust.identify), and the first that defines
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


def cwd_of(process: psutil.Process) -> str:
    """Relative file names on its command line and in its environment are relative to it."""
    try:
        return process.cwd()
    except psutil.Error:
        return ""


def speculative_of(cmdline: Sequence[str], process: psutil.Process) -> SpeculativeRequest:
    """What the vLLM part of its command line requests, `--config FILE` read from its cwd."""
    arguments = list(cmdline[1:])
    for index, word in enumerate(arguments):
        if os.path.basename(word) in ("vllm", "vllm-cpu-launch"):
            arguments = arguments[index + 1 :]
            break
    for index, word in enumerate(arguments[:-1]):
        if word == "--config":
            arguments[index + 1] = os.path.join(cwd_of(process), arguments[index + 1])
    return detect(arguments)


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
    preloaded_iomp = Library.INTEL in vllm_reads(preload)
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
    gnu_only = set(kinds) == {Library.GNU}
    # Where the link map could not be read, libgomp serves when it is all that is mapped.
    if chosen and (serves[0] is Library.GNU if serves else gnu_only):
        verb = "kept by" if chosen.by == "the plan" else "chosen by"
        return Judgement.OK, f"libgomp {verb} {chosen.by} ({chosen.why}): {described}"
    if gnu_only:
        return Judgement.PROBLEM, f"runs GNU libgomp only ({described})"
    if serves is None:
        # A visible LD_PRELOAD without Intel OpenMP says libgomp was bound first. vLLM's
        # renamed processes (VLLM::Worker...) have their start-up environment overwritten
        # by the process title, so an absent LD_PRELOAD there tells nothing.
        if Library.GNU in kinds and LD_PRELOAD in one.environment and not preloaded_iomp:
            why = f"Intel OpenMP loaded but not preloaded, so libgomp serves ({described})"
            return Judgement.PROBLEM, why
        return Judgement.OK, described
    kind, path = serves
    others = [runtime for runtime in runtimes if runtime != serves]
    also = f"; also mapped, not serving: {described_runtimes(others)}" if others else ""
    if kind is not Library.GNU:
        return Judgement.OK, f"{kind.title} serves ({path}){also}"
    late = next((other.title for other, _ in others if other is not Library.GNU), "another")
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


def permission_denied(pid: int) -> str:
    """As root, a missing capability (containers drop CAP_SYS_PTRACE), not a missing root."""
    try:
        owner = f"uid {os.stat(f'/proc/{pid}').st_uid}"
    except OSError:
        owner = "its user"
    problem = f"verify: cannot read /proc/{pid} (maps, environ): permission denied"
    advice = f"run verify as the user vLLM runs as ({owner})"
    if os.geteuid() != 0:
        return f"{problem}; {advice}, or as root"
    return (
        f"{problem} although verify runs as root: reading another user's process needs the "
        f"CAP_SYS_PTRACE capability, which containers drop by default; {advice}"
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


def seen_of(
    process: psutil.Process, root: int, request: SpeculativeRequest
) -> tuple[Seen, dict[str, str]] | None:
    """What verify reads of one process, and its whole environ; None if it is gone."""
    pid = process.pid
    try:
        with open(f"/proc/{pid}/maps", "rb") as stream:
            maps = stream.read().decode("utf-8", "surrogateescape")
        environment = environment_of(pid)
        cmdline = process.cmdline()
        ppid = process.ppid()
    except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except PermissionError:
        raise LaunchError(EXIT_USAGE, permission_denied(pid)) from None
    while cmdline and not cmdline[-1]:  # a process title padded with NULs (VLLM::Worker)
        cmdline.pop()
    wanted = request.requested or (pid != root and speculative_of(cmdline, process).requested)
    inherited = inherited_by(process) if vllm_title(cmdline) is not None else None
    shown = {name: environment[name] for name in VARIABLES if name in environment}
    role = role_of(cmdline, pid == root)
    seen = Seen(pid, ppid, cmdline, role, maps, shown, wanted, read_link_map(pid), inherited)
    return seen, environment


# The plugin's readings by PID on the API server's /metrics, (url, readings): url None
# where there is no API server, readings None where none could be read.
Inside = tuple[str | None, dict[int, dict[str, str]] | None]
NO_API_SERVER: Inside = (None, None)
# A label of a Prometheus text line; its value escapes backslash, quote and newline.
LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def inside_of(seen: Sequence[Seen]) -> Inside:
    """The plugin's series from the API server's /metrics (2 s), at its `--host`/`--port`."""
    servers = [one.cmdline for one in seen if one.role == "api-server"]
    if not servers:
        return NO_API_SERVER
    options = [Option("--host", "--host"), Option("--port", "--port")]  # no abbreviations
    given = {found.option: found.value for found in on_command_line(servers[0], options)}
    host = given.get("--host") or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # all addresses: ask here
    port = given.get("--port") or "8000"  # vLLM's `--port` default
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return url, None
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
    return url, readings or None


def inspect(pid: int, speculative: bool = False) -> dict[str, Any]:
    """The report on PID's tree; `speculative`: SD counts as requested whatever is asked."""
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
        cmdline = root.cmdline()
    except (psutil.NoSuchProcess, ValueError, OverflowError):
        raise LaunchError(EXIT_USAGE, f"verify: no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise LaunchError(EXIT_USAGE, permission_denied(pid)) from None
    given = SpeculativeRequest(True, "--speculative, given to verify")
    request = given if speculative else speculative_of(cmdline, root)
    read = seen_of(root, pid, request)
    if read is None:
        raise LaunchError(EXIT_USAGE, f"verify: process {pid} exited")
    # libgomp is the user's choice where `iomp: never` is in the settings as the plan read
    # them: from PID's start-up environment and the config files it names (from its cwd).
    environ = read[1]
    for name in (settings.CONFIG_VARIABLE, settings.deprecated_name(settings.CONFIG_VARIABLE)):
        if environ.get(name):
            environ[name] = os.path.join(cwd_of(root), environ[name])
    loaded = settings.load_settings({}, environ, errors=[])  # what is broken is left out
    never = loaded.iomp == settings.Mode.NEVER
    users = Choice("the user", settings.said_setting(loaded, "iomp")) if never else None
    children = (seen_of(process, pid, request) for process in descendants)
    seen = [read[0], *(child[0] for child in children if child is not None)]
    return assemble(pid, request, seen, users, inside_of(seen))


def assemble(
    pid: int,
    root_request: SpeculativeRequest,
    seen: Sequence[Seen],
    users: Choice | None = None,
    inside: Inside = NO_API_SERVER,
) -> dict[str, Any]:
    """The report from what was read (PID first); `users`: the user's choice of libgomp."""
    url, readings = inside
    split = any(one.role in MODEL_ROLES.values() for one in seen)
    # A plan that keeps libgomp marks it (docs/design.md, "verify"). Only a bare mark is a
    # choice: NOT_FOUND_MARK kept libgomp for want of Intel OpenMP, STARTED_MARK kept none.
    marks = (one.environment.get(PLANNED_VARIABLE) for one in seen)
    mark = next((mark for mark in marks if mark in (handoff.LAUNCHER, handoff.PLUGIN)), None)
    chosen = Choice("the plan", f"{PLANNED_VARIABLE}={mark}") if mark else users
    processes = []
    for one in seen:
        mapped, runtimes, serves, how = load_order(one.link_map, one.maps)
        if split and one.role not in MODEL_ROLES.values():
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
    return {
        "pid": pid,
        "speculative": {"requested": root_request.requested, "source": root_request.source},
        "ok": all(process["verdict"] != Judgement.PROBLEM for process in processes),
        "inside": {"url": url, "read": readings is not None},
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
NOBIND = f"{BIND}=nobind"


def environment_entry(one: Seen, serves: Runtime | None) -> dict[str, Any]:
    """Where vLLM's title overwrote environ: what was inherited, and what vLLM wrote over it."""
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
    found = vllm_reads(basis.get(LD_PRELOAD, ""))
    kmp = (serves is not None and serves[0].kmp) or Library.INTEL in found
    kind = Library.INTEL if kmp else Library.GNU if Library.GNU in found else None
    unless = f"unless {NOBIND} was set after start-up, where it does not show"
    if bind is not None:
        unless = f"{BIND}={bind}"
    entry["vllm_sets"] = f"{VLLM_BINDS[kind]}, over what it inherited ({unless})"
    return entry


def runtime_entry(kind: Library, path: str) -> dict[str, str]:
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
        why = "the plugin is not installed, or /metrics unreachable"
        lines.append(f"no inside reading from {inside['url']} ({why})")
    verdicts = [process["verdict"] for process in report["processes"]]
    problems = verdicts.count(Judgement.PROBLEM)
    judged = len(verdicts) - verdicts.count(Judgement.REPORTED)
    if problems:
        lacks = "process lacks" if judged == 1 else "processes lack"
        lines.append(
            f"PROBLEM: {problems} of {judged} judged {lacks} Intel OpenMP serving it while "
            "speculative decoding is requested and no plan chose libgomp; start vLLM through "
            "vllm-cpu-launch, or install vllm-cpu-launch into vLLM's environment (its plugin)"
        )
    else:
        noun = "process" if judged == 1 else "processes"
        lines.append(f"ok: {judged} {noun} judged, {len(verdicts)} checked")
    return "\n".join(lines)


NONE_SET = "no LD_PRELOAD, KMP_* or OMP_NUM_THREADS set"


def variables_text(environment: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in environment.items())


def process_lines(process: dict[str, Any]) -> list[str]:
    """A process's runtimes and environment, or why it is unreadable and what it inherited."""
    order = ", ".join(
        f"{Library(r['kind']).title} {r['path']}{' (serves)' if r == process['serves'] else ''}"
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

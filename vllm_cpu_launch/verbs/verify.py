"""`vllm-cpu-launch verify PID`: does a running vLLM run the OpenMP runtime its plan chose?

For the process and all its descendants it reads which OpenMP runtimes are mapped
(/proc/PID/maps), the LD_PRELOAD/KMP_* variables the process started with
(/proc/PID/environ), and whether its command line requests speculative decoding
(children inherit the verdict of their parent: vLLM's workers are spawned with a
command line of their own). The processes that run model code are judged: vLLM's
engine cores and workers (by the titles vLLM gives them), or, where there are none (an
engine in the front end), the process itself; the others, the API server first, are
reported, since vLLM's plugin cannot change the runtime of the process that loads it.

libgomp is a choice, not a problem, where the plan that started the tree made it: its
mark (VLLMCPULAUNCH_PLANNED) where a process still shows it, or the user's `iomp: never`,
re-read from PID's start-up environment and the config files it names, as the plan read
them (docs/design.md, "verify", says why those are the evidence). Exit 1 when SD is
requested and a judged process lacks Intel OpenMP that no plan chose to leave out; 0 when
all is well; 2 when the process cannot be found or read.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import LAUNCHER, PLANNED_VARIABLE, PLUGIN
from vllm_cpu_launch.libraries import LLVM

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    import psutil

    from vllm_cpu_launch.speculative import SpeculativeRequest

INTEL = "iomp"  # Intel's libiomp5
# LLVM's libomp (Debian's libiomp5.so resolves to it): same KMP_* interface; libraries.LLVM
GNU = "gomp"
RUNTIME_TITLES = {INTEL: "Intel OpenMP", LLVM: "LLVM OpenMP", GNU: "GNU libgomp"}
VARIABLES = (
    "LD_PRELOAD",
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
descendants: which OpenMP runtime each has loaded, the LD_PRELOAD/KMP_* it started
with, and whether speculative decoding is requested. The processes that run the model
are judged (vLLM's engine cores and workers; where there are none, PID itself and its
children); the API server and other helpers are reported. libgomp that the plan chose
(the launcher's or the plugin's mark VLLMCPULAUNCH_PLANNED, or iomp: never in PID's
environment or config files) is fine.
Exit 0 when every judged process has Intel OpenMP, or the libgomp it runs was chosen, or
SD is not requested; 1 when one runs libgomp that nothing chose; 2 when PID cannot be
found or read (as the user vLLM runs as, verify can read it).
  --speculative   judge as if SD is requested: vLLM's offline API (LLM(...)) and
                  `vllm bench` take it in Python or a config, not on their command line
"""


def runtime_of(path: str) -> str | None:
    """Which OpenMP runtime a mapped file is, by its name (as vLLM tells them apart)."""
    name = os.path.basename(path)
    if "libiomp" in name:
        return INTEL
    if "libgomp" in name:
        return GNU
    if name.startswith("libomp") and not name.startswith("libomptarget"):
        return LLVM
    return None


def mapped_runtimes(maps: str) -> list[tuple[str, str]]:
    """(runtime, path) for each OpenMP runtime in a /proc/PID/maps text, in map order."""
    found: dict[str, str] = {}
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].removesuffix(" (deleted)")
        kind = runtime_of(path)
        if kind is not None and path not in found:
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
    import psutil

    try:
        return process.cwd()
    except psutil.Error:
        return None


def speculative_of(process: psutil.Process) -> SpeculativeRequest:
    import psutil

    from vllm_cpu_launch.speculative import detect

    try:
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        cmdline = []
    return detect(vllm_arguments(cmdline, cwd_of(process)))


def judge(
    runtimes: list[tuple[str, str]],
    environment: dict[str, str],
    is_root: bool,
    wanted: bool,
    chosen: str | None = None,
) -> tuple[str, str]:
    """(verdict, reason) for one process: ok, problem, or skipped (runs no OpenMP).
    `chosen`: why libgomp is the plan's choice for this tree (assemble), if it is."""
    kinds = [kind for kind, _ in runtimes]
    preload = environment.get("LD_PRELOAD", "")
    preloaded_iomp = "libiomp" in preload or "libomp" in preload
    described = described_runtimes(runtimes)
    if not runtimes:
        if not is_root:
            return "skipped", "no OpenMP runtime loaded"
        if not wanted:
            return "ok", "no OpenMP runtime loaded yet"
        if preloaded_iomp:
            return "problem", f"LD_PRELOAD names {preload} but no OpenMP runtime is loaded"
        return "problem", "started without Intel OpenMP in LD_PRELOAD"
    if not wanted:
        return "ok", f"speculative decoding not requested; runs {described}"
    if INTEL not in kinds and LLVM not in kinds and chosen:
        return "ok", f"{chosen}: {described}"
    if INTEL not in kinds and LLVM not in kinds:
        return "problem", f"runs GNU libgomp only ({described})"
    # torch's own libgomp is mapped in every vLLM process; it only matters when Intel
    # OpenMP was loaded after it. That shows in a visible LD_PRELOAD; vLLM's renamed
    # processes (VLLM::Worker...) have their start-up environment overwritten by the
    # process title, so an absent LD_PRELOAD there tells nothing.
    if GNU in kinds and "LD_PRELOAD" in environment and not preloaded_iomp:
        return "problem", f"Intel OpenMP loaded but not preloaded, so libgomp serves ({described})"
    return "ok", described


def users_choice(start_environment: dict[str, str], cwd: str | None) -> str | None:
    """Why libgomp is the user's own choice, `iomp: never`, read as the plan read it: from
    PID's start-up environment and the config files it names (a relative
    VLLMCPULAUNCH_CONFIG is PID's working directory's); None where it is not."""
    from vllm_cpu_launch.settings import CONFIG_VARIABLE, deprecated_name, load_settings

    environ = dict(start_environment)
    for name in (CONFIG_VARIABLE, deprecated_name(CONFIG_VARIABLE)):
        if environ.get(name) and cwd and not os.path.isabs(environ[name]):
            environ[name] = os.path.join(cwd, environ[name])
    settings = load_settings({}, environ, errors=[])  # what is broken is left out
    if settings.iomp != "never":
        return None
    where = {"variable": "VLLMCPULAUNCH_IOMP", "config": ", ".join(settings.config_files)}
    source = where.get(settings.iomp_from, settings.iomp_from)
    return f"libgomp chosen by the user (iomp: never, from {source})"


def role_of(cmdline: Sequence[str], is_root: bool) -> str:
    """engine-core or worker (model code), api-server (so titled, or PID itself where it
    runs `vllm serve`), main (PID itself otherwise: a script, a program), other."""
    title = cmdline[0] if cmdline else ""
    prefix, separator, name = title.partition("::")
    if separator and prefix and " " not in prefix:  # a vLLM process title
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
    import psutil

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


def inspect(pid: int, speculative: bool = False) -> dict[str, Any]:
    """The verify report for PID and its descendants (see docs/operating.md); with
    `speculative`, SD counts as requested whatever the command lines say."""
    import psutil

    from vllm_cpu_launch.speculative import SpeculativeRequest

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
        role = role_of(cmdline, is_root)
        shown = {name: environment[name] for name in VARIABLES if name in environment}
        seen.append((process.pid, ppid, cmdline, role, maps, shown, request.requested))
    return assemble(pid, root_request, seen, users)


# What inspect reads of each process: PID, parent PID, command line, role, the text of
# /proc/PID/maps, the variables of VARIABLES it started with, whether SD is requested.
Seen = tuple[int, int, list[str], str, str, dict[str, str], bool]


def assemble(
    pid: int, root_request: SpeculativeRequest, seen: Sequence[Seen], users: str | None = None
) -> dict[str, Any]:
    """The report from what was read: each process judged or reported, PID first.
    `users`: why libgomp is the user's own choice (users_choice), if it is."""
    # Where vLLM runs the model in engine-core and worker processes, only they are judged.
    split = any(role in MODEL_ROLES.values() for _, _, _, role, *_ in seen)
    # A plan that keeps libgomp marks it. The launcher's mark is in PID's environment as
    # it started; the plugin sets its own in the front end after start-up, so only the
    # processes vLLM spawns show it (its renamed ones in the tail of their environment
    # that the title leaves; docs/design.md, "verify"). Else the user's own choice.
    # Only a planner's bare mark is a choice: NOT_FOUND_MARK kept libgomp for want of Intel
    # OpenMP, and STARTED_MARK kept none.
    marks = [
        mark
        for _, _, _, _, _, env, _ in seen
        if (mark := env.get(PLANNED_VARIABLE, "")) in (LAUNCHER, PLUGIN)
    ]
    chosen = f"libgomp kept by the plan ({PLANNED_VARIABLE}={marks[0]})" if marks else users
    processes = []
    for process_id, ppid, cmdline, role, maps, environment, wanted in seen:
        runtimes = mapped_runtimes(maps)
        if split and role not in MODEL_ROLES.values():
            runs = described_runtimes(runtimes) or "no OpenMP runtime loaded"
            verdict, reason = "reported", f"{runs}; runs no model code, so not judged"
        else:
            verdict, reason = judge(runtimes, environment, process_id == pid, wanted, chosen)
        processes.append(
            {
                "pid": process_id,
                "ppid": ppid,
                "cmdline": cmdline,
                "role": role,
                "runtimes": [{"kind": kind, "path": path} for kind, path in runtimes],
                "env": environment,
                "speculative": wanted,
                "verdict": verdict,
                "reason": reason,
            }
        )
    problems = [p for p in processes if p["verdict"] == "problem"]
    return {
        "pid": pid,
        "speculative": {"requested": root_request.requested, "source": root_request.source},
        "ok": not problems,
        "processes": processes,
    }


def described_runtimes(runtimes: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{RUNTIME_TITLES[kind]} {path}" for kind, path in runtimes)


COMMAND_WIDTH = 100


def shortened(command: str) -> str:
    """A long command cut with a visible marker; --json keeps it whole."""
    if len(command) <= COMMAND_WIDTH:
        return command
    rest = len(command) - COMMAND_WIDTH
    return f"{command[:COMMAND_WIDTH]}... [{rest} more characters; --json shows them all]"


def render_text(report: dict[str, Any]) -> str:
    import shlex

    from vllm_cpu_launch.plan import described_request

    speculative = described_request(
        report["speculative"]["requested"], report["speculative"]["source"]
    )
    lines = [f"speculative decoding: {speculative}"]
    for process in report["processes"]:
        command = shortened(shlex.join(process["cmdline"])) or "?"
        role = f"{process['role']} (parent {process['ppid']})"
        lines.append(f"{process['pid']:>7}  {process['verdict']:<8} {role}: {command}")
        lines.append(f"{'':>9}{process['reason']}")
        variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in process["env"].items())
        lines.append(f"{'':>9}{variables or 'no LD_PRELOAD, KMP_* or OMP_NUM_THREADS set'}")
    problems = sum(p["verdict"] == "problem" for p in report["processes"])
    judged = sum(p["verdict"] != "reported" for p in report["processes"])
    if problems:
        lacks = "process lacks" if judged == 1 else "processes lack"
        lines.append(
            f"PROBLEM: {problems} of {judged} judged {lacks} Intel OpenMP while speculative "
            "decoding is requested and no plan chose libgomp; start vLLM through "
            "vllm-cpu-launch, or install vllm-cpu-launch into vLLM's environment (its plugin)"
        )
    else:
        noun = "process" if judged == 1 else "processes"
        lines.append(f"ok: {judged} {noun} judged, {len(report['processes'])} checked")
    return "\n".join(lines)


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
    from vllm_cpu_launch.launch import FLAG_OPTIONS, parse_options, write_stdout

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
        from vllm_cpu_launch.plan import schema

        write_stdout(json.dumps({"schema": schema("verify"), **report}, indent=2))
    else:
        write_stdout(render_text(report))
    return 0 if report["ok"] else EXIT_PROBLEM

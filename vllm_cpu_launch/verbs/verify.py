"""`vllm-cpu-launch verify PID`: does a running vLLM really have Intel OpenMP?

For the process and all its descendants it reads which OpenMP runtimes are mapped
(/proc/PID/maps), the LD_PRELOAD/KMP_* variables the process started with
(/proc/PID/environ), and whether its command line requests speculative decoding
(children inherit the verdict of their parent: vLLM's workers are spawned with a
command line of their own). Exit 1 when SD is requested and a process that runs
OpenMP work (or the vLLM process itself) lacks Intel OpenMP; 0 when all is well;
2 when the process cannot be found or read.
"""

from __future__ import annotations

import json
import os

from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    import psutil

    from vllm_cpu_launch.speculative import SpeculativeRequest

INTEL = "iomp"  # Intel's libiomp5
LLVM = "llvm"  # LLVM's libomp (Debian's libiomp5.so resolves to it): same KMP_* interface
GNU = "gomp"
RUNTIME_TITLES = {INTEL: "Intel OpenMP", LLVM: "LLVM OpenMP", GNU: "GNU libgomp"}
VARIABLES = ("LD_PRELOAD", "KMP_BLOCKTIME", "KMP_AFFINITY", "OMP_NUM_THREADS")

USAGE = """\
usage: vllm-cpu-launch verify [--json] PID

Check a running vLLM (PID, e.g. systemctl show -p MainPID --value UNIT) and all its
descendants: which OpenMP runtime each has loaded, the LD_PRELOAD/KMP_* it started
with, and whether speculative decoding is requested. Exit 0 when every process that
runs OpenMP work has Intel OpenMP (or SD is not requested), 1 when one lacks it,
2 when PID cannot be found or read (run as vLLM's user or as root).
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
    """The variables that matter, from /proc/PID/environ (NUL-separated, as started)."""
    result = {}
    for entry in raw.split(b"\0"):
        key, _, value = entry.partition(b"=")
        text = key.decode("utf-8", "surrogateescape")
        if text in VARIABLES:
            result[text] = value.decode("utf-8", "surrogateescape")
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


def speculative_of(process: psutil.Process) -> SpeculativeRequest:
    import psutil

    from vllm_cpu_launch.speculative import detect

    try:
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        cmdline = []
    try:
        cwd: str | None = process.cwd()
    except psutil.Error:
        cwd = None
    return detect(vllm_arguments(cmdline, cwd))


def judge(
    runtimes: list[tuple[str, str]], environment: dict[str, str], is_root: bool, wanted: bool
) -> tuple[str, str]:
    """(verdict, reason) for one process: ok, problem, or skipped (runs no OpenMP)."""
    kinds = [kind for kind, _ in runtimes]
    preload = environment.get("LD_PRELOAD", "")
    preloaded_iomp = "libiomp" in preload or "libomp" in preload
    described = ", ".join(f"{RUNTIME_TITLES[k]} {p}" for k, p in runtimes)
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
    if INTEL not in kinds and LLVM not in kinds:
        return "problem", f"runs GNU libgomp only ({described})"
    # torch's own libgomp is mapped in every vLLM process; it only matters when Intel
    # OpenMP was loaded after it. That shows in a visible LD_PRELOAD; vLLM's renamed
    # processes (VLLM::Worker...) have their start-up environment overwritten by the
    # process title, so an absent LD_PRELOAD there tells nothing.
    if GNU in kinds and "LD_PRELOAD" in environment and not preloaded_iomp:
        return "problem", f"Intel OpenMP loaded but not preloaded, so libgomp serves ({described})"
    return "ok", described


def inspect(pid: int) -> dict[str, Any]:
    """The verify report for PID and its descendants (see docs/operating.md)."""
    import psutil

    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except (psutil.NoSuchProcess, ValueError, OverflowError):
        raise LaunchError(EXIT_USAGE, f"verify: no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise LaunchError(
            EXIT_USAGE, f"verify: cannot read process {pid}: permission denied"
        ) from None
    root_request = speculative_of(root)
    processes = []
    for process in [root, *descendants]:
        is_root = process.pid == pid
        try:
            maps = read_proc(process.pid, "maps").decode("utf-8", "surrogateescape")
            environment = environment_of(read_proc(process.pid, "environ"))
            cmdline = process.cmdline()
            while cmdline and not cmdline[-1]:  # a process title padded with NULs (VLLM::Worker)
                cmdline.pop()
            ppid = process.ppid()
        except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
            if is_root:
                raise LaunchError(EXIT_USAGE, f"verify: process {pid} exited") from None
            continue  # a child that ended meanwhile
        except psutil.ZombieProcess:
            continue
        except PermissionError:
            raise LaunchError(
                EXIT_USAGE,
                f"verify: cannot read /proc/{process.pid} (maps, environ): permission denied; "
                "run verify as the user vLLM runs as, or as root",
            ) from None
        request = root_request
        if not is_root and not request.requested:
            request = speculative_of(process)
        runtimes = mapped_runtimes(maps)
        verdict, reason = judge(runtimes, environment, is_root, request.requested)
        processes.append(
            {
                "pid": process.pid,
                "ppid": ppid,
                "cmdline": cmdline,
                "runtimes": [{"kind": kind, "path": path} for kind, path in runtimes],
                "env": environment,
                "speculative": request.requested,
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


COMMAND_WIDTH = 100


def shortened(command: str) -> str:
    """A long command cut with a visible marker; --json keeps it whole."""
    if len(command) <= COMMAND_WIDTH:
        return command
    rest = len(command) - COMMAND_WIDTH
    return f"{command[:COMMAND_WIDTH]}... [{rest} more characters; --json shows them all]"


def render_text(report: dict[str, Any]) -> str:
    import shlex

    speculative = report["speculative"]
    lines = [
        "speculative decoding: "
        + (f"requested ({speculative['source']})" if speculative["requested"] else "not requested")
    ]
    for process in report["processes"]:
        command = shortened(shlex.join(process["cmdline"])) or "?"
        lines.append(f"{process['pid']:>7}  {process['verdict']:<8} {command}")
        lines.append(f"{'':>9}{process['reason']}")
        variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in process["env"].items())
        lines.append(f"{'':>9}{variables or 'no LD_PRELOAD, KMP_* or OMP_NUM_THREADS set'}")
    problems = sum(p["verdict"] == "problem" for p in report["processes"])
    total = len(report["processes"])
    if problems:
        lines.append(
            f"PROBLEM: {problems} of {total} processes lack Intel OpenMP while speculative "
            "decoding is requested; start vLLM through vllm-cpu-launch"
        )
    else:
        lines.append(f"ok: {total} processes checked")
    return "\n".join(lines)


def parse_pid(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) == 0:
        raise LaunchError(EXIT_USAGE, f"verify: {text!r} is not a process ID")
    return int(text)


def main(values: dict[str, object], args: list[str]) -> int:
    from vllm_cpu_launch.launch import FLAG_OPTIONS, parse_options, write_stdout

    more, rest = parse_options(args, {}, FLAG_OPTIONS, verb="verify")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    if len(rest) != 1:
        raise LaunchError(EXIT_USAGE, "verify needs one PID: vllm-cpu-launch verify [--json] PID")
    report = inspect(parse_pid(rest[0]))
    if merged.get("json"):
        write_stdout(json.dumps(report, indent=2))
    else:
        write_stdout(render_text(report))
    return 0 if report["ok"] else EXIT_PROBLEM

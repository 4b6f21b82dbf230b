#!/usr/bin/env python3
"""Time short OpenMP parallel regions under libgomp, libiomp5 and LLVM's libomp (issue 37).

Speculative decoding on CPU runs many short parallel regions per token, with a little
single-threaded work between them; GNU libgomp's threads sleep sooner and wake slower than
those of Intel's libiomp5, which spin KMP_BLOCKTIME ms first. This times that mechanism
alone, with no vLLM and no torch, at 2, 4, 8 and 16 threads: scripts/omp_regions.c,
compiled here with `gcc -O2 -fopenmp` (so libgomp is linked), runs as one process per
configuration, each other runtime preloaded with LD_PRELOAD as the launcher does:

  libgomp             gcc's, its default wait policy
  libiomp5 bt0/5/200  the intel-openmp wheel's, KMP_BLOCKTIME=0, 5 and 200
  libomp              LLVM's, its default KMP_BLOCKTIME (200 ms in LLVM 14; shown as read)

Rounds rotate the order; each process says which library served it, and one served by
another than its configuration's is a `problem:` line. Per thread count it prints the
median microseconds per region over the rounds, their spread and libgomp / this (> 1:
faster than libgomp), all measured in this one run.

Needs besides the checkout only gcc and the runtimes' .so files (a few MB): libiomp5 from
the intel-openmp wheel (<this Python's prefix>/lib/libiomp5.so, or --iomp FILE), LLVM's
libomp.so.5 from --libomp FILE (`apt-get download libomp5-14` and `dpkg-deb -x` it, or
`pip install cmeel-libomp`; without it that configuration is left out), libgomp from gcc.
Exit codes: 0 measured; 1 a process did not run as configured ("problem:" lines), or the
run could not start (one `bench_omp_regions: error:` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_stats import interleaved, rerun_line, timed_run
from script_cli import ScriptError, bounded_run, exit_code, narrator

SOURCE = Path(__file__).resolve().parent / "omp_regions.c"
THREAD_COUNTS = (2, 4, 8, 16)
# The estimate printed at the start: a process's start, and a region as slow as a wake-up
# of sleeping threads can make it on a large host (what the regions cost here is measured).
START_S = 0.1
ASSUMED_REGION_US = 100.0
# What steers an OpenMP runtime: none of the caller's reaches a measured process.
STEERING_PREFIXES = ("OMP_", "KMP_", "GOMP_")
say = narrator("bench_omp_regions")


@dataclasses.dataclass(frozen=True)
class Config:
    """One runtime setting: the library preloaded (None: the libgomp gcc linked)."""

    name: str
    label: str
    preload: Path | None = None
    blocktime: str | None = None

    def served_by(self, library: str) -> bool:
        """Whether the library a process reports is this configuration's."""
        if self.preload is None:
            return Path(library).name.startswith("libgomp.so")
        return os.path.realpath(library) == os.path.realpath(self.preload)


def configs(iomp: Path, libomp: Path | None, blocktimes: Sequence[str]) -> list[Config]:
    """libgomp, libiomp5 at each block time, LLVM's libomp at its default (where given)."""
    found = [Config("libgomp", "libgomp (gcc's)")]
    for blocktime in blocktimes:
        label = f"libiomp5, KMP_BLOCKTIME={blocktime}"
        found.append(Config(f"libiomp5 bt{blocktime}", label, iomp, blocktime))
    if libomp is not None:
        found.append(Config("libomp", "LLVM libomp, its default KMP_BLOCKTIME", libomp))
    return found


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def default_threads() -> str:
    """The counts of THREAD_COUNTS this host can run without oversubscription."""
    counts = [n for n in THREAD_COUNTS if n <= usable_cpus()] or [usable_cpus()]
    return ",".join(map(str, counts))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = parser.add_argument
    add("--threads", default=default_threads(), help="OMP_NUM_THREADS values (%(default)s)")
    add("--rounds", type=int, default=5, help="processes per configuration (%(default)s)")
    add("--regions", type=int, default=1000, help="timed regions per repetition (%(default)s)")
    add("--reps", type=int, default=5, help="repetitions per process (%(default)s)")
    add("--warmup", type=int, default=200, help="untimed regions per process (%(default)s)")
    add("--size", type=int, default=32768, help="doubles one region updates (%(default)s)")
    add("--gap-us", type=float, default=20.0, help="serial work between regions, us (20)")
    add("--blocktimes", default="0,5,200", help="libiomp5's KMP_BLOCKTIME values (ms)")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    add("--iomp", type=Path, default=iomp, help="libiomp5 (%(default)s)")
    add("--libomp", type=Path, help="LLVM's libomp.so.5 (left out without it)")
    add("--bind", action="store_true", help="set OMP_PROC_BIND=close OMP_PLACES=cores")
    add("--cc", default="gcc", help="the C compiler (%(default)s)")
    add("--time-budget", type=float, default=420.0, help="refuse a longer estimate (s)")
    add("--json", type=Path, help="keep every process's figures and the tables in FILE")
    args = parser.parse_args(list(argv))
    try:
        args.thread_counts = [int(n) for n in args.threads.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--threads {args.threads}: give comma-separated counts")
    args.blocktime_list = [b.strip() for b in args.blocktimes.split(",") if b.strip()]
    sizes = (args.rounds, args.regions, args.reps, args.size, *args.thread_counts)
    if not args.thread_counts or min(sizes) < 1 or args.warmup < 0 or args.gap_us < 0:
        parser.error("threads, rounds, regions, reps, size: at least 1; warmup, gap: 0 or more")
    return args


def rerun_arguments(args: argparse.Namespace) -> list[str]:
    """The options that repeat this run, every default spelled out."""
    arguments = [
        *("--threads", ",".join(map(str, args.thread_counts)), "--rounds", str(args.rounds)),
        *("--regions", str(args.regions), "--reps", str(args.reps)),
        *("--warmup", str(args.warmup), "--size", str(args.size), "--gap-us", f"{args.gap_us:g}"),
        *("--blocktimes", ",".join(args.blocktime_list), "--iomp", str(args.iomp.absolute())),
    ]
    if args.libomp is not None:
        arguments += ["--libomp", str(args.libomp.absolute())]
    return arguments + ["--bind"] * args.bind


def compile_program(cc: str, directory: Path) -> Path:
    """omp_regions.c built with `CC -O2 -fopenmp`: libgomp in its DT_NEEDED."""
    if shutil.which(cc) is None:
        raise ScriptError(f"no C compiler {cc!r}: install gcc (or pass --cc)")
    binary = directory / "omp_regions"
    command = [cc, "-O2", "-fopenmp", "-o", str(binary), str(SOURCE), "-ldl"]
    built = bounded_run(command, "compiling omp_regions.c", 120, capture_output=True, text=True)
    if built.returncode != 0:
        raise ScriptError(f"{shlex.join(command)} failed: {built.stderr.strip()[-2000:]}")
    return binary


def child_env(config: Config, threads: int, bind: bool) -> dict[str, str]:
    """This environment without the caller's OpenMP settings, then the configuration's.
    KMP_SETTINGS=1 has a KMP runtime print the block time it uses (read back from stderr)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "LD_PRELOAD" and not key.startswith(STEERING_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = str(threads)
    if config.preload is not None:
        env["LD_PRELOAD"] = str(config.preload.absolute())
        env["KMP_SETTINGS"] = "1"
    if config.blocktime is not None:
        env["KMP_BLOCKTIME"] = config.blocktime
    if bind:
        env.update(OMP_PROC_BIND="close", OMP_PLACES="cores")
    return env


def process_seconds(args: argparse.Namespace) -> float:
    """What one process may take, at ASSUMED_REGION_US per region: the estimate's unit."""
    regions = int(args.warmup) + int(args.regions) * int(args.reps)
    return START_S + regions * (ASSUMED_REGION_US + float(args.gap_us)) / 1e6


def run_one(binary: Path, config: Config, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One process of one configuration: its JSON line, wall time and any problem."""
    command = [str(binary), "--size", str(args.size), "--regions", str(args.regions)]
    command += ["--reps", str(args.reps), "--warmup", str(args.warmup)]
    command += ["--gap-us", f"{args.gap_us:g}"]
    limit = max(60.0, 10 * process_seconds(args))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        env = child_env(config, threads, args.bind)
        code, wall = timed_run(command, limit, env, stdout=out, stderr=err)
        out.seek(0), err.seek(0)
        lines, errors = out.read().splitlines(), err.read()
    record: dict[str, Any] = {"config": config.name, "threads": threads, "exit": code}
    record["wall_s"] = round(wall, 4)
    seen = re.search(r"KMP_BLOCKTIME=(\S+)", errors)
    record["blocktime_seen"] = seen.group(1) if seen else None
    try:
        record.update(json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        record["problem"] = f"exit code {code}, no JSON line: {errors.strip()[-300:]!r}"
        return record
    record["problem"] = served_problem(config, threads, record)
    return record


def served_problem(config: Config, threads: int, record: dict[str, Any]) -> str | None:
    """Why a process did not run as configured (None: it did)."""
    wanted = config.preload or "libgomp"
    for key in ("runtime", "omp_runtime"):
        if not config.served_by(record[key]):
            return f"{key} {record[key]}, not {wanted}"
    if record["team"] != threads:
        return f"a team of {record['team']} threads, not {threads}"
    if record["exit"] != 0:
        return f"exit code {record['exit']}"
    return None


def measure(binary: Path, chosen: list[Config], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration `rounds` times at each thread count, the order rotated per round."""
    records = []
    total = len(args.thread_counts) * len(chosen) * args.rounds
    for threads in args.thread_counts:
        for round_index, config in interleaved(chosen, args.rounds):
            record = run_one(binary, config, threads, args)
            record["round"] = round_index
            records.append(record)
            shown = f"{record['median_us']:.2f} us" if "median_us" in record else "failed"
            say(f"[{len(records)}/{total}] {team(threads)}, {config.name}: {shown}")
    return records


def summary_row(config: Config, values: list[float], seen: set[str | None]) -> dict[str, Any]:
    """One configuration's figures over its rounds (None where no process ran as configured)."""
    return {
        "label": config.label,
        "blocktime": config.blocktime,
        "median_us": statistics.median(values) if values else None,
        "min_us": min(values, default=None),
        "max_us": max(values, default=None),
        "rounds": len(values),
        "blocktime_seen": sorted(b for b in seen if b),
    }


def summarize(records: list[dict[str, Any]], chosen: list[Config]) -> dict[int, dict[str, Any]]:
    """Per thread count and configuration: the median, min and max over rounds of each
    process's median us per region, and libgomp's median over this one."""
    summary: dict[int, dict[str, Any]] = {}
    for threads in sorted({r["threads"] for r in records}):
        rows: dict[str, Any] = {}
        for config in chosen:
            mine = [r for r in records if r["threads"] == threads and r["config"] == config.name]
            values = [r["median_us"] for r in mine if not r["problem"]]
            rows[config.name] = summary_row(config, values, {r["blocktime_seen"] for r in mine})
        gomp = rows["libgomp"]["median_us"]
        for row in rows.values():
            row["gomp_ratio"] = gomp / row["median_us"] if gomp and row["median_us"] else None
        summary[threads] = rows
    return summary


def describe_machine() -> dict[str, Any]:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            models = [line.split(":", 1)[1].strip() for line in stream if "model name" in line]
            model = models[0] if models else model
    except OSError:
        pass
    return {
        "cpu": model,
        "usable_cpus": usable_cpus(),
        "cpus": os.cpu_count(),
        "kernel": f"{platform.system()} {platform.release()}",
        "load_average": round(os.getloadavg()[0], 2),
    }


def team(threads: int) -> str:
    return f"{threads} thread{'s' * (threads != 1)}"


def render(summary: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    """A Markdown table per thread count."""
    cpus = usable_cpus()
    lines = []
    for threads, rows in summary.items():
        over = f", oversubscribed: {cpus} usable CPUs" if threads > cpus else ""
        lines += [f"### {team(threads)} (gap {args.gap_us:g} us, size {args.size}{over})", ""]
        lines += ["| runtime | us per region | spread over rounds | libgomp / this |"]
        lines += ["|---|---:|---:|---:|"]
        for row in rows.values():
            label = row["label"]
            if row["blocktime"] is None and row["blocktime_seen"]:
                label += f" ({', '.join(row['blocktime_seen'])}, as it says)"
            if row["median_us"] is None:
                lines += [f"| {label} | not measured: see the problem lines | - | - |"]
                continue
            ratio = "-" if row["gomp_ratio"] is None else f"{row['gomp_ratio']:.2f}"
            spread = f"{row['min_us']:.2f}-{row['max_us']:.2f}"
            lines += [f"| {label} | {row['median_us']:.2f} | {spread} | {ratio} |"]
        lines += [""]
    return "\n".join(lines)


def find_runtimes(args: argparse.Namespace) -> list[Config]:
    """The configurations this run can measure; a missing libiomp5 stops it."""
    if not args.iomp.is_file():
        raise ScriptError(
            f"no libiomp5 at {args.iomp}: `pip install intel-openmp` into this Python's "
            "environment, or pass --iomp FILE"
        )
    if args.libomp is not None and not args.libomp.is_file():
        raise ScriptError(f"--libomp {args.libomp}: no such file")
    if args.libomp is None:
        say("LLVM's libomp left out: pass --libomp FILE (libomp.so.5: see --help)")
    for threads in args.thread_counts:
        if threads > usable_cpus():
            say(f"warning: {threads} threads on {usable_cpus()} usable CPUs: oversubscribed")
    return configs(args.iomp, args.libomp, args.blocktime_list)


def bench(arguments: Sequence[str]) -> int:
    """Compile, measure every configuration, print the tables; 1 where a process failed."""
    args = parse_args(arguments)
    chosen = find_runtimes(args)
    processes = len(args.thread_counts) * len(chosen) * args.rounds
    estimate = processes * process_seconds(args)
    say(
        f"{len(chosen)} configurations x {len(args.thread_counts)} thread counts x "
        f"{args.rounds} rounds = {processes} processes, at most ~{estimate:.0f} s "
        f"(~{process_seconds(args):.2f} s each at {ASSUMED_REGION_US:g} us per region)"
    )
    if estimate > args.time_budget:
        raise ScriptError(
            f"the estimate {estimate:.0f} s is over --time-budget {args.time_budget:g} s: "
            "fewer --rounds, --regions or --threads"
        )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-omp-regions-") as directory:
        records = measure(compile_program(args.cc, Path(directory)), chosen, args)
    summary = summarize(records, chosen)
    machine = describe_machine()
    rerun = rerun_line("bench_omp_regions.py", rerun_arguments(args))
    print(
        f"machine: {machine['cpu']}, {machine['usable_cpus']} usable CPUs of {machine['cpus']}, "
        f"{machine['kernel']}, load average {machine['load_average']}"
    )
    print("runtimes: " + "; ".join(f"{c.name}: {c.preload or 'linked'}" for c in chosen))
    print(f"took {time.perf_counter() - started:.0f} s\n\n{render(summary, args)}")
    problems = [r for r in records if r["problem"]]
    for record in problems:
        print(f"problem: {team(record['threads'])}, {record['config']}: {record['problem']}")
    print(rerun)
    if args.json is not None:
        kept: dict[str, Any] = {"machine": machine, "summary": summary}
        kept["configs"] = [dataclasses.asdict(c) for c in chosen]
        kept.update(processes=records, tables=render(summary, args))
        kept.update(rerun=rerun, problems=[r["problem"] for r in problems])
        args.json.write_text(json.dumps(kept, indent=2, default=str) + "\n", encoding="utf-8")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    outcome: list[int] = []
    arguments = sys.argv[1:] if argv is None else argv
    code = exit_code("bench_omp_regions", lambda: outcome.append(bench(arguments)))
    return code or (outcome[0] if outcome else 1)


if __name__ == "__main__":
    raise SystemExit(main())

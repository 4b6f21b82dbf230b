"""What libiomp5 is worth on this host for speculative-decoding-like work.

vLLM maintainers saw SD on CPU run about 2x slower with GNU libgomp than with libiomp5:
SD runs many short parallel regions, and the runtimes differ in how idle threads wait
between them. `scripts/bench_omp.py` times the same workload (omp_workload.py) under each
runtime here, each in a fresh process of the target's Python (the runtime is fixed at
start), rounds rotated so that drift in host load spreads over all; each child says which
runtime it bound to, so a preload that did not take is a problem, not a figure. (It was
`doctor --measure`: a synthetic loop; `vllm-cpu-launch tune` measures the user's command.)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_cpu_launch.elf import library_of
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.records import record
from vllm_cpu_launch.runtimes import GNU

WORKLOAD = Path(__file__).with_name("omp_workload.py")
DEFAULT_BLOCKTIMES = ("0", "5", "200")
DEFAULT_ROUNDS = 3
DEFAULT_STEPS = 60
DEFAULT_WARMUP = 15
DEFAULT_TIMEOUT = 300.0
GOMP = "gomp"
_NO_TORCH_EXIT = 3  # the child's exit status when torch does not import
# What changes how either runtime waits or how many threads it runs: the comparison is
# between the runtimes' defaults, as vLLM gets them from the launcher.
_DROPPED_PREFIXES = ("OMP_", "KMP_", "GOMP_")
_DROPPED = (LD_PRELOAD, "MKL_NUM_THREADS")


class OmpMeasureError(Exception):
    """The measurement could not run; str() is one line that says why."""


@record
class OmpConfig:
    """No preload (torch's libgomp), or libiomp5 with a KMP_BLOCKTIME."""

    label: str
    preload: str | None
    kmp_blocktime: str | None


@record
class ConfigResult:
    """`round_ms` each round's median ms/step; `speedup` gomp's ms/step over this one's,
    paired within each round (2.0: twice as fast); min/max their spread over the rounds."""

    config: OmpConfig
    median_ms: float
    min_ms: float
    max_ms: float
    speedup: float
    speedup_min: float
    speedup_max: float
    round_ms: tuple[float, ...]
    threads: int
    runtime_path: str
    openmp_libs: tuple[str, ...]
    runtime_ok: bool


@record
class OmpMeasurement:
    """`load_before`: the 1-minute load average before the run (busy cores make spinning
    threads wait); `problems` is empty when every child ran as configured."""

    python: str
    iomp_path: str
    torch_version: str
    threads: int
    rounds: int
    steps: int
    warmup: int
    order: tuple[tuple[str, ...], ...]
    results: tuple[ConfigResult, ...]
    problems: tuple[str, ...]
    seconds: float
    load_before: float


def default_threads() -> int:
    """All logical CPUs this process may run on (its affinity mask, as cgroups/taskset set)."""
    return len(os.sched_getaffinity(0))


def _child_env(config: OmpConfig, threads: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROPPED and not k.startswith(_DROPPED_PREFIXES)
    }
    chosen = {LD_PRELOAD: config.preload, "KMP_BLOCKTIME": config.kmp_blocktime}
    env["OMP_NUM_THREADS"] = str(threads)
    env.update((k, v) for k, v in chosen.items() if v is not None)
    return env


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _run_child(
    python: str, config: OmpConfig, threads: int, steps: int, warmup: int, timeout: float
) -> dict[str, Any]:
    """What the child reported, its steps' median as `median_ms`."""
    cmd = [python, str(WORKLOAD), "--steps", str(steps), "--warmup", str(warmup)]
    env = _child_env(config, threads)
    try:
        proc = subprocess.run(
            cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except OSError as exc:
        raise OmpMeasureError(f"cannot run {python}: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise OmpMeasureError(f"{config.label}: workload took over {timeout:g} s") from exc
    out = _last_line(proc.stdout)
    if proc.returncode == _NO_TORCH_EXIT and '"no-torch"' in out:
        detail = json.loads(out)["detail"]
        raise OmpMeasureError(
            f"{python} cannot import torch ({detail}); use the vLLM environment's Python"
        )
    if proc.returncode != 0:
        status = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise OmpMeasureError(
            f"{config.label}: workload failed ({status}): {_last_line(proc.stderr)}"
        )
    try:
        data = json.loads(out)
        return {
            "median_ms": statistics.median(float(ms) for ms in data["step_ms"]),
            "threads": int(data["threads"]),
            "torch": str(data["torch"]),
            "runtime_path": str(data["runtime_path"]),
            "openmp_libs": tuple(str(p) for p in data["libraries"] if library_of(str(p)).runtime),
        }
    except (ValueError, KeyError, TypeError) as exc:
        raise OmpMeasureError(f"{config.label}: unreadable workload output: {out[:200]}") from exc


def _runtime_ok(config: OmpConfig, runtime_path: str) -> bool:
    """gomp must bind to a libgomp; iomp must bind to the preloaded file itself."""
    if config.preload is None:
        return library_of(runtime_path) is GNU
    return bool(runtime_path) and os.path.realpath(runtime_path) == os.path.realpath(config.preload)


def _result(
    config: OmpConfig, runs: list[dict[str, Any]], gomp_ms: list[float], threads: int
) -> tuple[ConfigResult, list[str]]:
    """One configuration's rounds against libgomp's of the same rounds, and its problems."""
    ms = [run["median_ms"] for run in runs]
    speedups = [g / m for g, m in zip(gomp_ms, ms, strict=True)]
    paths = {run["runtime_path"] for run in runs if not _runtime_ok(config, run["runtime_path"])}
    problems = []
    if wrong := sorted(path or "none" for path in paths):
        want = config.preload or "torch's libgomp"
        problems.append(f"{config.label}: parallel regions ran on {', '.join(wrong)}, not {want}")
    if (counts := sorted({run["threads"] for run in runs})) != [threads]:
        used = ", ".join(map(str, counts))
        problems.append(f"{config.label}: torch used {used} threads, not {threads}")
    first = runs[0]
    result = ConfigResult(
        config=config,
        median_ms=statistics.median(ms),
        min_ms=min(ms),
        max_ms=max(ms),
        speedup=statistics.median(speedups),
        speedup_min=min(speedups),
        speedup_max=max(speedups),
        round_ms=tuple(ms),
        threads=first["threads"],
        runtime_path=first["runtime_path"],
        openmp_libs=first["openmp_libs"],
        runtime_ok=not wrong,
    )
    return result, problems


def measure_openmp(
    python: str,
    iomp_path: str,
    *,
    blocktimes: Sequence[str] = DEFAULT_BLOCKTIMES,
    rounds: int = DEFAULT_ROUNDS,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    threads: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Callable[[str], None] | None = None,
) -> OmpMeasurement:
    """libgomp against `iomp_path` per KMP_BLOCKTIME, with the torch of `python` (vLLM's
    environment), on all logical CPUs unless `threads`: 1 + len(blocktimes) processes a
    round, one after another, a `progress` line each. OmpMeasureError (one line) when the
    workload cannot run; ValueError for impossible arguments."""
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError("rounds and steps must be at least 1, warmup at least 0")
    if len(set(blocktimes)) != len(blocktimes):
        raise ValueError(f"duplicate KMP_BLOCKTIME values: {list(blocktimes)}")
    if not os.path.isfile(iomp_path):
        raise OmpMeasureError(f"no libiomp5 at {iomp_path}")
    nthreads = default_threads() if threads is None else threads
    iomp = (OmpConfig(f"iomp KMP_BLOCKTIME={b}", iomp_path, b) for b in blocktimes)
    configs = (OmpConfig(GOMP, None, None), *iomp)
    plan = [[(r + i) % len(configs) for i in range(len(configs))] for r in range(rounds)]
    runs: list[list[dict[str, Any]]] = [[] for _ in configs]  # per configuration, round order
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    for r, indices in enumerate(plan):
        for i in indices:
            config = configs[i]
            run = _run_child(python, config, nthreads, steps, warmup, timeout)
            runs[i].append(run)
            if progress is not None:
                progress(f"round {r + 1}/{rounds}: {config.label}: {run['median_ms']:.3f} ms/step")
    seconds = time.monotonic() - start
    gomp_ms = [run["median_ms"] for run in runs[0]]
    summaries = [
        _result(config, config_runs, gomp_ms, nthreads)
        for config, config_runs in zip(configs, runs, strict=True)
    ]
    return OmpMeasurement(
        python=python,
        iomp_path=iomp_path,
        torch_version=runs[0][0]["torch"],
        threads=nthreads,
        rounds=rounds,
        steps=steps,
        warmup=warmup,
        order=tuple(tuple(configs[i].label for i in indices) for indices in plan),
        results=tuple(result for result, _ in summaries),
        problems=tuple(problem for _, found in summaries for problem in found),
        seconds=seconds,
        load_before=load_before,
    )


def to_json(measurement: OmpMeasurement) -> dict[str, Any]:
    """A JSON-ready dict, for `bench_omp.py --json`."""
    results = [{**vars(result), "config": vars(result.config)} for result in measurement.results]
    return {**vars(measurement), "results": results}


def render_table(measurement: OmpMeasurement) -> str:
    """A human-readable table with the run's context and any problems."""
    m = measurement
    header = ("config", "ms/step", "spread", "vs gomp", "speedup spread", "threads", "runtime")
    rows = [
        (
            r.config.label,
            f"{r.median_ms:.3f}",
            f"{r.min_ms:.3f}-{r.max_ms:.3f}",
            f"{r.speedup:.2f}x",
            f"{r.speedup_min:.2f}-{r.speedup_max:.2f}",
            str(r.threads),
            (os.path.basename(r.runtime_path) or "none") + ("" if r.runtime_ok else " MISMATCH"),
        )
        for r in m.results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        f"OpenMP short-region benchmark: {m.rounds} rounds x {m.steps} steps "
        f"(after {m.warmup} warm-up), {m.threads} threads, torch {m.torch_version}",
        f"python {m.python}",
        f"libiomp5 {m.iomp_path}",
        "",
        *(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)
        ),
        "",
        "ms/step: median over rounds of each round's median step; spread: lowest-highest round.",
        "vs gomp: libgomp's time / this one's, paired within each round (>1 = faster).",
        f"{m.seconds:.0f} s; host load average before the run: {m.load_before:.2f} on "
        f"{os.cpu_count()} CPUs (other work skews the figures, libgomp's most).",
    ]
    lines.extend(f"problem: {p}" for p in m.problems)
    return "\n".join(lines)

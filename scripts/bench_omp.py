#!/usr/bin/env python3
"""Time speculative-decoding-like work under libgomp and libiomp5 on this host.

A synthetic SD-like loop (omp_measure.py; it was `vllm-cpu-launch doctor --measure`), with
rounds enough that the spread says how far the ratio can be trusted; `vllm-cpu-launch tune`
measures a user's own command instead. Needs a Python with torch (the vLLM environment's).
Exit codes: 0 measured, 1 measured but a child did not run as configured (see
"problem:" lines), 2 the measurement could not run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

# Run from a checkout: import the package from the repository, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omp_measure import (
    DEFAULT_BLOCKTIMES,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    OmpMeasureError,
    default_threads,
    measure_openmp,
    render_table,
    to_json,
)
from vllm_env import default_env_path


def default_python() -> str:
    cached = default_env_path() / "bin" / "python"
    return str(cached) if cached.exists() else sys.executable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        default=default_python(),
        help="interpreter of the environment with torch (default: the cached vLLM "
        "environment's, else this one)",
    )
    parser.add_argument(
        "--iomp", help="libiomp5 to preload (default: <environment of --python>/lib/libiomp5.so)"
    )
    parser.add_argument("--rounds", type=int, default=8, help="default: %(default)s")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps per process")
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help="untimed steps per process"
    )
    parser.add_argument(
        "--threads", type=int, default=default_threads(), help="OMP_NUM_THREADS (all CPUs)"
    )
    parser.add_argument(
        "--blocktimes",
        default=",".join(DEFAULT_BLOCKTIMES),
        help="comma-separated KMP_BLOCKTIME values to time libiomp5 with",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.iomp is None:
        # The environment's prefix, not the resolved interpreter: a venv's bin/python
        # links to the base interpreter, but intel-openmp installs into the venv.
        args.iomp = str(Path(args.python).absolute().parent.parent / "lib" / "libiomp5.so")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    blocktimes = [b.strip() for b in args.blocktimes.split(",") if b.strip()]
    rerun = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--python",
        args.python,
        "--iomp",
        args.iomp,
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--blocktimes",
        ",".join(blocktimes),
    ]
    try:
        measurement = measure_openmp(
            args.python,
            args.iomp,
            blocktimes=blocktimes,
            rounds=args.rounds,
            steps=args.steps,
            warmup=args.warmup,
            threads=args.threads,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (OmpMeasureError, ValueError) as exc:
        print(f"bench_omp: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**to_json(measurement), "rerun": rerun}, indent=2))
    else:
        print(render_table(measurement))
        print(f"rerun: {shlex.join(rerun)}")
    return 1 if measurement.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

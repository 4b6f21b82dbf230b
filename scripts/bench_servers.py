#!/usr/bin/env python3
"""Several servers on one host (issue 46, item 5): `servers 2` against one server, measured.

Each round starts, in rotated order, one server on every CPU (the launcher's plan, as
`vllm-cpu-launch serve` gives it) and the servers `vllm-cpu-launch servers N --format json`
plans (each started through the launcher with its own variables, under `taskset -c` of its
CPUs, as its systemd drop-in's CPUAffinity= confines it), all of the real model with ngram
SD, and drives them with C streaming clients at each `--concurrency`, spread evenly over
the servers: total output tokens per second, and vLLM's own mean TPOT (the servers' mean).
Paired by round: `servers`' tokens/s over one server's, one server's TPOT over theirs
(> 1: the servers do better), `gain`/`loss` where 4 or more rounds agree.

    python scripts/bench_servers.py --real-model DIR --vllm-env DIR --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench_stats import REPO, interleaved
from bench_vllm_records import REAL_SERVE_OPTIONS, Phase
from bench_vllm_report import SIGN_TEST_ROUNDS
from bench_vllm_run import Asks, load_prompts, run_phase
from script_cli import ScriptError, exit_code, narrator
from vllm_server import (
    SPECULATIVE_CONFIG,
    Server,
    isolated_environment,
    start_server,
    stop_session,
    wait_until_healthy,
)

say = narrator("bench_servers")
LAUNCHER = [sys.executable, "-m", "vllm_cpu_launch"]
STARTUP_LIMIT_S = 600
POLL_S = 0.5
LAYOUTS = ("one", "servers")


def launcher_environment(scratch: Path, cache: Path) -> dict[str, str]:
    """The caller's environment less OpenMP and launcher settings, this checkout's launcher
    importable, the shared compile cache."""
    env = isolated_environment(
        scratch, ("LD_PRELOAD",), ("KMP_", "OMP_", "VLLM_CPU_", "VLLMCPULAUNCH_"), cache
    )
    return {**env, "PYTHONPATH": str(REPO)}


def planned_servers(args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """`servers N --format json`'s servers for the measured command."""
    command = [
        *LAUNCHER,
        "--vllm",
        str(args.vllm_env / "bin" / "vllm"),
        "servers",
        str(args.servers),
        "--format",
        "json",
        "serve",
        str(args.real_model),
        "--speculative-config",
        SPECULATIVE_CONFIG,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ScriptError(f"servers {args.servers}: {done.stderr.strip()}")
    servers: list[dict[str, Any]] = json.loads(done.stdout)["servers"]
    return servers


@contextmanager
def started(
    layout: str, args: argparse.Namespace, scratch: Path, env: dict[str, str]
) -> Iterator[list[Server]]:
    """The layout's servers, healthy; stopped on the way out. One server: the launcher on a
    host it is told is vLLM's own (a dedicated host; no watch). `servers`: each server
    through the launcher with its own variables, confined to its CPUs."""
    launcher = [*LAUNCHER, "--vllm", str(args.vllm_env / "bin" / "vllm")]
    if layout == "one":
        starts: list[tuple[list[str], dict[str, str]]] = [([*launcher, "--host-cpus", "own"], {})]
    else:
        starts = [
            (
                ["taskset", "-c", planned["env"]["VLLMCPULAUNCH_SERVER_CPUS"], *launcher],
                planned["env"],
            )
            for planned in planned_servers(args, env)
        ]
    with ExitStack() as stack:
        servers: list[Server] = []
        for index, (prefix, variables) in enumerate(starts):
            where = scratch / f"{layout}-{index}"
            where.mkdir(parents=True)
            server = start_server(
                prefix,
                args.real_model,
                where,
                {**env, **variables},
                extra=REAL_SERVE_OPTIONS,
                speculative_config=SPECULATIVE_CONFIG,
            )
            stack.callback(stop_session, server, POLL_S)
            servers.append(server)
        for server in servers:
            wait_until_healthy(server, STARTUP_LIMIT_S, POLL_S)
        yield servers


def phase_of(servers: Sequence[Server], streams: int, args: argparse.Namespace) -> dict[str, float]:
    """`streams` clients spread evenly over the servers for one phase: total tokens/s and
    the servers' mean TPOT."""
    asks = Asks(args.prompt_set, chat=True)
    shares = [streams // len(servers) + (i < streams % len(servers)) for i in range(len(servers))]
    phases: list[Phase] = [Phase(0)] * len(servers)
    errors: list[str] = []

    def drive(index: int) -> None:
        try:
            phases[index] = run_phase(
                servers[index], shares[index], args.phase_seconds, args.max_tokens, asks
            )
        except ScriptError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(servers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise ScriptError(errors[0])
    return {
        "tokens_per_s": sum(phase.tokens_per_s for phase in phases),
        "tpot_ms": statistics.mean(phase.tpot_ms for phase in phases),
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-servers-") as temporary:
        scratch = Path(temporary)
        env = launcher_environment(scratch, args.compile_cache.absolute())
        for number, (round_index, layout) in enumerate(interleaved(LAYOUTS, args.rounds), 1):
            say(f"start {number}/{len(LAYOUTS) * args.rounds}, round {round_index + 1}: {layout}")
            began = time.monotonic()
            with started(layout, args, scratch / f"r{number}", env) as servers:
                startup = time.monotonic() - began
                for server in servers:  # warm-up: two requests each, unmeasured
                    for request in range(2):
                        Asks(args.prompt_set, chat=True).send(server.url, args.max_tokens, request)
                phases = {str(c): phase_of(servers, c, args) for c in args.concurrency_levels}
            runs.append(
                {"layout": layout, "round": round_index, "startup_s": startup, "phases": phases}
            )
            say(
                f"  {layout}: "
                + ", ".join(
                    f"C={c} {p['tokens_per_s']:.1f} tok/s, TPOT {p['tpot_ms']:.2f} ms"
                    for c, p in phases.items()
                )
            )
    return runs


def ratio_cell(values: list[float]) -> str:
    verdict = "="
    if len(values) >= SIGN_TEST_ROUNDS:
        verdict = "gain" if min(values) > 1 else "loss" if max(values) < 1 else "="
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) {verdict}"


def report(runs: list[dict[str, Any]], levels: Sequence[int], servers: int) -> str:
    by = {(r["layout"], r["round"]): r["phases"] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    lines = [
        f"| clients | one server tok/s | {servers} servers tok/s | tok/s {servers}/one | "
        f"one server TPOT ms | {servers} servers TPOT ms | TPOT one/{servers} |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        one = [by[("one", r)][str(c)] for r in rounds]
        many = [by[("servers", r)][str(c)] for r in rounds]
        throughput = [m["tokens_per_s"] / o["tokens_per_s"] for o, m in zip(one, many, strict=True)]
        latency = [o["tpot_ms"] / m["tpot_ms"] for o, m in zip(one, many, strict=True)]
        cells = [
            statistics.median(o["tokens_per_s"] for o in one),
            statistics.median(m["tokens_per_s"] for m in many),
        ]
        tpots = [
            statistics.median(o["tpot_ms"] for o in one),
            statistics.median(m["tpot_ms"] for m in many),
        ]
        lines.append(
            f"| {c} | {cells[0]:.1f} | {cells[1]:.1f} | {ratio_cell(throughput)} | "
            f"{tpots[0]:.2f} | {tpots[1]:.2f} | {ratio_cell(latency)} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--real-model", type=Path, help="the model scripts/real_model.py makes")
    parser.add_argument("--vllm-env", type=Path, help="vLLM's environment")
    parser.add_argument("--servers", type=int, default=2, help="servers N (default 2)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", default="4,8", help="clients, spread (default 4,8)")
    parser.add_argument("--phase-seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts", type=Path, default=REPO / "vllm_cpu_launch" / "serving_prompts.jsonl"
    )
    parser.add_argument("--compile-cache", type=Path, help="VLLM_CACHE_ROOT, shared by starts")
    parser.add_argument("--json", type=Path, help="keep every measurement in this file")
    parser.add_argument("--from-json", type=Path, help="report a kept run; no vLLM")
    args = parser.parse_args(argv)
    needed = (args.real_model, args.vllm_env, args.compile_cache)
    if args.from_json is None and None in needed:
        parser.error("measuring needs --real-model, --vllm-env and --compile-cache")
    args.concurrency_levels = sorted({int(c) for c in args.concurrency.split(",")})
    args.prompt_set = (
        None if args.from_json else load_prompts(args.prompts)
    )  # a kept run asks nothing
    return args


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(arguments)

    def run() -> None:
        if args.from_json is not None:
            kept = json.loads(args.from_json.read_text(encoding="utf-8"))
        else:
            command = " ".join(["python", "scripts/bench_servers.py", *arguments])
            kept = {"meta": {"command": command, **vars_of(args)}, "runs": measure(args)}
            if args.json is not None:
                args.json.write_text(json.dumps(kept, indent=1) + "\n", encoding="utf-8")
        meta = kept["meta"]
        print(report(kept["runs"], meta["concurrency"], meta["servers"]))
        print(f"rerun: cd {REPO} && {meta['command']}")

    return exit_code("bench_servers", run, "interrupted; servers stopped")


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "servers": args.servers,
        "rounds": args.rounds,
        "concurrency": args.concurrency_levels,
        "phase_seconds": args.phase_seconds,
        "max_tokens": args.max_tokens,
        "started": time.strftime("%Y-%m-%d %H:%M"),
    }


if __name__ == "__main__":
    raise SystemExit(main())

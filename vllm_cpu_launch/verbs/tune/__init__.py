"""`vllm-cpu-launch tune`: measure OpenMP configurations with vLLM's own `vllm bench latency`.

The one verb that runs children. Each candidate is a launcher plan, built by the code path
`--dry-run` prints (`plan_from_options`), for `vllm bench latency --model MODEL ARGS...`
translated from the user's `serve MODEL ARGS...`; its command runs with its environment,
in rounds, the candidate order rotated every round. The rounds won and the medians of the
runs' median latencies decide (verdict.decide); `--write` stores the result in the user's
launcher config, where it is a config value like any other (option > variable > config).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import tempfile
import time
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError
from vllm_cpu_launch.messages import emit
from vllm_cpu_launch.speculative import model_of
from vllm_cpu_launch.verbs.tune.checks import check_vocabulary, check_writable
from vllm_cpu_launch.verbs.tune.command import BENCH_OPTIONS, bench_arguments
from vllm_cpu_launch.verbs.tune.config import tune_updates, write_config
from vllm_cpu_launch.verbs.tune.runner import run_once
from vllm_cpu_launch.verbs.tune.verdict import (
    CANDIDATES,
    Candidate,
    Summary,
    Verdict,
    besides_runtime,
    decide,
    rotated,
    table,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from vllm_cpu_launch.plan import Plan

USAGE = """\
usage: vllm-cpu-launch tune [--write] [TUNE OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]

Measure, on this host, the command you serve with vLLM's own benchmark: `serve MODEL ARGS`
runs as `vllm bench latency --model MODEL ARGS` (the real engine, with your speculative
decoding and other engine options) under each candidate, in rounds, the order rotated
every round. Candidates: libgomp (--iomp never) and libiomp5 (--iomp always, with the
KMP_BLOCKTIME the launcher plans; LLVM's libomp where that is the runtime found).
KMP_BLOCKTIME is not varied: vLLM's workers set their own (5) when they see libiomp5,
unless VLLM_CPU_OMP_THREADS_BIND=nobind.
Serve-only options of vLLM 0.32 (--host, --port, --api-key, --uvicorn-log-level, ...) are
not passed to the benchmark, and are listed; a --config file is passed as it is.
A progress line per run goes to stderr; the table to stdout: per candidate the median of
the runs' median latencies, their quartiles and range, and speed relative to libgomp.

Rule: each round runs both candidates back to back, so a round is a pair. A candidate
wins when it ran faster in every round, with 3 rounds or more; with 2 rounds, its median
must also beat the other's by more than the larger of the two ranges (max - min of the
runs' medians). The result line says the rounds won, the medians and the spreads either
way; otherwise it is "no clear winner, default kept" (the default is
what --iomp auto plans for this command: libiomp5 when it requests SD on x86-64, and
on a host the benchmark map measured, what measured fastest there). Each candidate's
libiomp5 is tuned as the map says for this host (binding, KMP_BLOCKTIME), as auto's is.

  --write                store the result in your launcher config (--launcher-config FILE,
                         else $XDG_CONFIG_HOME/vllm-cpu-launch/config.yaml) as a `tuned:`
                         record (when, result, rounds, command) scoped to what it measured:
                         the model, the SD method and token count, the vLLM release and
                         the usable CPUs. A later launch of that command on such a host
                         applies it (its INFO line and --dry-run say so; --iomp and
                         VLLMCPULAUNCH_IOMP still win); any other does not, and -v and
                         --dry-run say why. A later tune of the same scope replaces it;
                         records of other scopes, other keys and comments are kept
  --rounds N             rounds of every candidate (default 3)
  --time-limit SECONDS   bound on the whole tune (default 1800): no run starts after it,
                         a run still going then is killed, and the rounds done are used
  --batch-size N  --input-len N  --output-len N  --num-iters N  --num-iters-warmup N
                         passed to vllm bench latency (defaults 1, 64, 128, 5, 1; the
                         warm-up may be 0); its prompts are random token ids below
                         10000, so a model whose config.json has a smaller vocab_size
                         is refused before anything runs
Launcher options (--vllm, --iomp-path, --tcmalloc, --kmp-blocktime, --strict, -q, -v,
--launcher-config) apply to every candidate; --iomp is what tune varies.
Exit codes: 0 measured (whatever won), 1 the time limit ended it before every candidate
ran once, or a run exited 0 without writing its result (one line names the file and the
log), 2 usage or config error, 3 libiomp5 not found, 126/127 vLLM not startable; a
benchmark run that fails ends the tune with vLLM's exit code (its log is kept).
"""

TUNE_VALUED = {
    "--rounds": "rounds",
    "--time-limit": "time_limit",
    **{option: key for option, (key, _) in BENCH_OPTIONS.items()},
}
# vLLM runs no warm-up iteration at 0 (range(args.num_iters_warmup), latency.py 0.32).
BENCH_LEAST = {"num_iters_warmup": 0}
DEFAULT_ROUNDS = 3
DEFAULT_TIME_LIMIT_S = 1800.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

# ---------------------------------------------------------------- the verb


def positive(value: object, option: str, whole: bool, least: float = 1) -> float:
    """A number of at least `least` (whole) or above 0 (seconds), else a usage error."""
    try:
        number = int(str(value)) if whole else float(str(value))
    except ValueError:
        number = -1
    if not (number >= least if whole else number > 0) or number == float("inf"):
        kind = "a positive number of seconds"
        if whole:
            kind = "a whole number, 0 or more" if least == 0 else "a positive whole number"
        raise LaunchError(EXIT_USAGE, f"{option} {value!r}: needs {kind}")
    return number


def candidate_plans(
    values: dict[str, object], arguments: Sequence[str]
) -> tuple[dict[Candidate, Plan], Plan]:
    """Each candidate's plan (the --dry-run code path), and what --iomp auto plans."""
    from vllm_cpu_launch.errors import EXIT_LIBRARY_MISSING
    from vllm_cpu_launch.launch import plan_from_options

    plans = {c: plan_from_options({**values, "iomp": c.iomp}, arguments) for c in CANDIDATES}
    by_name = {c.name: c for c in CANDIDATES}
    iomp_plan = plans[by_name["libiomp5"]]
    if not any(p.kind == "iomp" for p in iomp_plan.preload):
        for warning in iomp_plan.warnings:
            emit("warning", warning)
        raise LaunchError(
            EXIT_LIBRARY_MISSING, "libiomp5 cannot be preloaded here: nothing to compare"
        )
    gomp_preload = dict(plans[by_name["libgomp"]].env).get(
        "LD_PRELOAD", os.environ.get("LD_PRELOAD", "")
    )
    if "libiomp" in gomp_preload or "libomp" in gomp_preload:
        raise LaunchError(
            EXIT_USAGE,
            f"your LD_PRELOAD ({gomp_preload}) already holds an Intel/LLVM OpenMP, so the "
            "libgomp candidate cannot run without it; unset LD_PRELOAD to tune",
        )
    return plans, plan_from_options({**values, "iomp": "auto"}, arguments)


def parse(values: dict[str, object], args: list[str]) -> tuple[dict[str, object], list[str]]:
    from vllm_cpu_launch.launch import FLAG_OPTIONS, VALUED_OPTIONS, parse_options

    valued = {**VALUED_OPTIONS, **TUNE_VALUED}
    more, rest = parse_options(args, valued, {**FLAG_OPTIONS, "--write": "write"}, verb="tune")
    return {**values, **more}, rest


def main(values: dict[str, object], args: list[str]) -> int:
    from vllm_cpu_launch.launch import write_stdout
    from vllm_cpu_launch.settings import CONFIG_VARIABLE, user_config_path

    merged, serve = parse(values, args)
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    for key, option in (("iomp", "--iomp"), ("dry_run", "--dry-run"), ("json", "--json")):
        if key in merged:
            raise LaunchError(EXIT_USAGE, f"tune does not take {option}: it measures --iomp itself")
    rounds = int(positive(merged.get("rounds", DEFAULT_ROUNDS), "--rounds", whole=True))
    limit_s = positive(merged.get("time_limit", DEFAULT_TIME_LIMIT_S), "--time-limit", whole=False)
    bench = {
        key: int(positive(merged.get(key, default), option, True, BENCH_LEAST.get(key, 1)))
        for option, (key, default) in BENCH_OPTIONS.items()
    }
    explicit = merged.get("config") or os.environ.get(CONFIG_VARIABLE)
    config_path = str(explicit) if explicit else user_config_path(os.environ)
    if merged.get("write") and config_path is None:
        raise LaunchError(
            EXIT_USAGE, "--write: no config file: set HOME or give --launcher-config FILE"
        )
    if explicit and not os.path.exists(str(explicit)):
        merged["config"] = os.devnull  # --write makes it; until then it holds nothing
    bench_arguments(serve, bench, "")  # usage errors before anything is made
    check_vocabulary(model_of(serve))
    if merged.get("write") and config_path:
        check_writable(config_path)
    workdir = tempfile.mkdtemp(prefix="vllm-cpu-launch-tune-")
    # SIGTERM/SIGHUP (systemd, a closed terminal) unwind like Ctrl-C: the run in progress
    # is killed with its whole session on the way out, as on every other exit.
    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        code = measure(merged, serve, bench, rounds, limit_s, config_path, workdir)
    except LaunchError as error:
        if error.subject != workdir:  # a failed run keeps its logs; nothing else does
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    shutil.rmtree(workdir, ignore_errors=True)
    return code


def stop(number: int, _frame: object) -> None:
    raise SystemExit(128 + number)


def report(
    runs: Mapping[Candidate, list[float]],
    default: Candidate,
    plans: Mapping[Candidate, Plan],
    shown: str,
) -> tuple[Verdict, list[str]]:
    """The verdict, and what tune prints of it: the command, the table, what the
    candidates differ in, and the result."""
    summaries = [Summary(c, tuple(runs[c])) for c in CANDIDATES]
    verdict = decide(summaries, default)
    envs = {c.name: dict(plans[c].env) for c in CANDIDATES}
    lines = [
        f"measured: {shown}",
        f"default:  {default.name} (what --iomp auto plans for this command)",
        table(summaries),
        besides_runtime(envs, os.environ.get("LD_PRELOAD", "")),
    ]
    if verdict.winner is None:
        lines.append(f"result: {verdict.result}: keeping the default ({default.name})")
    elif verdict.winner == default:
        lines.append(f"result: {verdict.result}: the default ({default.name}) is best")
    else:
        lines.append(f"result: {verdict.result}: best is --iomp {verdict.winner.iomp}")
    return verdict, lines


def run_rounds(
    plans: Mapping[Candidate, Plan],
    rounds: int,
    limit_s: float,
    workdir: str,
    iterations: int,
    say: Callable[[str], None],
) -> dict[Candidate, list[float]]:
    """Each candidate's run latencies, round by round in rotated order, within the limit."""
    runs: dict[Candidate, list[float]] = {c: [] for c in CANDIDATES}
    order = list(rotated(CANDIDATES, rounds))
    deadline = time.monotonic() + limit_s
    stopped = ""
    for number, (round_index, candidate) in enumerate(order, 1):
        left = deadline - time.monotonic()
        if left <= 0:
            stopped = f"time limit of {limit_s:g} s reached before run {number}/{len(order)}"
            break
        log_path = os.path.join(workdir, f"{number:02d}-{candidate.name}.log")
        output_json = os.path.join(workdir, "latency.json")
        started = time.monotonic()
        latency = run_once(plans[candidate], log_path, output_json, left)
        took = time.monotonic() - started
        if latency is None:
            stopped = (
                f"time limit of {limit_s:g} s reached during run {number}/{len(order)} (killed)"
            )
            break
        runs[candidate].append(latency)
        say(
            f"run {number}/{len(order)} (round {round_index + 1}/{rounds}) {candidate.name}: "
            f"median latency {latency:.4f} s over {iterations} iterations ({took:.0f} s)"
        )
    if stopped:
        emit("warning", f"{stopped}; using the runs done")
    if not all(runs.values()):
        raise LaunchError(EXIT_PROBLEM, f"{stopped}: not every candidate ran once; nothing decided")
    return runs


def measure(
    merged: dict[str, object],
    serve: Sequence[str],
    bench: Mapping[str, int],
    rounds: int,
    limit_s: float,
    config_path: str | None,
    workdir: str,
) -> int:
    """Plan, run the rounds, print the table, write the config with --write."""
    from vllm_cpu_launch.launch import write_stdout

    arguments, dropped = bench_arguments(serve, bench, os.path.join(workdir, "latency.json"))
    plans, auto = candidate_plans(merged, arguments)
    by_name = {c.name: c for c in CANDIDATES}
    default = by_name["libiomp5" if any(p.kind == "iomp" for p in auto.preload) else "libgomp"]
    quiet = bool(merged.get("quiet"))
    shown = shlex.join(["vllm", *arguments[: arguments.index("--output-json")]])

    def say(text: str) -> None:
        if not quiet:
            emit("info", text)

    if dropped:
        say(f"not passed to vllm bench latency (serve-only options): {shlex.join(dropped)}")
    for candidate, plan in plans.items():
        for warning in plan.warnings:
            emit("warning", f"{candidate.name}: {warning}")
        env = shlex.join(f"{k}={v}" for k, v in plan.env) if plan.env else "unchanged"
        say(f"{candidate.name}: {plan.reason}; environment: {env}")
    say(f"measuring {len(plans)} candidates x {rounds} rounds: {shown} (logs in {workdir})")

    runs = run_rounds(plans, rounds, limit_s, workdir, bench["num_iters"], say)

    verdict, lines = report(runs, default, plans, shown)
    done = min(len(r) for r in runs.values())
    if merged.get("write") and config_path:
        from datetime import datetime, timezone

        from vllm_cpu_launch.settings import Scope
        from vllm_cpu_launch.tunes import describe

        when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        scope = auto.scope or Scope()  # build_plan always gives one
        updates, removed = tune_updates(config_path, verdict, when, done, shown, scope)
        write_config(config_path, updates, removed)
        lines.append(
            f"wrote: the tune record (iomp: {verdict.iomp}, for {describe(scope)}) to "
            f"{config_path}; other commands and hosts keep what they had"
        )
    else:
        lines.append("not written (use --write to store it in your launcher config)")
    write_stdout("\n".join(lines))
    return 0

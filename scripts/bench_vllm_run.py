"""Starting and measuring one vLLM server of the map: its environment, its load, its CPU.

scripts/bench_vllm.py's measuring job. Each start runs plain `vllm serve` or this checkout's
launcher in front of it, in a session of its own; after its warm-up requests it is driven
by streaming clients at each concurrency level, and vLLM's own TPOT metric, the tokens,
the CPU per process and the libraries its worker mapped are read. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_stats import REPO
from bench_vllm_records import (
    IDLE_WINDOW_S,
    METHODS,
    REAL,
    REAL_PROMPT,
    REAL_SERVE_OPTIONS,
    ROLES,
    SETTINGS,
    TPOT_METRIC,
    WARMUP_REQUESTS,
    Config,
    Phase,
    Run,
)
from script_cli import ScriptError
from vllm_server import (
    ACCEPTED_TOKENS_METRIC,
    DRAFT_TOKENS_METRIC,
    DRAFTS_METRIC,
    LOOPBACK,
    PROMPT,
    REQUEST_LIMIT_S,
    SD_WARNING,
    Server,
    ServerError,
    command_line,
    completion_payload,
    isolated_environment,
    json_request,
    mapped_files,
    metric_total,
    metric_totals,
    process_tree,
    start_server,
    stop_session,
    wait_until_healthy,
)

from vllm_cpu_launch.elf import openmp_runtime

STARTUP_LIMIT_S = 420
# A start that fills a compile cache compiles the target and its draft: on 2 CPUs that other
# work shares it took over 7 minutes (the real model with itself as draft, load 10-30).
COMPILING_LIMIT_S = 1500
POLL_INTERVAL_S = 0.5
# What Run.sd_counts keeps, from /metrics: steps that verified a draft, tokens drafted,
# tokens accepted.
SD_COUNTERS = {
    "drafts": DRAFTS_METRIC,
    "draft_tokens": DRAFT_TOKENS_METRIC,
    "accepted_tokens": ACCEPTED_TOKENS_METRIC,
}


# ---------------------------------------------------------------- servers


def tail(server: Server, lines: int = 5) -> str:
    """The end of the server's log on one line, for error messages."""
    return " | ".join(server.log_text().strip().splitlines()[-lines:])


def server_environment(config: Config, scratch: Path, cache: Path) -> dict[str, str]:
    """The caller's environment minus OpenMP/launcher/vLLM-CPU settings, plus the config's."""
    dropped = ("LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
    prefixes = ("KMP_", "OMP_", "GOMP_", "VLLM_CPU_", "VLLMCPULAUNCH_")
    env = {**isolated_environment(scratch, dropped, prefixes), "VLLM_CACHE_ROOT": str(cache)}
    if config.threads == "all":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    # Explicit either way: the launcher's own map rules (evidence.py) leave both as given.
    setting = SETTINGS[config.setting]
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind" if setting.nobind else "auto"
    return {**env, **dict(setting.variables)}


def cache_key(config: Config) -> str:
    """The key in `paths` of the VLLM_CACHE_ROOT that every start of config's model and
    method shares (filled by one unmeasured start: the draft's compiled code is in it too)."""
    return f"{config.model}-{config.method}-cache"


def launch(
    config: Config, paths: dict[str, Path], scratch: Path, args: argparse.Namespace
) -> Server:
    """The server of one configuration, in scratch (its cwd; its config directory there)."""
    env, model, cache = paths["env"], paths[config.model], paths[cache_key(config)]
    method = METHODS[config.method]
    draft_key = method.draft_key(config.model)
    draft = str(paths[draft_key]) if draft_key is not None else ""
    vllm = str(env / "bin" / "vllm")
    setting = SETTINGS[config.setting]
    if setting.plain:
        prefix = [vllm]
    else:
        # This checkout's launcher, whatever the interpreter: it execs vLLM in place.
        code = (
            f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            "from vllm_cpu_launch.cli import main; sys.exit(main())"
        )
        options = setting.launcher_options(args.tcmalloc_path, args.libomp_path)
        prefix = [sys.executable, "-c", code, *options, "--vllm", vllm]
    scratch.mkdir(parents=True)
    environment = server_environment(config, scratch, cache)
    speculative = method.speculative_config(draft)
    extra = REAL_SERVE_OPTIONS if config.model == REAL else ()
    return start_server(
        [*args.shape_prefix, *prefix],
        model,
        scratch,
        environment,
        cwd=scratch,
        extra=extra,
        speculative_config=speculative,
    )


def runtime_flavor(path: str) -> str | None:
    """`intel` or `llvm` for a mapped Intel-interface OpenMP runtime (the launcher's ELF
    check): LLVM's libomp may be mapped under a libiomp5.so name (cmeel-libomp's copy)."""
    try:
        with open(path, "rb") as stream:
            flavor, _ = openmp_runtime(stream.fileno(), stream.read(64))
    except (OSError, ValueError):
        return None
    return flavor.word if flavor else None


def worker_libraries(server: Server) -> str:
    """The OpenMP runtime (and tcmalloc) vLLM's model worker has mapped (/proc/PID/maps)."""
    for pid in process_tree(server.process.pid):
        try:
            if "VLLM::Worker" not in command_line(pid):
                continue
            paths = mapped_files(pid)
        except OSError:
            continue
        names = {Path(path).name for path in paths}
        flavors = {
            runtime_flavor(path)
            for path in paths
            if Path(path).name.startswith(("libiomp5", "libomp"))
        }
        gomp = any(name.startswith("libgomp") for name in names)
        found = (
            "libiomp5"
            if "intel" in flavors
            else "libomp (LLVM)"
            if "llvm" in flavors
            else "libgomp"
            if gomp
            else "no OpenMP"
        )
        if any(name.startswith("libtcmalloc") for name in names):
            found += " + tcmalloc"
        return found
    return "no worker found"


def tree_cpu(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) so far of the API server, EngineCore and Worker."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for pid in process_tree(server.process.pid):
        try:
            title = command_line(pid)
            # The name in parentheses is any process's own: only what follows is read.
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stream:
                fields = stream.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if pid == server.process.pid:
            role = "api"
        elif "VLLM::Worker" in title:
            role = "worker"
        elif "VLLM::EngineCore" in title:
            role = "engine"
        else:
            continue
        # After the ')': state is field 3 of stat, utime and stime are fields 14 and 15.
        used[role] = used.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


def idle_cores(server: Server, window_s: float) -> dict[str, float]:
    """Cores busy by role over `window_s` from now, no request in flight: what a served model
    costs while nobody asks (threads that spin after their last region show here)."""
    before, started = tree_cpu(server), time.perf_counter()
    time.sleep(window_s)
    after, wall_s = tree_cpu(server), time.perf_counter() - started
    return {role: (after.get(role, 0.0) - before.get(role, 0.0)) / wall_s for role in ROLES}


def omp_core_ids(log: str) -> str:
    """The cores vLLM bound its OpenMP threads to, from its 'core ids=[...]' log line."""
    for line in log.splitlines():
        if "core ids=" in line:
            return line.split("core ids=", 1)[1].strip()
    return "unbound"


def launcher_line(log: str) -> str:
    for line in log.splitlines():
        if line.startswith("vllm-cpu-launch:"):
            return line
    return ""


# ---------------------------------------------------------------- load


def sse_events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        event: dict[str, Any] = json.loads(data)
        yield event


@dataclass(frozen=True)
class Asks:
    """What a start's clients ask: one completion prompt (PROMPT's repetition for the made
    models, REAL_PROMPT for the real one), or a prompt set (`--prompts`, vLLM's `custom`
    dataset JSONL) sent as chat, as `vllm-cpu-launch tune` sends them (the server applies
    the model's chat template); client i asks prompt i, i + streams, ..."""

    prompts: tuple[str, ...]
    chat: bool

    def send(self, url: str, max_tokens: int, number: int) -> int:
        """The number-th request, streamed, of exactly max_tokens tokens; its token count."""
        text = self.prompts[number % len(self.prompts)]
        options: dict[str, Any] = {
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            payload = {
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
                **options,
            }
            return streamed_tokens(f"{url}/v1/chat/completions", payload)
        payload = completion_payload(max_tokens, prompt=text, **options)
        return streamed_tokens(f"{url}/v1/completions", payload)


def load_prompts(path: Path) -> tuple[str, ...]:
    """The `prompt` of each line of a `custom` dataset JSONL file."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ScriptError(f"{path}:{number}: not a JSON object with a prompt") from None
    if not prompts:
        raise ScriptError(f"{path}: no prompts")
    return tuple(prompts)


def asks_of(config: Config, prompts: tuple[str, ...] | None) -> Asks:
    """What config's clients ask: `--prompts`' set if given; else prose for the real model
    (what a user sends; its drafts are accepted as the model's own text allows), PROMPT's
    repetition for the made ones."""
    if prompts is not None:
        return Asks(prompts, chat=True)
    return Asks((REAL_PROMPT if config.model == REAL else PROMPT,), chat=False)


def streamed_tokens(url: str, payload: dict[str, Any]) -> int:
    """One streamed request's completion tokens, as its final usage says."""
    tokens = 0
    with LOOPBACK.open(json_request(url, payload), timeout=REQUEST_LIMIT_S) as response:
        for event in sse_events(response):
            usage = event.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    if tokens < 2:
        raise ScriptError(f"a streamed completion returned {tokens} tokens")
    return tokens


def run_phase(server: Server, streams: int, seconds: float, max_tokens: int, asks: Asks) -> Phase:
    """`streams` clients at once, each sending requests one after another for `seconds`."""
    url = server.url
    cpu_before = tree_cpu(server)
    counts_before = sd_counts(server)
    tpot_sum = metric_total(url, TPOT_METRIC + "_sum")
    tpot_count = metric_total(url, TPOT_METRIC + "_count")
    phase = Phase(streams)
    errors: list[str] = []
    gate = threading.Barrier(streams + 1)
    lock = threading.Lock()
    deadline = [0.0]

    def client(index: int) -> None:
        try:
            gate.wait(timeout=REQUEST_LIMIT_S)
            number = index
            while time.perf_counter() < deadline[0]:
                tokens = asks.send(url, max_tokens, number)
                number += streams
                with lock:
                    phase.tokens += tokens
                    phase.requests += 1
        except (OSError, http.client.HTTPException, ScriptError, ValueError) as error:
            with lock:
                errors.append(str(error))
        except threading.BrokenBarrierError:
            pass

    threads = [
        threading.Thread(target=client, args=(index,), daemon=True) for index in range(streams)
    ]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    deadline[0] = started + seconds
    gate.wait(timeout=REQUEST_LIMIT_S)
    for thread in threads:
        thread.join(timeout=seconds + REQUEST_LIMIT_S)
    phase.wall_s = time.perf_counter() - started
    cpu_after = tree_cpu(server)
    phase.cores = {
        role: (cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0)) / phase.wall_s
        for role in ROLES
    }
    if errors or any(thread.is_alive() for thread in threads):
        raise ScriptError(f"load failed: {errors[0] if errors else 'a client did not finish'}")
    phase.sd_counts = {key: value - counts_before[key] for key, value in sd_counts(server).items()}
    count = metric_total(url, TPOT_METRIC + "_count") - tpot_count
    if count > 0:
        phase.tpot_ms = (metric_total(url, TPOT_METRIC + "_sum") - tpot_sum) / count * 1e3
    return phase


# ---------------------------------------------------------------- one start


@contextlib.contextmanager
def warmed_up(
    config: Config,
    paths: dict[str, Path],
    scratch: Path,
    args: argparse.Namespace,
    active: list[Server],
    limit_s: float = STARTUP_LIMIT_S,
) -> Iterator[tuple[Server, float]]:
    """A healthy server of config after its warm-up requests (healthy within limit_s), with
    its seconds to healthy; stopped on the way out."""
    started = time.monotonic()
    server = launch(config, paths, scratch, args)
    active.append(server)
    try:
        try:
            startup = wait_until_healthy(server, limit_s, POLL_INTERVAL_S, started=started)
        except ServerError as error:
            raise ScriptError(f"{config.name}: {error}: {tail(server)}") from None
        asks = asks_of(config, args.prompt_set)
        for number in range(WARMUP_REQUESTS):
            asks.send(server.url, args.max_tokens, number)
        yield server, startup
    finally:
        stop_session(server, POLL_INTERVAL_S)
        active.remove(server)


def measure_one(
    config: Config,
    round_index: int,
    paths: dict[str, Path],
    scratch: Path,
    args: argparse.Namespace,
    active: list[Server],
) -> Run:
    """One start of config, measured at every concurrency level."""
    load_before = os.getloadavg()[0]
    asks = asks_of(config, args.prompt_set)
    with warmed_up(config, paths, scratch, args, active) as (server, startup):
        before = sd_counts(server)
        phases = [
            run_phase(server, streams, args.phase_seconds, args.max_tokens, asks)
            for streams in args.concurrency_levels
        ]
        idle = idle_cores(server, IDLE_WINDOW_S)
        counts = {key: value - before[key] for key, value in sd_counts(server).items()}
        worker = worker_libraries(server)
        log = server.log_text()
    drafted = counts["draft_tokens"]
    return Run(
        config,
        round_index,
        startup,
        phases,
        counts["accepted_tokens"] / drafted if drafted else float("nan"),
        worker,
        omp_core_ids(log),
        SD_WARNING in log,
        launcher_line(log),
        load_before,
        idle,
        counts,
    )


def sd_counts(server: Server) -> dict[str, float]:
    """vLLM's SD counters now, by SD_COUNTERS' keys (one read of /metrics)."""
    totals = metric_totals(server.url)
    return {key: totals.get(name, 0.0) for key, name in SD_COUNTERS.items()}

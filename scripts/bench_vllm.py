#!/usr/bin/env python3
"""Real vLLM with ngram speculative decoding, plain and through the launcher (issue 5, part 3).

The same tiny random Llama is served by `vllm serve` (vLLM then preloads GNU libgomp for
its workers) and by `vllm-cpu-launch --vllm ENV/bin/vllm serve` (Intel OpenMP preloaded),
with 1 OpenMP thread (vLLM's default on 2 CPUs: one CPU reserved) and with all CPUs
(`VLLM_CPU_NUM_OF_RESERVED_CPU=0`). Starts alternate, configuration order rotating per
round. For each start: seconds to a healthy `/health`, then after a short warm-up a fixed
streaming load on `/v1/completions` (greedy, `ignore_eos`, fixed output length), first
sequential, then concurrent: time per output token (TPOT, after the first token) and output
tokens per second. Every server runs in its own session with its own cold VLLM_CACHE_ROOT
and is killed before the next starts; every wait is bounded.

Prints a Markdown report (machine, command, table, ratios launcher vs plain of the same
run); `--markdown FILE` also puts it between markers in FILE (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench_stats import interleaved
from script_cli import ScriptError, exit_code, last_line, narrator
from vllm_server import (
    ACCEPTED_TOKENS_METRIC,
    DRAFT_TOKENS_METRIC,
    ENV_SETUP_LIMIT_S,
    LOOPBACK,
    MODEL_LIMIT_S,
    REQUEST_LIMIT_S,
    SD_WARNING,
    Server,
    ServerError,
    command_line,
    completion_payload,
    isolated_environment,
    json_request,
    make_model_command,
    mapped_files,
    metric_total,
    prepare_env_command,
    process_tree,
    start_server,
    stop_session,
    wait_until_healthy,
)

REPO = Path(__file__).resolve().parent.parent
TPOT_METRIC = "vllm:request_time_per_output_token_seconds"  # histogram: _sum, _count
MARK_BEGIN = "<!-- bench_vllm: begin -->"
MARK_END = "<!-- bench_vllm: end -->"
STARTUP_LIMIT_S = 420
POLL_INTERVAL_S = 0.5
WARMUP_REQUESTS = 2
INTERESTING_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "hypervisor",
)


say = narrator("bench_vllm")


# ---------------------------------------------------------------- set-up


def prepare_env(explicit: Path | None) -> Path:
    if explicit is not None:
        if not (explicit / "bin" / "vllm").exists():
            raise ScriptError(f"{explicit}/bin/vllm does not exist")
        return explicit.absolute()
    say("preparing the vLLM environment (scripts/vllm_env.py; minutes on first use)")
    return Path(last_line(prepare_env_command(), "scripts/vllm_env.py", ENV_SETUP_LIMIT_S))


def prepare_model(explicit: Path | None, env: Path, scratch: Path) -> Path:
    if explicit is not None:
        if not (explicit / "config.json").exists():
            raise ScriptError(f"{explicit} holds no config.json: not a model directory")
        return explicit.absolute()
    say("making the tiny model (scripts/make_tiny_model.py)")
    command = make_model_command(env, scratch / "model")
    return Path(last_line(command, "scripts/make_tiny_model.py", MODEL_LIMIT_S))


def versions(env: Path) -> str:
    code = (
        "import importlib.metadata as m\n"
        "print('vllm-cpu', m.version('vllm-cpu'), '/ torch', m.version('torch'))"
    )
    try:
        return last_line([str(env / "bin" / "python"), "-c", code], "version query", 120)
    except ScriptError:
        return "versions unknown"


def describe_machine() -> dict[str, str]:
    """CPU model, CPU count, the flags that matter to vLLM on CPU, memory, kernel."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            for line in stream:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    memory = "?"
    try:
        with open("/proc/meminfo", encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("MemTotal:"):
                    memory = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    return {
        "cpu": info.get("model name", "unknown CPU"),
        "cpus": str(os.cpu_count()),
        "flags": " ".join(f for f in INTERESTING_FLAGS if f in flags) or "none of interest",
        "memory": memory,
        "kernel": f"{platform.system()} {platform.release()}",
    }


# ---------------------------------------------------------------- servers


@dataclass(frozen=True)
class Config:
    how: str  # "plain" or "launcher"
    threads: str  # "1" or "all"

    @property
    def name(self) -> str:
        return f"{self.how}/{self.threads}"


def tail(server: Server, lines: int = 5) -> str:
    """The end of the server's log on one line, for error messages."""
    return " | ".join(server.log_text().strip().splitlines()[-lines:])


def server_environment(config: Config, scratch: Path) -> dict[str, str]:
    """The caller's environment minus OpenMP/launcher/vLLM-CPU settings, plus the bench's."""
    dropped = ("LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
    prefixes = ("KMP_", "OMP_", "GOMP_", "VLLM_CPU_", "VLLM_CPU_LAUNCH_")
    cpus = os.cpu_count() or 1
    reserved = 0 if config.threads == "all" else max(cpus - 1, 0)
    return {
        **isolated_environment(scratch, dropped, prefixes),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved),
    }


def launch(config: Config, env: Path, model: Path, scratch: Path) -> Server:
    """The server of one configuration, in scratch (its cwd; cold cache and config there)."""
    vllm = str(env / "bin" / "vllm")
    if config.how == "plain":
        prefix = [vllm]
    else:
        # This checkout's launcher, whatever the interpreter: it execs vLLM in place.
        code = (
            f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            "from vllm_cpu_launch.cli import main; sys.exit(main())"
        )
        prefix = [sys.executable, "-c", code, "--vllm", vllm]
    scratch.mkdir(parents=True)
    return start_server(prefix, model, scratch, server_environment(config, scratch), cwd=scratch)


def worker_openmp(server: Server) -> str:
    """Which OpenMP runtime vLLM's model worker has mapped (its /proc/PID/maps)."""
    for pid in process_tree(server.process.pid):
        try:
            if "VLLM::Worker" not in command_line(pid):
                continue
            mapped = mapped_files(pid)
        except OSError:
            continue
        names = {Path(path).name for path in mapped}
        iomp = any(name.startswith("libiomp5") for name in names)
        gomp = any(name.startswith("libgomp") for name in names)
        if iomp:
            return "libiomp5" + (" (+libgomp mapped)" if gomp else "")
        return "libgomp" if gomp else "neither"
    return "no worker found"


ROLES = ("api", "engine", "worker")


def tree_cpu(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) so far of the API server, EngineCore and Worker."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for pid in process_tree(server.process.pid):
        try:
            title = command_line(pid)
            with open(f"/proc/{pid}/stat", encoding="utf-8") as stream:
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


def omp_core_ids(log: str) -> str:
    """The cores vLLM bound its OpenMP threads to, from its 'core ids=[...]' log line."""
    for line in log.splitlines():
        if "core ids=" in line:
            return line.split("core ids=", 1)[1].strip()
    return "?"


def launcher_line(log: str) -> str:
    for line in log.splitlines():
        if line.startswith("vllm-cpu-launch:"):
            return line
    return ""


# ---------------------------------------------------------------- load


@dataclass
class Request:
    tokens: int
    first_token_s: float  # time to first token
    tpot_s: float  # (last - first token) / (tokens - 1)


@dataclass
class Phase:
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0
    server_tpot_ms: float = float("nan")  # vLLM's own per-request TPOT, mean over the phase
    cores: dict[str, float] = field(default_factory=dict)  # CPU-s per wall-s, by process role

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.requests) / self.wall_s if self.wall_s else 0.0

    @property
    def tpot_ms(self) -> float:
        """Client-side TPOT over the phase: all inter-token time / all tokens after the first.

        A mean, not a median of requests: with SD, tokens arrive in bursts and a request
        whose tokens came in one burst would have a per-request TPOT near zero."""
        spans = sum(r.tpot_s * (r.tokens - 1) for r in self.requests)
        return spans / sum(r.tokens - 1 for r in self.requests) * 1e3


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


def stream_completion(url: str, max_tokens: int) -> Request:
    """One streamed completion of exactly max_tokens tokens (ignore_eos), timed per chunk."""
    payload = completion_payload(
        max_tokens, ignore_eos=True, stream=True, stream_options={"include_usage": True}
    )
    request = json_request(f"{url}/v1/completions", payload)
    started = time.perf_counter()
    first = last = None
    tokens = 0
    with LOOPBACK.open(request, timeout=REQUEST_LIMIT_S) as response:
        for event in sse_events(response):
            now = time.perf_counter()
            if event.get("choices"):
                first = now if first is None else first
                last = now
            usage = event.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    if first is None or last is None or tokens < 2:
        raise ScriptError(f"a streamed completion returned {tokens} tokens")
    return Request(tokens, first - started, (last - first) / (tokens - 1))


def run_phase(server: Server, streams: int, per_stream: int, max_tokens: int) -> Phase:
    """`streams` clients at once, each sending `per_stream` requests one after another."""
    url = server.url
    cpu_before = tree_cpu(server)
    tpot_sum = metric_total(url, TPOT_METRIC + "_sum")
    tpot_count = metric_total(url, TPOT_METRIC + "_count")
    phase = Phase()
    errors: list[str] = []
    gate = threading.Barrier(streams + 1)
    lock = threading.Lock()

    def client() -> None:
        try:
            gate.wait(timeout=REQUEST_LIMIT_S)
            for _ in range(per_stream):
                result = stream_completion(url, max_tokens)
                with lock:
                    phase.requests.append(result)
        except (OSError, http.client.HTTPException, ScriptError, ValueError) as error:
            with lock:
                errors.append(str(error))
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    gate.wait(timeout=REQUEST_LIMIT_S)
    started = time.perf_counter()
    for thread in threads:
        thread.join(timeout=REQUEST_LIMIT_S * per_stream)
    phase.wall_s = time.perf_counter() - started
    cpu_after = tree_cpu(server)
    phase.cores = {
        role: (cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0)) / phase.wall_s
        for role in ROLES
    }
    if errors or any(thread.is_alive() for thread in threads):
        raise ScriptError(f"load failed: {errors[0] if errors else 'a client did not finish'}")
    count = metric_total(url, TPOT_METRIC + "_count") - tpot_count
    if count > 0:
        phase.server_tpot_ms = (metric_total(url, TPOT_METRIC + "_sum") - tpot_sum) / count * 1e3
    return phase


# ---------------------------------------------------------------- one start


@dataclass
class Run:
    config: Config
    startup_s: float
    sequential: Phase
    concurrent: Phase
    acceptance: float
    openmp: str
    core_ids: str
    sd_warning: bool
    launcher_info: str
    load_before: float
    startup_cpu: dict[str, float]  # CPU seconds by role when /health first answered


def measure_one(
    config: Config,
    env: Path,
    model: Path,
    scratch: Path,
    args: argparse.Namespace,
    active: list[Server],
) -> Run:
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    server = launch(config, env, model, scratch)
    active.append(server)
    try:
        try:
            startup = wait_until_healthy(server, STARTUP_LIMIT_S, POLL_INTERVAL_S, started=started)
        except ServerError as error:
            raise ScriptError(f"{error}: {tail(server)}") from None
        startup_cpu = tree_cpu(server)
        for _ in range(WARMUP_REQUESTS):
            stream_completion(server.url, args.max_tokens)
        drafted = metric_total(server.url, DRAFT_TOKENS_METRIC)
        accepted = metric_total(server.url, ACCEPTED_TOKENS_METRIC)
        sequential = run_phase(server, 1, args.sequential, args.max_tokens)
        concurrent = run_phase(server, args.concurrency, args.per_stream, args.max_tokens)
        drafted = metric_total(server.url, DRAFT_TOKENS_METRIC) - drafted
        accepted = metric_total(server.url, ACCEPTED_TOKENS_METRIC) - accepted
        openmp = worker_openmp(server)
        log = server.log_text()
    finally:
        stop_session(server, POLL_INTERVAL_S)
        active.remove(server)
    return Run(
        config,
        startup,
        sequential,
        concurrent,
        accepted / drafted if drafted else float("nan"),
        openmp,
        omp_core_ids(log),
        SD_WARNING in log,
        launcher_line(log),
        load_before,
        startup_cpu,
    )


# ---------------------------------------------------------------- report


def median_of(runs: Sequence[Run], value: str) -> float:
    getters: dict[str, Callable[[Run], float]] = {
        "startup": lambda r: r.startup_s,
        "seq_tpot": lambda r: r.sequential.tpot_ms,
        "seq_server_tpot": lambda r: r.sequential.server_tpot_ms,
        "conc_server_tpot": lambda r: r.concurrent.server_tpot_ms,
        "seq_tps": lambda r: r.sequential.tokens_per_s,
        "conc_tpot": lambda r: r.concurrent.tpot_ms,
        "conc_tps": lambda r: r.concurrent.tokens_per_s,
        "acceptance": lambda r: r.acceptance,
    }
    return statistics.median(getters[value](run) for run in runs)


def per_round(runs: Sequence[Run], value: str, digits: int) -> str:
    return " / ".join(f"{median_of([run], value):.{digits}f}" for run in runs)


def markdown(
    runs: Sequence[Run], args: argparse.Namespace, command: str, env: Path, started: float
) -> str:
    machine = describe_machine()
    configs = list(dict.fromkeys(run.config for run in runs))
    by_config = {c: [r for r in runs if r.config == c] for c in configs}
    loads = [run.load_before for run in runs]
    lines = [
        "## vLLM serving with ngram speculative decoding: plain vs launcher (`bench_vllm.py`)",
        "",
        f"- Machine: {machine['cpu']}, {machine['cpus']} CPUs, {machine['memory']}, "
        f"{machine['kernel']}; CPU flags: {machine['flags']}",
        f"- Software: {versions(env)}; Python {platform.python_version()}",
        f"- Command: `{command}`",
        f"- Ran {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}, "
        f"{(time.time() - started) / 60:.0f} min; 1-min load average before each start: "
        f"{min(loads):.1f}-{max(loads):.1f} (other work shared the machine)",
        f"- Load per start, after {WARMUP_REQUESTS} warm-up requests: greedy completions of "
        f"exactly {args.max_tokens} tokens (`ignore_eos`, streamed); sequential: "
        f"{args.sequential} requests; concurrent: {args.concurrency} clients x "
        f"{args.per_stream} requests. TPOT client = time from first to last streamed token "
        "/ tokens after the first, over the phase; TPOT server = mean of vLLM's "
        f"`{TPOT_METRIC}` over the phase; tok/s = output tokens / phase wall time.",
        f"- {args.rounds} round(s); each cell is the median over rounds (per-round values "
        "below the table); start-up = spawn to first 200 on `/health`, cold VLLM_CACHE_ROOT.",
        "",
        "| OpenMP threads | start | start-up s | seq TPOT ms client / server | seq tok/s "
        "| conc TPOT ms client / server | conc tok/s | SD acceptance | worker maps "
        "| SD warning in log |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, group in by_config.items():
        lines.append(
            f"| {config.threads} ({group[0].core_ids}) | {config.how} "
            f"| {median_of(group, 'startup'):.0f} | {median_of(group, 'seq_tpot'):.2f} / "
            f"{median_of(group, 'seq_server_tpot'):.2f} | {median_of(group, 'seq_tps'):.0f} "
            f"| {median_of(group, 'conc_tpot'):.2f} / {median_of(group, 'conc_server_tpot'):.2f} "
            f"| {median_of(group, 'conc_tps'):.0f} | {median_of(group, 'acceptance'):.2f} "
            f"| {group[0].openmp} | {'yes' if any(r.sd_warning for r in group) else 'no'} |"
        )
    lines += [
        "",
        "Ratios of the medians, launcher vs plain of this run (> 1 means the launcher is better):",
        "",
        "| OpenMP threads | start-up plain/launcher | seq TPOT (server) plain/launcher "
        "| seq tok/s launcher/plain | conc TPOT (server) plain/launcher "
        "| conc tok/s launcher/plain |",
        "|---|---|---|---|---|---|",
    ]
    for threads in dict.fromkeys(c.threads for c in configs):
        plain = by_config.get(Config("plain", threads))
        launched = by_config.get(Config("launcher", threads))
        if not plain or not launched:
            continue
        cells = [
            median_of(plain, "startup") / median_of(launched, "startup"),
            median_of(plain, "seq_server_tpot") / median_of(launched, "seq_server_tpot"),
            median_of(launched, "seq_tps") / median_of(plain, "seq_tps"),
            median_of(plain, "conc_server_tpot") / median_of(launched, "conc_server_tpot"),
            median_of(launched, "conc_tps") / median_of(plain, "conc_tps"),
        ]
        lines.append(f"| {threads} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines += [
        "",
        "Per round (start-up s; seq TPOT server ms; seq tok/s; conc TPOT server ms; conc tok/s):",
        "",
    ]
    for config, group in by_config.items():
        lines.append(
            f"- {config.name}: {per_round(group, 'startup', 0)}; "
            f"{per_round(group, 'seq_server_tpot', 2)}; {per_round(group, 'seq_tps', 0)}; "
            f"{per_round(group, 'conc_server_tpot', 2)}; {per_round(group, 'conc_tps', 0)}"
        )
    lines += [
        "",
        "Where the CPU went (medians over rounds; worker / EngineCore / API server): CPU "
        "seconds used up to the first healthy `/health`, and CPU-seconds per second (cores "
        f"busy, of {os.cpu_count()}) during each load phase:",
        "",
        "| OpenMP threads | start | start-up CPU s | seq phase cores | conc phase cores |",
        "|---|---|---|---|---|",
    ]
    for config, group in by_config.items():
        startup = " / ".join(
            f"{statistics.median(r.startup_cpu.get(role, 0.0) for r in group):.0f}"
            for role in ("worker", "engine", "api")
        )
        seq, conc = (
            " / ".join(
                f"{statistics.median(getattr(r, phase).cores.get(role, 0.0) for r in group):.2f}"
                for role in ("worker", "engine", "api")
            )
            for phase in ("sequential", "concurrent")
        )
        lines.append(f"| {config.threads} | {config.how} | {startup} | {seq} | {conc} |")
    info = next((r.launcher_info for r in runs if r.launcher_info), "")
    if info:
        lines += ["", f"Launcher's INFO line: `{info}`"]
    return "\n".join(lines) + "\n"


def update_markdown(path: Path, section: str) -> None:
    """Replace the marked section of `path` (or append it), leaving the rest as it is."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    block = f"{MARK_BEGIN}\n{section}{MARK_END}\n"
    if MARK_BEGIN in text and MARK_END in text:
        head, _, rest = text.partition(MARK_BEGIN)
        _, _, tail = rest.partition(MARK_END)
        text = head + block + tail.lstrip("\n")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="starts per configuration")
    parser.add_argument(
        "--threads",
        default="1,all",
        help="OpenMP thread settings, comma-separated from {1, all} (default 1,all)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--sequential", type=int, default=24, help="sequential requests")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument("--per-stream", type=int, default=16, help="requests per client")
    parser.add_argument("--vllm-env", type=Path, help="vLLM environment (default: vllm_env.py)")
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny one)")
    parser.add_argument("--markdown", type=Path, help="also write the report into this file")
    args = parser.parse_args(argv)
    threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    if not threads or any(t not in ("1", "all") for t in threads):
        parser.error("--threads takes 1, all or 1,all")
    args.thread_settings = threads
    if min(args.rounds, args.sequential, args.concurrency, args.per_stream) < 1:
        parser.error("--rounds, --sequential, --concurrency and --per-stream must be >= 1")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    return args


def terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def bench(args: argparse.Namespace, command: str) -> None:
    """Every configuration for every round, the report printed (and written), servers stopped."""
    active: list[Server] = []
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-") as temporary:
            scratch = Path(temporary)
            env = prepare_env(args.vllm_env)
            model = prepare_model(args.model, env, scratch)
            configs = [
                Config(how, t) for t in args.thread_settings for how in ("plain", "launcher")
            ]
            say(
                f"{len(configs)} configurations x {args.rounds} rounds; each start takes about "
                "1-2 minutes on 2 CPUs"
            )
            runs: list[Run] = []
            for round_index, config in interleaved(configs, args.rounds):
                say(f"round {round_index + 1}: starting {config.name}")
                where = scratch / f"r{round_index}-{config.how}-{config.threads}"
                run = measure_one(config, env, model, where, args, active)
                say(
                    f"  {config.name}: healthy after {run.startup_s:.0f} s, seq TPOT "
                    f"{run.sequential.server_tpot_ms:.2f} ms (server), "
                    f"{run.sequential.tokens_per_s:.0f} tok/s; concurrent "
                    f"{run.concurrent.tokens_per_s:.0f} tok/s; worker {run.openmp}"
                )
                runs.append(run)
            runs.sort(key=lambda r: configs.index(r.config))
            report = markdown(runs, args, command, env, started)
    finally:
        for server in list(active):
            stop_session(server, POLL_INTERVAL_S)
    print(report)
    if args.markdown is not None:
        update_markdown(args.markdown, report)
        say(f"wrote the report into {args.markdown}")
    print(f"rerun: cd {REPO} && {command}")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(arguments)
    command = shlex.join(["python", "scripts/bench_vllm.py", *arguments])
    signal.signal(signal.SIGTERM, terminate)
    return exit_code("bench_vllm", lambda: bench(args, command), "interrupted; servers stopped")


if __name__ == "__main__":
    raise SystemExit(main())

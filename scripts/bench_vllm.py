#!/usr/bin/env python3
"""Real vLLM with ngram speculative decoding: where each OpenMP/malloc setting helps or hurts.

A map over model size (`--models`: the tiny random Llama and a compute-bound one of ~105M
parameters, both made locally by scripts/make_tiny_model.py), the worker's OpenMP threads
(`--threads`: vLLM's default reservation, or all CPUs with VLLM_CPU_NUM_OF_RESERVED_CPU=0),
client concurrency (`--concurrency`, measured one after another on the same server) and
the runtime settings a launcher can choose (`--settings`, SETTINGS below): plain
`vllm serve` (vLLM preloads GNU libgomp), and the launcher of this checkout with Intel
OpenMP as vLLM's workers tune it, with tcmalloc beside libgomp or libiomp5 (the vLLM
Docker image's recipe), and with libiomp5 under VLLM_CPU_OMP_THREADS_BIND=nobind, the only
mode in which the launcher's KMP_BLOCKTIME reaches the worker (vLLM then sets no KMP_*,
OMP_NUM_THREADS or affinity, so the worker's team spans every CPU whatever is reserved).

Starts alternate, the order rotating per round (bench_stats.interleaved). For each start:
seconds to a healthy `/health`, then after a short warm-up, per concurrency level, clients
stream greedy `ignore_eos` completions for `--phase-seconds`: vLLM's own mean time per
output token over the phase (`vllm:request_time_per_output_token_seconds`), output tokens
per second, and the CPU each vLLM process used. Every server runs in its own session and is
killed before the next starts; every wait is bounded. The starts of a model share one
VLLM_CACHE_ROOT, filled by an unmeasured start first: every measured start finds the same
warm compile cache (30 s to healthy instead of 50 s here; the compiled code does not depend
on the runtime preloaded).

Prints a Markdown report (machine, command, tables, ratios against plain vLLM of the same
run with the per-round spread); `--markdown FILE` puts it between markers in FILE,
`--json FILE` keeps every measurement, `--plot FILE.png` draws TPOT per configuration
(matplotlib), and `--from-json FILE` redraws report and plot from a kept run.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
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
DEBIAN_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
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
ROLES = ("worker", "engine", "api")


say = narrator("bench_vllm")


# ---------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Setting:
    """A runtime configuration: which libraries are preloaded, and how the worker binds."""

    key: str
    iomp: bool
    tcmalloc: bool
    blocktime: str | None = None  # the launcher's --kmp-blocktime
    nobind: bool = False  # VLLM_CPU_OMP_THREADS_BIND=nobind

    @property
    def plain(self) -> bool:
        """Plain `vllm serve`, no launcher: vLLM preloads libgomp itself."""
        return not (self.iomp or self.tcmalloc)

    @property
    def baseline(self) -> str:
        """The plain setting this one is compared with: as bound as it is."""
        return "libgomp-nobind" if self.nobind else "libgomp"

    def launcher_options(self, tcmalloc_path: Path) -> list[str]:
        tcmalloc = ["--tcmalloc", "always", "--tcmalloc-path", str(tcmalloc_path)]
        options = ["--iomp", "always" if self.iomp else "never"]
        options += tcmalloc if self.tcmalloc else ["--tcmalloc", "never"]
        return options + (["--kmp-blocktime", self.blocktime] if self.blocktime else [])


SETTINGS = {
    s.key: s
    for s in (
        Setting("libgomp", iomp=False, tcmalloc=False),
        Setting("libgomp+tcmalloc", iomp=False, tcmalloc=True),
        Setting("libiomp5", iomp=True, tcmalloc=False),
        Setting("libiomp5+tcmalloc", iomp=True, tcmalloc=True),
        Setting("libgomp-nobind", iomp=False, tcmalloc=False, nobind=True),
        Setting("libiomp5-nobind-bt0", iomp=True, tcmalloc=False, blocktime="0", nobind=True),
        Setting("libiomp5-nobind-bt200", iomp=True, tcmalloc=False, blocktime="200", nobind=True),
    )
}
THREADS = {"default": "vLLM's default reservation", "all": "all CPUs (reserved 0, or nobind)"}
NOBIND = "nobind"  # the threads column of nobind settings: the team spans every CPU


@dataclass(frozen=True)
class Config:
    model: str
    threads: str  # "default", "all", or NOBIND
    setting: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.threads}/{self.setting}"


def grid(models: Sequence[str], threads: Sequence[str], settings: Sequence[str]) -> list[Config]:
    """Every bound setting at every thread count; a nobind one once (reservation is moot)."""
    configs = []
    for model in models:
        for key in settings:
            counts = [NOBIND] if SETTINGS[key].nobind else threads
            configs += [Config(model, count, key) for count in counts]
    return configs


def baseline_of(config: Config) -> Config:
    """Plain vLLM with the same OpenMP threads and binding: what config is compared with."""
    return Config(config.model, config.threads, SETTINGS[config.setting].baseline)


# ---------------------------------------------------------------- set-up


def prepare_env(explicit: Path | None) -> Path:
    if explicit is not None:
        if not (explicit / "bin" / "vllm").exists():
            raise ScriptError(f"{explicit}/bin/vllm does not exist")
        return explicit.absolute()
    say("preparing the vLLM environment (scripts/vllm_env.py; minutes on first use)")
    return Path(last_line(prepare_env_command(), "scripts/vllm_env.py", ENV_SETUP_LIMIT_S))


def prepare_model(size: str, env: Path, scratch: Path) -> Path:
    say(f"making the {size} model (scripts/make_tiny_model.py --size {size})")
    command = [*make_model_command(env, scratch / f"model-{size}"), "--size", size]
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


def parameter_count(model: Path) -> str:
    """Parameters of a made model, from its config.json (Llama shapes, untied embeddings)."""
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    layer = 4 * hidden * hidden + 3 * hidden * inner + 2 * hidden
    total = config["num_hidden_layers"] * layer + 2 * config["vocab_size"] * hidden + hidden
    return (
        f"{total / 1e6:.1f}M parameters (hidden {hidden}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} heads)"
    )


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


def tail(server: Server, lines: int = 5) -> str:
    """The end of the server's log on one line, for error messages."""
    return " | ".join(server.log_text().strip().splitlines()[-lines:])


def server_environment(config: Config, scratch: Path, cache: Path) -> dict[str, str]:
    """The caller's environment minus OpenMP/launcher/vLLM-CPU settings, plus the config's."""
    dropped = ("LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
    prefixes = ("KMP_", "OMP_", "GOMP_", "VLLM_CPU_", "VLLM_CPU_LAUNCH_")
    env = {**isolated_environment(scratch, dropped, prefixes), "VLLM_CACHE_ROOT": str(cache)}
    if config.threads == "all":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    # Explicit either way: the launcher's own map rules (evidence.py) leave both as given.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind" if SETTINGS[config.setting].nobind else "auto"
    return env


def launch(config: Config, paths: dict[str, Path], scratch: Path, tcmalloc: Path) -> Server:
    """The server of one configuration, in scratch (its cwd; its config directory there)."""
    env, model, cache = paths["env"], paths[config.model], paths[f"{config.model}-cache"]
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
        prefix = [sys.executable, "-c", code, *setting.launcher_options(tcmalloc), "--vllm", vllm]
    scratch.mkdir(parents=True)
    environment = server_environment(config, scratch, cache)
    return start_server(prefix, model, scratch, environment, cwd=scratch)


def worker_libraries(server: Server) -> str:
    """The OpenMP runtime (and tcmalloc) vLLM's model worker has mapped (/proc/PID/maps)."""
    for pid in process_tree(server.process.pid):
        try:
            if "VLLM::Worker" not in command_line(pid):
                continue
            names = {Path(path).name for path in mapped_files(pid)}
        except OSError:
            continue
        iomp = any(name.startswith("libiomp5") for name in names)
        gomp = any(name.startswith("libgomp") for name in names)
        found = "libiomp5" if iomp else "libgomp" if gomp else "no OpenMP"
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
    return "unbound"


def launcher_line(log: str) -> str:
    for line in log.splitlines():
        if line.startswith("vllm-cpu-launch:"):
            return line
    return ""


# ---------------------------------------------------------------- load


@dataclass
class Phase:
    streams: int
    tokens: int = 0
    requests: int = 0
    wall_s: float = 0.0
    tpot_ms: float = float("nan")  # vLLM's own per-request TPOT, mean over the phase
    cores: dict[str, float] = field(default_factory=dict)  # CPU-s per wall-s, by process role

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


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


def stream_completion(url: str, max_tokens: int) -> int:
    """One streamed completion of exactly max_tokens tokens (ignore_eos); its token count."""
    payload = completion_payload(
        max_tokens, ignore_eos=True, stream=True, stream_options={"include_usage": True}
    )
    request = json_request(f"{url}/v1/completions", payload)
    tokens = 0
    with LOOPBACK.open(request, timeout=REQUEST_LIMIT_S) as response:
        for event in sse_events(response):
            usage = event.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    if tokens < 2:
        raise ScriptError(f"a streamed completion returned {tokens} tokens")
    return tokens


def run_phase(server: Server, streams: int, seconds: float, max_tokens: int) -> Phase:
    """`streams` clients at once, each sending requests one after another for `seconds`."""
    url = server.url
    cpu_before = tree_cpu(server)
    tpot_sum = metric_total(url, TPOT_METRIC + "_sum")
    tpot_count = metric_total(url, TPOT_METRIC + "_count")
    phase = Phase(streams)
    errors: list[str] = []
    gate = threading.Barrier(streams + 1)
    lock = threading.Lock()
    deadline = [0.0]

    def client() -> None:
        try:
            gate.wait(timeout=REQUEST_LIMIT_S)
            while time.perf_counter() < deadline[0]:
                tokens = stream_completion(url, max_tokens)
                with lock:
                    phase.tokens += tokens
                    phase.requests += 1
        except (OSError, http.client.HTTPException, ScriptError, ValueError) as error:
            with lock:
                errors.append(str(error))
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
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
    count = metric_total(url, TPOT_METRIC + "_count") - tpot_count
    if count > 0:
        phase.tpot_ms = (metric_total(url, TPOT_METRIC + "_sum") - tpot_sum) / count * 1e3
    return phase


# ---------------------------------------------------------------- one start


@dataclass
class Run:
    config: Config
    round: int
    startup_s: float
    phases: list[Phase]
    acceptance: float
    worker: str
    core_ids: str
    sd_warning: bool
    launcher_info: str
    load_before: float

    def phase(self, streams: int) -> Phase:
        return next(p for p in self.phases if p.streams == streams)


@contextlib.contextmanager
def warmed_up(
    config: Config,
    paths: dict[str, Path],
    scratch: Path,
    args: argparse.Namespace,
    active: list[Server],
) -> Iterator[tuple[Server, float]]:
    """A healthy server of config after its warm-up requests, with its seconds to healthy;
    stopped on the way out."""
    started = time.monotonic()
    server = launch(config, paths, scratch, args.tcmalloc_path)
    active.append(server)
    try:
        try:
            startup = wait_until_healthy(server, STARTUP_LIMIT_S, POLL_INTERVAL_S, started=started)
        except ServerError as error:
            raise ScriptError(f"{config.name}: {error}: {tail(server)}") from None
        for _ in range(WARMUP_REQUESTS):
            stream_completion(server.url, args.max_tokens)
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
    with warmed_up(config, paths, scratch, args, active) as (server, startup):
        drafted = metric_total(server.url, DRAFT_TOKENS_METRIC)
        accepted = metric_total(server.url, ACCEPTED_TOKENS_METRIC)
        phases = [
            run_phase(server, streams, args.phase_seconds, args.max_tokens)
            for streams in args.concurrency_levels
        ]
        drafted = metric_total(server.url, DRAFT_TOKENS_METRIC) - drafted
        accepted = metric_total(server.url, ACCEPTED_TOKENS_METRIC) - accepted
        worker = worker_libraries(server)
        log = server.log_text()
    return Run(
        config,
        round_index,
        startup,
        phases,
        accepted / drafted if drafted else float("nan"),
        worker,
        omp_core_ids(log),
        SD_WARNING in log,
        launcher_line(log),
        load_before,
    )


def runs_from_json(data: dict[str, Any]) -> list[Run]:
    """The runs of a `--json` file, as measured."""
    runs = []
    for item in data["runs"]:
        phases = [Phase(**phase) for phase in item.pop("phases")]
        runs.append(Run(config=Config(**item.pop("config")), phases=phases, **item))
    return runs


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Ratio:
    """Plain vLLM's TPOT / this configuration's (> 1: faster than plain), paired by round."""

    median: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        """`loss`/`gain` when every round agrees (a sign test: 4 rounds, p = 1/16), else `=`."""
        return "loss" if self.high < 1 else "gain" if self.low > 1 else "="

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f}) {self.verdict}"


def speedup(runs: Sequence[Run], baseline: Sequence[Run], streams: int, metric: str) -> Ratio:
    """How much better than plain, round by round: plain's TPOT / this one's ("tpot"), or
    this one's tokens per second / plain's ("tok/s")."""

    def better(run: Run, plain: Run) -> float:
        ours, theirs = run.phase(streams), plain.phase(streams)
        if metric == "tpot":
            return theirs.tpot_ms / ours.tpot_ms
        return ours.tokens_per_s / theirs.tokens_per_s

    plain = {run.round: run for run in baseline}
    paired = [better(run, plain[run.round]) for run in runs if run.round in plain]
    return Ratio(statistics.median(paired), min(paired), max(paired))


def spread(values: Sequence[float]) -> str:
    """`median (min-max)`."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


# ---------------------------------------------------------------- report


def ratio_table(
    pairs: Sequence[tuple[Config, Config]],
    by_config: dict[Config, list[Run]],
    levels: Sequence[int],
) -> list[str]:
    """Rows of speedup() per concurrency level, TPOT then tok/s, for (config, baseline)
    pairs measured in this run."""
    lines = [
        "Paired by round, `median (min-max)`, > 1 = better than the baseline: TPOT "
        "baseline/this and tok/s this/baseline; `loss`/`gain` when every round agrees.",
        "",
        "| threads | setting | baseline | "
        + " | ".join(f"{m} C={c}" for m in ("TPOT", "tok/s") for c in levels)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(levels)),
    ]
    for config, baseline in pairs:
        if config not in by_config or baseline not in by_config:
            continue
        cells = [
            str(speedup(by_config[config], by_config[baseline], c, metric))
            for metric in ("tpot", "tok/s")
            for c in levels
        ]
        lines.append(
            f"| {config.threads} | {config.setting} | {baseline.threads}/{baseline.setting} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def markdown(runs: Sequence[Run], meta: dict[str, Any]) -> str:
    configs = list(dict.fromkeys(run.config for run in runs))
    by_config = {c: [r for r in runs if r.config == c] for c in configs}
    levels: list[int] = meta["concurrency"]
    machine = meta["machine"]
    loads = [run.load_before for run in runs]
    lines = [
        "## vLLM with ngram speculative decoding: the map (`bench_vllm.py`)",
        "",
        f"- Machine: {machine['cpu']}, {machine['cpus']} CPUs, {machine['memory']}, "
        f"{machine['kernel']}; CPU flags: {machine['flags']}",
        f"- Software: {meta['versions']}; Python {meta['python']}",
        f"- Command: `{meta['command']}`",
        f"- Ran {meta['started']}, {meta['minutes']:.0f} min, {len(runs)} vLLM starts; "
        f"1-min load average before each start: {min(loads):.1f}-{max(loads):.1f}",
        *(f"- Model `{name}`: {text}" for name, text in meta["models"].items()),
        f"- Load per start, after {WARMUP_REQUESTS} warm-up requests: for each concurrency "
        f"level C in {levels}, C clients stream greedy completions of exactly "
        f"{meta['max_tokens']} tokens (`ignore_eos`) one after another for "
        f"{meta['phase_seconds']:.0f} s. TPOT = mean of vLLM's own `{TPOT_METRIC}` over the "
        "phase (ms); tok/s = output tokens / phase wall time.",
        f"- {meta['rounds']} rounds, the order of the starts rotated each round; cells are "
        "`median (min-max)` over rounds. Threads: `default` = vLLM's default reservation "
        "(one CPU per local rank kept for the front end), `all` = "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=0, both bound by vLLM (VLLM_CPU_OMP_THREADS_BIND "
        "`auto`, its default); `nobind` = VLLM_CPU_OMP_THREADS_BIND=nobind (vLLM binds "
        "nothing and sets no OMP_*/KMP_*; the team spans every CPU).",
        "",
    ]
    for model in dict.fromkeys(c.model for c in configs):
        mine = [c for c in configs if c.model == model]
        header = " | ".join(f"TPOT ms C={c}" for c in levels)
        header += " | " + " | ".join(f"tok/s C={c}" for c in levels)
        lines += [
            f"### Model `{model}`",
            "",
            f"| threads (cores) | setting | worker maps | start-up s | {header} |",
            "|---|---|---|---|" + "---|" * (2 * len(levels)),
        ]
        for config in mine:
            group = by_config[config]
            tpots = [spread([r.phase(c).tpot_ms for r in group]) for c in levels]
            rates = [
                f"{statistics.median(r.phase(c).tokens_per_s for r in group):.0f}" for c in levels
            ]
            lines.append(
                f"| {config.threads} ({group[0].core_ids}) | {config.setting} | {group[0].worker} "
                f"| {statistics.median(r.startup_s for r in group):.0f} | "
                + " | ".join(tpots + rates)
                + " |"
            )
        against_plain = [(c, baseline_of(c)) for c in mine if not SETTINGS[c.setting].plain]
        as_installed = Config(model, "default", "libgomp")
        lines += [
            "",
            "Against plain vLLM as installed (libgomp, vLLM's default reservation and binding):",
            "",
            *ratio_table([(c, as_installed) for c in mine if c != as_installed], by_config, levels),
            "",
            "Against plain vLLM with the same threads and binding (libgomp, or libgomp-nobind):",
            "",
            *ratio_table(against_plain, by_config, levels),
            "",
            "Reserving no CPU (`all`) against vLLM's default reservation, same setting:",
            "",
            *ratio_table(
                [(c, Config(model, "default", c.setting)) for c in mine if c.threads == "all"],
                by_config,
                levels,
            ),
            "",
            "Where the CPU went during each phase (cores busy of "
            f"{machine['cpus']}, median; worker / EngineCore / API server):",
            "",
            "| threads | setting | " + " | ".join(f"C={c}" for c in levels) + " |",
            "|---|---|" + "---|" * len(levels),
        ]
        for config in mine:
            group = by_config[config]
            cells = [
                " / ".join(
                    f"{statistics.median(r.phase(c).cores.get(role, 0.0) for r in group):.2f}"
                    for role in ROLES
                )
                for c in levels
            ]
            lines.append(f"| {config.threads} | {config.setting} | " + " | ".join(cells) + " |")
        lines.append("")
    warned = sorted({r.config.setting for r in runs if r.sd_warning})
    acceptance = [r.acceptance for r in runs]
    lines += [
        f"SD acceptance over all starts: {spread(acceptance)}; vLLM's SD warning printed by: "
        f"{', '.join(warned) or 'none'}.",
    ]
    infos = dict.fromkeys(r.launcher_info for r in runs if r.launcher_info)
    lines += ["", "The launcher's INFO lines:", "", *(f"- `{info}`" for info in infos)]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[Run], meta: dict[str, Any], path: Path) -> None:
    """TPOT per configuration: a panel per model and thread setting, bars per concurrency,
    whiskers from the fastest to the slowest round."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScriptError(
            "--plot needs matplotlib; Fix: python -m pip install -e '.[bench]'"
        ) from None
    levels: list[int] = meta["concurrency"]
    models = list(dict.fromkeys(r.config.model for r in runs))
    panels = ["default", "all"]
    figure, axes = plt.subplots(
        len(models), len(panels), figsize=(13, 4.2 * len(models)), squeeze=False
    )
    for row, model in enumerate(models):
        for column, threads in enumerate(panels):
            axis = axes[row][column]
            wanted = (threads, NOBIND) if threads == "all" else (threads,)
            configs = list(dict.fromkeys(r.config for r in runs if r.config.model == model))
            configs = [c for c in configs if c.threads in wanted]
            if not configs:
                axis.set_visible(False)
                continue
            width = 0.8 / max(len(configs), 1)
            for index, config in enumerate(configs):
                group = [r for r in runs if r.config == config]
                medians, lows, highs = [], [], []
                for level in levels:
                    values = [r.phase(level).tpot_ms for r in group]
                    middle = statistics.median(values)
                    medians.append(middle)
                    lows.append(middle - min(values))
                    highs.append(max(values) - middle)
                positions = [
                    i + (index - (len(configs) - 1) / 2) * width for i in range(len(levels))
                ]
                label = config.setting + (" (nobind)" if config.threads == NOBIND else "")
                colour = f"C{list(SETTINGS).index(config.setting)}"  # the same in every panel
                axis.bar(
                    positions,
                    medians,
                    width,
                    yerr=[lows, highs],
                    capsize=2,
                    label=label,
                    color=colour,
                )
            axis.set_xticks(range(len(levels)), [f"C={c}" for c in levels])
            axis.set_title(f"{model} model, threads: {THREADS[threads]}")
            axis.set_ylabel("TPOT ms (vLLM's own, lower is better)")
            axis.legend(fontsize=7)
    figure.suptitle(
        f"{meta['versions']}, ngram SD, on {meta['machine']['cpu']}, "
        f"{meta['machine']['cpus']} CPUs: median of {meta['rounds']} rounds, whiskers min-max"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


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


def listed(
    parser: argparse.ArgumentParser, option: str, text: str, allowed: Sequence[str]
) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or any(item not in allowed for item in items):
        parser.error(f"{option} takes a comma-separated list from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="starts per configuration")
    parser.add_argument("--models", default="tiny,100m", help="tiny,100m (default both)")
    parser.add_argument("--threads", default="default,all", help="default,all (default both)")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"from {', '.join(SETTINGS)} (default all)"
    )
    parser.add_argument("--concurrency", default="1,4,8", help="client counts (default 1,4,8)")
    parser.add_argument("--phase-seconds", type=float, default=8.0, help="load per level")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--tcmalloc-path",
        type=Path,
        default=Path(DEBIAN_TCMALLOC),
        help=f"tcmalloc for the +tcmalloc settings (default {DEBIAN_TCMALLOC})",
    )
    parser.add_argument("--vllm-env", type=Path, help="vLLM environment (default: vllm_env.py)")
    parser.add_argument("--markdown", type=Path, help="also write the report into this file")
    parser.add_argument("--json", type=Path, help="also keep every measurement in this file")
    parser.add_argument("--plot", type=Path, help="draw TPOT per configuration into this PNG")
    parser.add_argument("--from-json", type=Path, help="report (and plot) a kept run; no vLLM")
    args = parser.parse_args(argv)
    args.model_sizes = listed(parser, "--models", args.models, ("tiny", "100m"))
    args.thread_settings = listed(parser, "--threads", args.threads, tuple(THREADS))
    args.setting_keys = listed(parser, "--settings", args.settings, tuple(SETTINGS))
    try:
        args.concurrency_levels = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        parser.error("--concurrency takes whole numbers, comma-separated")
    if min(args.rounds, *args.concurrency_levels) < 1 or args.phase_seconds <= 0:
        parser.error("--rounds and --concurrency must be >= 1, --phase-seconds > 0")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    needs_tcmalloc = any(SETTINGS[key].tcmalloc for key in args.setting_keys)
    if needs_tcmalloc and not args.from_json and not args.tcmalloc_path.is_file():
        parser.error(
            f"--tcmalloc-path {args.tcmalloc_path} does not exist; Fix: apt-get install "
            "libtcmalloc-minimal4, or name another file, or leave out the +tcmalloc --settings"
        )
    return args


def terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def measure(args: argparse.Namespace, command: str) -> tuple[list[Run], dict[str, Any]]:
    """Every configuration for every round, servers stopped; the runs and what they ran on."""
    active: list[Server] = []
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-") as temporary:
            scratch = Path(temporary)
            paths = {"env": prepare_env(args.vllm_env)}
            for size in args.model_sizes:
                paths[size] = prepare_model(size, paths["env"], scratch)
                paths[f"{size}-cache"] = scratch / f"vllm-cache-{size}"
                say(f"filling the compile cache of the {size} model (one unmeasured start)")
                warm = Config(size, args.thread_settings[0], "libgomp")
                with warmed_up(warm, paths, scratch / f"warm-{size}", args, active):
                    pass
            configs = grid(args.model_sizes, args.thread_settings, args.setting_keys)
            total = len(configs) * args.rounds
            say(f"{len(configs)} configurations x {args.rounds} rounds = {total} starts")
            runs: list[Run] = []
            for number, (round_index, config) in enumerate(interleaved(configs, args.rounds), 1):
                say(f"start {number}/{total}, round {round_index + 1}: {config.name}")
                where = scratch / f"r{round_index}-{number}"
                run = measure_one(config, round_index, paths, where, args, active)
                say(
                    f"  healthy after {run.startup_s:.0f} s; TPOT "
                    + ", ".join(f"C={p.streams} {p.tpot_ms:.2f} ms" for p in run.phases)
                    + f"; worker {run.worker}"
                )
                runs.append(run)
            models = {size: parameter_count(paths[size]) for size in args.model_sizes}
    finally:
        for server in list(active):
            stop_session(server, POLL_INTERVAL_S)
    runs.sort(key=lambda r: (configs.index(r.config), r.round))
    meta = {
        "command": command,
        "machine": describe_machine(),
        "versions": versions(paths["env"]),
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "minutes": (time.time() - started) / 60,
        "models": models,
        "concurrency": args.concurrency_levels,
        "phase_seconds": args.phase_seconds,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
    }
    return runs, meta


def bench(args: argparse.Namespace, command: str) -> None:
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text(encoding="utf-8"))
        runs, meta = runs_from_json(data), data["meta"]
    else:
        runs, meta = measure(args, command)
        if args.json is not None:
            kept = {"meta": meta, "runs": [asdict(run) for run in runs]}
            args.json.write_text(json.dumps(kept, indent=1) + "\n", encoding="utf-8")
            say(f"kept every measurement in {args.json}")
    report = markdown(runs, meta)
    print(report)
    if args.markdown is not None:
        update_markdown(args.markdown, report)
        say(f"wrote the report into {args.markdown}")
    if args.plot is not None:
        plot(runs, meta, args.plot)
        say(f"drew {args.plot}")
    print(f"rerun: cd {REPO} && {meta['command']}")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(arguments)
    command = shlex.join(["python", "scripts/bench_vllm.py", *arguments])
    signal.signal(signal.SIGTERM, terminate)
    return exit_code("bench_vllm", lambda: bench(args, command), "interrupted; servers stopped")


if __name__ == "__main__":
    raise SystemExit(main())

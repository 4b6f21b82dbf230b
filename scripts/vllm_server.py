"""A real vLLM server, as the demo, the benchmarks and the end-to-end test start and drive it.

All of them serve a local model (the tiny one of scripts/make_tiny_model.py, or the real
one of scripts/real_model.py) from the cached vLLM CPU environment of scripts/vllm_env.py
the same way: `serve MODEL` on a free loopback port
with ngram speculative decoding, in a session of its own (so its whole process tree can be
found and stopped), its stdout and stderr in SCRATCH/server.log. Every wait is bounded.

Standard library only: the demo imports it before any venv exists. Scripts import it as a
sibling module (scripts/ is on sys.path when one runs); tests put scripts/ on sys.path.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
SPECULATIVE_CONFIG = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3}'
# Repetitive, so the ngram proposer finds matches and drafts tokens from the first step.
PROMPT = "ab ba " * 8
# Printed by vllm/v1/worker/cpu_worker.py (vLLM 0.32.0) when LD_PRELOAD lacks "libiomp".
SD_WARNING = "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD"
# vLLM's SD counters (vllm/v1/spec_decode/metrics.py; Prometheus adds `_total`): verifying
# steps that had a draft, tokens drafted, tokens accepted.
DRAFTS_METRIC = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS_METRIC = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS_METRIC = "vllm:spec_decode_num_accepted_tokens_total"
ENV_SETUP_LIMIT_S = 1800
MODEL_LIMIT_S = 300
REQUEST_LIMIT_S = 120
STOP_LIMIT_S = 60
HEALTH_PROBE_LIMIT_S = 5
# Direct connections only: a proxy from the environment must not see loopback traffic.
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------- what it serves


def prepare_env_command(release: str | None = None, doctored: bool = False) -> list[str]:
    """scripts/vllm_env.py: prints the cached vLLM CPU environment's path as its last line
    (of the default release, or of `release`), as the README installs it; `doctored`: after
    the README's plugin step (doctor's fix run), where plain `vllm` starts."""
    chosen = ["--release", release] if release else []
    return [sys.executable, str(SCRIPTS / "vllm_env.py"), *chosen, *["--doctored"] * doctored]


def real_model_command(*options: str) -> list[str]:
    """scripts/real_model.py: prints the real model's directory (cached once per machine)."""
    return [sys.executable, str(SCRIPTS / "real_model.py"), *options]


def make_model_command(vllm_env: Path, output: Path) -> list[str]:
    """scripts/make_tiny_model.py run by the vLLM environment's Python: prints the model dir."""
    return [str(vllm_env / "bin" / "python"), str(SCRIPTS / "make_tiny_model.py"), str(output)]


# ---------------------------------------------------------------- starting and stopping


@dataclass(frozen=True)
class Server:
    """A started vLLM server: its process (leader of its own session), port and log file."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        """Base URL on loopback."""
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self.log.read_text(encoding="utf-8", errors="replace")

    def tail(self, lines: int, what: str | None = None) -> str:
        """The log's last lines under `--- last lines of WHAT ---` (default: the log's path)."""
        last = self.log_text().splitlines()[-lines:]
        return "\n".join([f"--- last lines of {what or self.log} ---", *last])


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def offline_settings(scratch: Path, compile_cache: Path | None = None) -> dict[str, str]:
    """A small, offline vLLM on CPU: 1 GiB of KV cache, no model hub, no usage statistics,
    and a vLLM cache: `compile_cache` where given, shared by starts that can reuse one
    another's compiled model (vLLM keys it by configuration and code, and replaces files
    atomically; the compiled code does not depend on the runtime preloaded, docs/
    benchmarks.md), else one of its own under scratch (cold for every start)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(compile_cache or scratch / "vllm-cache"),
    }


def isolated_environment(
    scratch: Path,
    dropped: Iterable[str],
    dropped_prefixes: Iterable[str],
    compile_cache: Path | None = None,
) -> dict[str, str]:
    """The caller's environment without the `dropped` variables and those starting with one of
    `dropped_prefixes`, plus offline_settings() and a config directory of its own (so no user
    config file of the launcher applies): the environment of tests and benchmarks."""
    names, prefixes = frozenset(dropped), tuple(dropped_prefixes)
    inherited = {
        key: value
        for key, value in os.environ.items()
        if key not in names and not key.startswith(prefixes)
    }
    settings = offline_settings(scratch, compile_cache)
    return {**inherited, **settings, "XDG_CONFIG_HOME": str(scratch / "config")}


def served_name(model: Path) -> str:
    """The name vLLM serves `model` under: its directory's, in lower case
    (`smollm2-135m-instruct` for the real model), so that a request and the log name the
    model really served."""
    return model.name.lower()


def serve_arguments(
    model: Path, port: int, speculative: bool = True, speculative_config: str = SPECULATIVE_CONFIG
) -> list[str]:
    """`serve MODEL ...` as an operator would type it, with speculative decoding as
    `speculative_config` asks (ngram by default; none where `speculative` is false)."""
    return [
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        served_name(model),
        *(["--speculative-config", speculative_config] if speculative else []),
    ]


def start_server(
    prefix: Sequence[str],
    model: Path,
    scratch: Path,
    env: Mapping[str, str],
    *,
    port: int | None = None,
    cwd: Path | None = None,
    extra: Sequence[str] = (),
    speculative: bool = True,
    speculative_config: str = SPECULATIVE_CONFIG,
) -> Server:
    """Start `PREFIX serve MODEL ... EXTRA` (on `port`, else a free one) in a session of its
    own, stdout and stderr to scratch/server.log. `extra` holds what a deployment adds to the
    operator's command line: the parallel options of one node of several, say; without
    `speculative`, the command requests no speculative decoding, with it the one that
    `speculative_config` (JSON) names."""
    port = free_loopback_port() if port is None else port
    log = scratch / "server.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [*prefix, *serve_arguments(model, port, speculative, speculative_config), *extra],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    return Server(process, port, log)


def kill_session(server: Server) -> None:
    """SIGKILL to whatever is left of the server's session (its process group); bounded wait
    for the server process. For teardown, whatever happened before."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=STOP_LIMIT_S)


@contextlib.contextmanager
def killed_on_exit(server: Server) -> Iterator[Server]:
    """The server, and kill_session() on the way out: `with killed_on_exit(start_server(...))`."""
    try:
        yield server
    finally:
        kill_session(server)


def stop_session(server: Server, poll_s: float) -> None:
    """SIGTERM to the server's process group and a bounded wait, then SIGKILL to every process
    still running in its session until none is (bounded), then to the server itself."""
    session = server.process.pid
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=STOP_LIMIT_S)
    deadline = time.monotonic() + STOP_LIMIT_S
    while time.monotonic() < deadline:
        left = [pid for pid in session_members(session) if pid != os.getpid()]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(poll_s)
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(timeout=STOP_LIMIT_S)


# ---------------------------------------------------------------- waiting for /health


class ServerError(Exception):
    """The server did not come up; the message says how (callers add the log's tail)."""


class ServerExited(ServerError):
    """The server exited before /health answered."""

    def __init__(self, code: int) -> None:
        super().__init__(f"server exited with {code}")
        self.code = code


class NotHealthy(ServerError):
    """/health did not answer within the limit."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"no /health within {limit_s:g} s")
        self.limit_s = limit_s


def is_healthy(server: Server) -> bool:
    """True once vLLM's /health answers 200."""
    try:
        http_get(f"{server.url}/health", HEALTH_PROBE_LIMIT_S)
    except (OSError, http.client.HTTPException):
        return False
    return True


def wait_until_healthy(
    server: Server,
    limit_s: float,
    poll_s: float,
    *,
    started: float | None = None,
    progress: Callable[[float], None] | None = None,
    progress_every_s: float = 15.0,
) -> float:
    """Seconds from `started` (time.monotonic(); default: now) until /health answers, waiting
    at most limit_s from then; progress(seconds so far) every progress_every_s meanwhile.
    Raises ServerExited if the server exits first, NotHealthy when the time is up."""
    started = time.monotonic() if started is None else started
    next_progress = progress_every_s
    while (elapsed := time.monotonic() - started) < limit_s:
        if server.process.poll() is not None:
            raise ServerExited(server.process.returncode)
        if is_healthy(server):
            return time.monotonic() - started
        if progress is not None and elapsed >= next_progress:
            progress(elapsed)
            next_progress += progress_every_s
        time.sleep(poll_s)
    raise NotHealthy(limit_s)


# ---------------------------------------------------------------- HTTP on loopback


def http_get(url: str, limit_s: float) -> str:
    """GET a loopback URL; the body as text."""
    with LOOPBACK.open(url, timeout=limit_s) as response:
        body: bytes = response.read()
        return body.decode("utf-8", "replace")


def json_request(url: str, payload: Mapping[str, Any]) -> urllib.request.Request:
    """A POST of payload as JSON, for LOOPBACK.open()."""
    return urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )


def http_post_json(url: str, payload: Mapping[str, Any], limit_s: float) -> dict[str, Any]:
    """POST JSON to a loopback URL; the decoded JSON answer."""
    with LOOPBACK.open(json_request(url, payload), timeout=limit_s) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def completion_payload(max_tokens: int, **options: Any) -> dict[str, Any]:
    """A greedy /v1/completions request for PROMPT; `options` adds fields (ignore_eos...).
    It names no model: vLLM answers one that names none with the model it serves
    (`_is_model_supported` in vllm/entrypoints/serve/engine/serving.py, 0.27 and 0.32)."""
    return {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        **options,
    }


def metric_totals(url: str) -> dict[str, float]:
    """Every metric on the server's /metrics, summed over its label sets."""
    totals: dict[str, float] = {}
    for line in http_get(f"{url}/metrics", REQUEST_LIMIT_S).splitlines():
        fields = line.split()
        if fields and not line.startswith("#"):
            name = fields[0].split("{")[0]
            totals[name] = totals.get(name, 0.0) + float(fields[-1])
    return totals


def metric_total(url: str, name: str) -> float:
    """One metric on the server's /metrics, summed over its label sets (0 if absent)."""
    return metric_totals(url).get(name, 0.0)


# ---------------------------------------------------------------- the process tree


def parent_pids() -> dict[int, int]:
    """PID -> parent PID for every process, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text(encoding="utf-8", errors="replace")
                # The name field may hold spaces; the fields after its closing ")" do not.
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def process_tree(root: int) -> list[int]:
    """root and all its descendants, parents before children."""
    parents = parent_pids()
    tree = [root]
    for pid in tree:
        tree.extend(sorted(child for child, parent in parents.items() if parent == pid))
    return tree


def is_running(pid: int) -> bool:
    """True while the process exists and has not exited (a zombie has, only not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def session_members(session: int) -> list[int]:
    """Running processes in a session: the server's whole tree, whatever it forked."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session and is_running(int(entry)):
                    members.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
    return members


def survivors(pids: Sequence[int], poll_s: float) -> list[int]:
    """Bounded wait (STOP_LIMIT_S) for the processes to exit; those still running at the end."""
    deadline = time.monotonic() + STOP_LIMIT_S
    alive = [pid for pid in pids if is_running(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [pid for pid in alive if is_running(pid)]
    return alive


def command_line(pid: int) -> str:
    """A process's command line as ps shows it (vLLM renames its children: VLLM::Worker...)."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def mapped_files(pid: int) -> frozenset[str]:
    """Paths of the files a process has mapped (its loaded libraries among them)."""
    maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
    return frozenset(fields[-1] for fields in map(str.split, maps.splitlines()) if len(fields) >= 6)


def visible_environment(pid: int) -> dict[str, str]:
    """What /proc/PID/environ still shows. vLLM's engine-core and worker processes rename
    themselves with setproctitle, which zeroes the start of their environment block: there
    only the variables vLLM appended when it spawned them remain."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    entries = (entry.decode("utf-8", "replace") for entry in raw.split(b"\0"))
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


@dataclass(frozen=True)
class ProcessView:
    """What one process shows in /proc: its title, mapped files and visible environment."""

    pid: int
    title: str
    mapped: frozenset[str]
    environment: Mapping[str, str]

    def iomp(self) -> str | None:
        """The Intel OpenMP (libiomp5) file the process has loaded, if any."""
        return min((p for p in self.mapped if Path(p).name.startswith("libiomp5")), default=None)

    def maps_iomp(self) -> bool:
        """True when Intel OpenMP (libiomp5) is loaded in the process."""
        return self.iomp() is not None

    def __str__(self) -> str:
        return f"{self.pid} {self.title[:120]}"


def snapshot(pid: int) -> ProcessView | None:
    """What /proc shows of the process now, or None if it exited while being read."""
    try:
        return ProcessView(pid, command_line(pid), mapped_files(pid), visible_environment(pid))
    except (ProcessLookupError, FileNotFoundError):
        return None

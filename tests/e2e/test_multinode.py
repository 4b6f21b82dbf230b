"""End to end: vLLM across two "nodes" on loopback, each node started as an operator would.

vLLM 0.32's CPU platform runs across nodes in two ways, both with its multiprocessing
backend:

- data parallel: a primary (`--data-parallel-size 2 --data-parallel-size-local 1
  --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P`, serves the API) through
  the launcher, and a `--headless --data-parallel-start-rank 1` secondary started as plain
  `vllm serve` with vLLM's plugin installed (on PYTHONPATH): both doors in one pair, each
  node with its own engine core;
- tensor parallel 2 across nodes: `--nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1
  --master-port P`, rank 1 `--headless` (workers only), both nodes through the launcher.

What vLLM refuses (Ray on CPU; pipeline parallel with speculative decoding) is shown by
test_multinode_refusals.py. Each pair serves the tiny model with ngram speculative
decoding; the pairs run one after the other (module-scoped fixture with one parameter per
mode: pytest tears one pair down before it starts the next). Set VLLMCPULAUNCH_SKIP_E2E=1
to skip this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from vllm_server import (
    DRAFT_TOKENS_METRIC,
    SD_WARNING,
    STOP_LIMIT_S,
    Server,
    kill_session,
    process_tree,
    session_members,
    survivors,
)

from vllm_cpu_launch.verbs.verify import MODEL_ROLES

from .conftest import (
    MAX_TOKENS,
    POLL_INTERVAL_S,
    REAL_VLLM,
    complete,
    model_processes,
    plugin_lines,
    tail,
    tree_views,
    verify,
    wait_for_drafts,
    wait_for_health,
)
from .nodes import CLUSTER_STARTUP_LIMIT_S, Cluster, PluginDoor, start_cluster

pytestmark = REAL_VLLM


@pytest.fixture(scope="module", params=["data-parallel", "tensor-parallel"])
def cluster(
    request: pytest.FixtureRequest,
    vllm_env: Path,
    doctored_env: Path,
    tiny_model: Path,
    plugin_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """Both nodes of one mode, the primary healthy (it answers only once the secondary has
    joined); every process of both sessions killed on the way out, whatever happened. The
    data-parallel pair's headless node runs plain vLLM with the plugin, from doctored_env
    (the README's plugin step done: plain `vllm` runs there)."""
    mode: str = request.param
    plugin = PluginDoor(doctored_env, plugin_path) if mode == "data-parallel" else None
    started: list[Server] = []
    try:
        scratch = tmp_path_factory.mktemp(mode)
        pair = start_cluster(mode, vllm_env, tiny_model, scratch, started, plugin)
        seconds = wait_for_health(pair.primary, CLUSTER_STARTUP_LIMIT_S)
        if pair.secondary.process.poll() is not None:
            pytest.fail(f"the headless node exited\n{pair.tails()}")
        print(f"{mode}: both nodes up, /health after {seconds:.0f} s")
        yield pair
    finally:
        for server in started:
            kill_session(server)


def test_each_node_is_vllm_serve_itself(
    cluster: Cluster, vllm_env: Path, doctored_env: Path
) -> None:
    """The launcher execs into vLLM: nothing stands between the test and either node."""
    for role, server in cluster.nodes.items():
        env = doctored_env if role in cluster.plugged else vllm_env
        main = psutil.Process(server.process.pid)
        assert main.ppid() == os.getpid(), f"{role}: a process stands between test and vLLM"
        assert Path(main.exe()).resolve() == (env / "bin" / "python").resolve(), role
        assert main.cmdline()[1:3] == [str(env / "bin" / "vllm"), "serve"], role
        assert ("--headless" in main.cmdline()) == (role == "secondary")


def test_iomp_mapped_in_every_process_of_both_nodes(cluster: Cluster) -> None:
    """Every process of a launched node; every engine core and worker of a plugged one
    (its front process loaded torch's libgomp before any plugin ran)."""
    for role, server in cluster.nodes.items():
        processes = tree_views(server)
        titles = " ".join(process.title for process in processes)
        print(f"{cluster.mode} {role}: {[p.title.split()[0] for p in processes]}")
        assert "VLLM::Worker" in titles, f"{role}: {titles}"
        if role == "primary" or cluster.mode == "data-parallel":
            assert "VLLM::EngineCore" in titles, f"{role}: {titles}"
        mapping = model_processes(processes) if role in cluster.plugged else processes
        assert [str(p) for p in mapping if not p.maps_iomp()] == [], role


def test_no_process_preloads_libgomp(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        processes = tree_views(server)
        launched = "libiomp" in processes[0].environment.get("LD_PRELOAD", "")
        assert launched == (role not in cluster.plugged), role
        preloads = {str(p): p.environment.get("LD_PRELOAD", "") for p in processes}
        assert {name: value for name, value in preloads.items() if "libgomp" in value} == {}


def test_verify_passes_on_both_nodes(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        code, report = verify(server)
        assert code == 0, (role, report)
        judged = {p["verdict"] for p in report["processes"] if p["role"] in MODEL_ROLES.values()}
        assert judged == {"ok"}, role
        assert {p["verdict"] for p in report["processes"]} <= {"ok", "reported"}, role


def test_no_openmp_warning_on_either_node(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        assert SD_WARNING not in server.log_text(), f"{role}\n{tail(server)}"


def test_the_plugin_speaks_once_on_its_node_alone(cluster: Cluster) -> None:
    """The plugged node's front process planned (one line); its children stood down."""
    for role, server in cluster.nodes.items():
        expected = 1 if role in cluster.plugged else 0
        assert len(plugin_lines(server.log_text())) == expected, f"{role}\n{tail(server)}"


def test_completion_answers_and_drafts_are_counted(cluster: Cluster) -> None:
    answer = complete(cluster.primary)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert wait_for_drafts(cluster.primary) > 0, f"{DRAFT_TOKENS_METRIC} stayed 0"


def test_sigterm_stops_every_process_of_both_nodes(cluster: Cluster) -> None:
    # Runs last for each mode: it stops the pair.
    trees = {role: process_tree(server.process.pid) for role, server in cluster.nodes.items()}
    assert all(len(tree) > 1 for tree in trees.values()), trees
    for server in cluster.nodes.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.process.pid, signal.SIGTERM)
    codes = {}
    for role, server in cluster.nodes.items():
        try:
            codes[role] = server.process.wait(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{role} ignored SIGTERM for {STOP_LIMIT_S} s\n{cluster.tails()}")
    print(f"{cluster.mode}: exit codes after SIGTERM {codes}")
    for role, tree in trees.items():
        assert survivors(tree, POLL_INTERVAL_S) == [], role
        assert session_members(cluster.nodes[role].process.pid) == [], role

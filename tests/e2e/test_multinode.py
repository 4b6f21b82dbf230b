"""End to end: vLLM across two "nodes" on loopback, every node started through the launcher.

vLLM 0.32's CPU platform runs across nodes in two ways, both with its multiprocessing
backend, and each is started here as an operator would, one launcher per node:

- data parallel: a primary (`--data-parallel-size 2 --data-parallel-size-local 1
  --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P`, serves the API) and a
  `--headless --data-parallel-start-rank 1` secondary, each node with its own engine core;
- tensor parallel (and pipeline parallel) across nodes: `--nnodes 2 --node-rank 0|1
  --master-addr 127.0.0.1 --master-port P`, rank 1 `--headless` (workers only).

Ray is refused by vLLM on CPU (its CPU platform has no `ray_device_key`); that refusal is
shown by test_ray_refusal.py. Each pair serves the tiny model with ngram speculative
decoding; the pairs run one after the other (module-scoped fixture with one parameter per
mode: pytest tears one pair down before it starts the next). Set VLLM_CPU_LAUNCH_SKIP_E2E=1
to skip this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from vllm_server import (
    DRAFT_TOKENS_METRIC,
    SD_WARNING,
    STOP_LIMIT_S,
    Server,
    free_loopback_port,
    isolated_environment,
    kill_session,
    process_tree,
    session_members,
    start_server,
    survivors,
)

from .conftest import (
    MAX_TOKENS,
    POLL_INTERVAL_S,
    SKIP_VARIABLE,
    complete,
    tail,
    tree_views,
    verify,
    wait_for_drafts,
    wait_for_health,
)

REPO = Path(__file__).resolve().parents[2]
# Two vLLM trees share 2 CPUs here: allow more than one server's start-up time.
CLUSTER_STARTUP_LIMIT_S = 420

pytestmark = pytest.mark.skipif(
    os.environ.get(SKIP_VARIABLE) == "1", reason=f"{SKIP_VARIABLE}=1 skips the real vLLM test"
)


@dataclass(frozen=True)
class Cluster:
    """Two nodes of one vLLM deployment: the primary serves the API, the secondary is headless."""

    mode: str
    primary: Server
    secondary: Server

    @property
    def nodes(self) -> dict[str, Server]:
        """Both nodes by role, for messages that say which one failed."""
        return {"primary": self.primary, "secondary": self.secondary}

    def tails(self) -> str:
        """The end of both logs."""
        return "\n".join(tail(server) for server in self.nodes.values())


def node_arguments(mode: str, rank: int, ports: dict[str, int]) -> list[str]:
    """The parallel options of node `rank` (0 primary, 1 headless) in `mode`, as vLLM 0.32
    documents them for a two-node deployment; the head's address is loopback here."""
    headless = ["--headless"] if rank else []
    if mode == "data-parallel":
        shared = [
            "--data-parallel-size",
            "2",
            "--data-parallel-size-local",
            "1",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(ports["rpc"]),
        ]
        return [*shared, *headless, *(["--data-parallel-start-rank", "1"] if rank else [])]
    size_option = {"tensor-parallel": "--tensor-parallel-size"}[mode]
    return [
        size_option,
        "2",
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(ports["master"]),
        *headless,
    ]


def start_node(vllm_env: Path, model: Path, scratch: Path, arguments: list[str]) -> Server:
    """One node: the launcher (default settings) starting `serve MODEL ... ARGUMENTS`, in an
    environment without OpenMP or launcher settings, its log and vLLM cache under scratch."""
    scratch.mkdir()
    env = isolated_environment(scratch, ("LD_PRELOAD",), ("KMP_", "VLLM_CPU_LAUNCH_"))
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(vllm_env / "bin" / "vllm")]
    return start_server(launcher, model, scratch, env, cwd=REPO, extra=arguments)


@pytest.fixture(scope="module", params=["data-parallel", "tensor-parallel"])
def cluster(
    request: pytest.FixtureRequest,
    vllm_env: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """Both nodes of one mode, the primary healthy (it answers only once the secondary has
    joined); every process of both sessions killed on the way out, whatever happened."""
    mode: str = request.param
    scratch = tmp_path_factory.mktemp(mode)
    ports = {"rpc": free_loopback_port(), "master": free_loopback_port()}
    started: list[Server] = []
    try:
        for rank, role in enumerate(("primary", "secondary")):
            arguments = node_arguments(mode, rank, ports)
            started.append(start_node(vllm_env, tiny_model, scratch / role, arguments))
        pair = Cluster(mode, *started)
        seconds = wait_for_health(pair.primary, CLUSTER_STARTUP_LIMIT_S)
        if pair.secondary.process.poll() is not None:
            pytest.fail(f"the headless node exited\n{pair.tails()}")
        print(f"{mode}: both nodes up, /health after {seconds:.0f} s")
        yield pair
    finally:
        for server in started:
            kill_session(server)


def test_each_launcher_execs_into_its_node(cluster: Cluster, vllm_env: Path) -> None:
    for role, server in cluster.nodes.items():
        main = psutil.Process(server.process.pid)
        assert main.ppid() == os.getpid(), f"{role}: a process stands between test and vLLM"
        assert Path(main.exe()).resolve() == (vllm_env / "bin" / "python").resolve(), role
        assert main.cmdline()[1:3] == [str(vllm_env / "bin" / "vllm"), "serve"], role
        assert ("--headless" in main.cmdline()) == (role == "secondary")


def test_iomp_mapped_in_every_process_of_both_nodes(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        processes = tree_views(server)
        titles = " ".join(process.title for process in processes)
        print(f"{cluster.mode} {role}: {[p.title.split()[0] for p in processes]}")
        assert "VLLM::Worker" in titles, f"{role}: {titles}"
        if role == "primary" or cluster.mode == "data-parallel":
            assert "VLLM::EngineCore" in titles, f"{role}: {titles}"
        assert [str(p) for p in processes if not p.maps_iomp()] == [], role


def test_no_process_preloads_libgomp(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        processes = tree_views(server)
        assert "libiomp" in processes[0].environment.get("LD_PRELOAD", ""), role
        preloads = {str(p): p.environment.get("LD_PRELOAD", "") for p in processes}
        assert {name: value for name, value in preloads.items() if "libgomp" in value} == {}


def test_verify_passes_on_both_nodes(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        code, report = verify(server)
        assert code == 0, (role, report)
        assert {p["verdict"] for p in report["processes"]} == {"ok"}, role


def test_no_openmp_warning_on_either_node(cluster: Cluster) -> None:
    for role, server in cluster.nodes.items():
        assert SD_WARNING not in server.log_text(), f"{role}\n{tail(server)}"


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

"""Nodes of a multi-node vLLM deployment on loopback, each started through the launcher."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_server import Server, free_loopback_port, start_server

from .conftest import RUN_CACHE, isolated_environment, tail

REPO = Path(__file__).resolve().parents[2]
# Two vLLM trees share 2 CPUs here: allow more than one server's start-up time.
CLUSTER_STARTUP_LIMIT_S = 420
# The size option of each mode across nodes with the mp backend.
SIZE_OPTIONS = {
    "tensor-parallel": "--tensor-parallel-size",
    "pipeline-parallel": "--pipeline-parallel-size",
}


@dataclass(frozen=True)
class Cluster:
    """Two nodes of one vLLM deployment: the primary serves the API, the secondary is headless;
    `plugged`: the roles started as plain `vllm` with vLLM's plugin (the others through the
    launcher)."""

    mode: str
    primary: Server
    secondary: Server
    plugged: frozenset[str] = frozenset()

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
    return [
        SIZE_OPTIONS[mode],
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


@dataclass(frozen=True)
class PluginDoor:
    """A node started as plain `vllm` with the plugin: from `doctored_env` (where plain `vllm`
    runs: the README's plugin step done), the plugin in `path` on PYTHONPATH."""

    doctored_env: Path
    path: Path


def start_node(
    vllm_env: Path, model: Path, scratch: Path, arguments: list[str], plugin: PluginDoor | None
) -> Server:
    """One node starting `serve MODEL ... ARGUMENTS`, in an environment without OpenMP or
    launcher settings, its log and vLLM cache under scratch: through the launcher (default
    settings) on vllm_env, or, with `plugin`, as plain `vllm` with the plugin."""
    scratch.mkdir()
    env = isolated_environment(
        scratch, ("LD_PRELOAD",), ("KMP_", "VLLMCPULAUNCH_"), RUN_CACHE["vllm"]
    )
    if plugin is not None:
        env["PYTHONPATH"] = str(plugin.path)
        vllm = [str(plugin.doctored_env / "bin" / "vllm")]
        return start_server(vllm, model, scratch, env, cwd=REPO, extra=arguments)
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(vllm_env / "bin" / "vllm")]
    return start_server(launcher, model, scratch, env, cwd=REPO, extra=arguments)


def start_cluster(
    mode: str,
    vllm_env: Path,
    model: Path,
    scratch: Path,
    started: list[Server],
    plugin: PluginDoor | None = None,
    extra: Sequence[str] = (),
) -> Cluster:
    """Both nodes of `mode` (the primary first), on fresh loopback ports, logs under
    scratch/primary and scratch/secondary, through the launcher; with `plugin`, the headless
    secondary is plain `vllm` with the plugin instead; `extra`: options both nodes get.
    Each node is appended to `started` as soon as it runs, so the caller's teardown stops
    it whatever happens next."""
    ports = {"rpc": free_loopback_port(), "master": free_loopback_port()}
    for rank, role in enumerate(("primary", "secondary")):
        arguments = [*node_arguments(mode, rank, ports), *extra]
        node_plugin = plugin if rank else None
        started.append(start_node(vllm_env, model, scratch / role, arguments, node_plugin))
    plugged = frozenset({"secondary"} if plugin is not None else ())
    primary, secondary = started[-2:]
    return Cluster(mode, primary, secondary, plugged)

"""vLLM #43240 against vLLM's own binding code: a process whose CPUs are on node 1 of a
two-node host, memory nodes 0-1 allowed. vLLM's `OMPProcessManager` binds its worker to
the first memory node (`cpu_resource_utils.get_visible_memory_node`), node 0, and so to no
CPU; with the plan's `CPU_VISIBLE_MEMORY_NODES` to node 1's CPUs. Only vLLM's two readers of
the machine are replaced (the memory nodes allowed, `get_memory_affinity`; the topology,
`_get_cpu_list`'s lscpu output): the affinity is the process's real one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_cpu_launch.gather import version_key
from vllm_cpu_launch.shape import read_shape, visible_nodes

from ..test_shape import numa_host
from .conftest import WINDOW_EDGES, last_json_line_of

# In the vLLM environment's Python: the worker's CPU lists as vLLM's auto binding makes them.
BIND = """
import json, os, sys, types
given = json.load(sys.stdin)
os.sched_setaffinity(0, given["allowed"])
os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # vLLM's default: auto
os.environ.pop("CPU_VISIBLE_MEMORY_NODES", None)
if given["visible"]:
    os.environ["CPU_VISIBLE_MEMORY_NODES"] = given["visible"]
import vllm.utils.cpu_resource_utils as cr
from vllm.utils.ompmultiprocessing import OMPProcessManager
lscpu = json.dumps({"cpus": [{"cpu": c, "core": c, "node": n} for c, n in given["layout"]]})
cr.get_memory_affinity = lambda pid=0: given["mems"]
cr.subprocess = types.SimpleNamespace(check_output=lambda *args, **kwargs: lscpu)
parallel = types.SimpleNamespace(
    local_world_size=1, data_parallel_rank_local=None, _api_process_count=1
)
config = types.SimpleNamespace(parallel_config=parallel, kv_transfer_config=None)
manager = OMPProcessManager(config)
print(json.dumps({"cpu_lists": manager.cpu_lists}))
"""
LIMIT_S = 300  # a bound a hang exceeds: importing vLLM and torch


@pytest.mark.parametrize("release", WINDOW_EDGES)
def test_the_plans_nodes_give_the_worker_its_cpus(
    tmp_path: Path, release_env: Callable[..., Path], release: str
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"one CPU here ({cpus}): a two-node host needs a CPU on each node")
    first, last = cpus[:-1], cpus[-1]
    layout = [(cpu, 0) for cpu in first] + [(last, 1)]
    # The launcher's plan on the same host: its shape read from a tree laid out so.
    root = numa_host(tmp_path, {0: ",".join(map(str, first)), 1: str(last)}, "0-1")
    visible = visible_nodes(read_shape({last}, str(root)), {}, version_key(release))
    assert visible == "1"
    environment = release_env(release)
    given = {"allowed": [last], "layout": layout, "mems": [0, 1]}
    plain = last_json_line_of(environment, BIND, {**given, "visible": None}, LIMIT_S)
    planned = last_json_line_of(environment, BIND, {**given, "visible": visible}, LIMIT_S)
    assert plain["cpu_lists"] == [[]]  # vLLM #43240: node 0, none of the allowed CPUs
    assert planned["cpu_lists"] == [[last]]

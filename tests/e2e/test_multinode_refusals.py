"""End to end: what vLLM 0.32 on CPU refuses across nodes, whatever the launcher does.

Ray.
docs/operating.md once had a Ray recipe (`exec -- ray start`, then `vllm serve
--distributed-executor-backend ray`); it cannot work: vLLM's CPU platform has no
`ray_device_key` (vllm/platforms/interface.py: "empty string means the device does not
support ray"), and `initialize_ray_cluster` (vllm/v1/executor/ray_utils.py) raises
`ValueError: current platform cpu does not support ray.` right after `ray.init()`. This test
shows that refusal with a real Ray (2.60.0, installed beside the vLLM environment by
scripts/vllm_env.py --ray-overlay, so no other test's vLLM sees it): the engine core starts
a local Ray instance, then vLLM refuses, and the server exits.

Pipeline parallel with speculative decoding. vLLM's model runner creates its drafter on the
last pipeline stage only (vllm/v1/worker/gpu_model_runner.py: `if self.speculative_config
and get_pp_group().is_last_rank`), then reads `self.drafter` on every stage when it
allocates the KV cache (`initialize_kv_cache_tensors`), so stage 0's worker fails with
`AttributeError: 'CPUModelRunner' object has no attribute 'drafter'` and the engine does
not start. Shown with the same two loopback nodes as test_multinode.py, `--pipeline-parallel-size
2` in place of `--tensor-parallel-size 2`, and `--enforce-eager`: without it each node
compiles its stage first (42 s of the 134 s this test took alone here), and the failure
comes after, the same.

Set VLLMCPULAUNCH_SKIP_E2E=1 to skip this module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import (
    ENV_SETUP_LIMIT_S,
    STOP_LIMIT_S,
    Server,
    kill_session,
    killed_on_exit,
    prepare_env_command,
    start_server,
)

from .conftest import (
    POLL_INTERVAL_S,
    REAL_VLLM,
    RUN_CACHE,
    isolated_environment,
    run_script,
    tail,
)
from .nodes import CLUSTER_STARTUP_LIMIT_S, start_cluster

REPO = Path(__file__).resolve().parents[2]
RAY_REFUSAL = "ValueError: current platform cpu does not support ray."
PP_SD_FAILURE = "AttributeError: 'CPUModelRunner' object has no attribute 'drafter'"
# Printed by ray.init() when it starts a local instance: Ray really ran before the refusal.
RAY_STARTED = "Started a local Ray instance"
REFUSAL_LIMIT_S = 420
# No torch.compile (vllm/config/vllm.py: enforce_eager sets compilation mode NONE): the
# pipeline-parallel failure is in the KV cache's allocation, after the compile.
EAGER = ("--enforce-eager",)
RUN_MARKER = "VLLMCPULAUNCH_TEST_RAY_RUN"

pytestmark = REAL_VLLM


@pytest.fixture(scope="module")
def ray_overlay() -> Path:
    """The directory holding Ray 2.60.0 for PYTHONPATH, installed on first use."""
    return Path(run_script([*prepare_env_command(), "--ray-overlay"], ENV_SETUP_LIMIT_S))


def marked_processes(marker: str) -> list[int]:
    """Processes whose environment holds RUN_MARKER=marker: all that this run started,
    Ray's own daemons included, whichever session they put themselves in."""
    found = []
    needle = f"{RUN_MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
    return found


@contextlib.contextmanager
def all_killed(marker: str) -> Iterator[None]:
    """SIGKILL, on the way out, to every process of this run (bounded wait until none is)."""
    try:
        yield
    finally:
        deadline = time.monotonic() + STOP_LIMIT_S
        while (left := marked_processes(marker)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(POLL_INTERVAL_S)


@contextlib.contextmanager
def removed_on_exit(directory: Path) -> Iterator[None]:
    """The directory (Ray's temp dir) removed on the way out."""
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_vllm_refuses_ray_on_cpu(
    vllm_env: Path, tiny_model: Path, ray_overlay: Path, tmp_path: Path
) -> None:
    marker = uuid.uuid4().hex
    # Ray's sockets live under its temp dir, whose path must stay short (AF_UNIX limit).
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = {
        **isolated_environment(
            tmp_path,
            ("LD_PRELOAD",),
            ("KMP_", "VLLMCPULAUNCH_", "RAY_"),
            RUN_CACHE["vllm"],
        ),
        "PYTHONPATH": str(ray_overlay),
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_USAGE_STATS_ENABLED": "0",
        # Nothing of Ray in the user's home (it would save a token to ~/.ray).
        "RAY_AUTH_MODE": "disabled",
        "HOME": str(tmp_path / "home"),
        # Ray then takes the loopback address for its node (ray/_private/services.py,
        # get_node_ip_address), so its traffic stays on 127.0.0.1.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        RUN_MARKER: marker,
    }
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(vllm_env / "bin" / "vllm")]
    extra = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    with all_killed(marker), removed_on_exit(ray_tmp):
        server = start_server(launcher, tiny_model, tmp_path, env, cwd=REPO, extra=extra)
        with killed_on_exit(server):
            try:
                code = server.process.wait(timeout=REFUSAL_LIMIT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"vLLM with Ray neither served nor exited\n{tail(server)}")
        log = server.log_text()
    assert code != 0, tail(server)
    assert f"preloading {vllm_env / 'lib' / 'libiomp5.so'}" in log, tail(server)
    assert RAY_STARTED in log, tail(server)
    assert RAY_REFUSAL in log, tail(server)


def test_pipeline_parallel_with_speculative_decoding_fails_in_vllm(
    vllm_env: Path, tiny_model: Path, tmp_path: Path
) -> None:
    started: list[Server] = []
    try:
        pair = start_cluster(
            "pipeline-parallel", vllm_env, tiny_model, tmp_path, started, extra=EAGER
        )
        try:
            code = pair.primary.process.wait(timeout=CLUSTER_STARTUP_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pipeline parallel with SD neither failed nor exited\n{pair.tails()}")
        logs = {role: server.log_text() for role, server in pair.nodes.items()}
    finally:
        for server in started:
            kill_session(server)
    assert code != 0, pair.tails()
    iomp = vllm_env / "lib" / "libiomp5.so"
    assert all(f"preloading {iomp}" in log for log in logs.values()), pair.tails()
    assert "Worker_PP0" in logs["primary"] and PP_SD_FAILURE in logs["primary"], pair.tails()

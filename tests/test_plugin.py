"""vLLM's plugin (vllm_cpu_launch/plugin.py): what it decides, where vLLM cannot be real here.

The real vLLM CPU build loads the plugin in tests/e2e/test_plugin.py. Here a stand-in
`vllm.platforms` (a file on disk, with vLLM's interface: `current_platform.is_cpu()` and
the classmethod `check_and_update_config(vllm_config)`) stands for the cases this machine
cannot be: a CUDA platform, and the ones that are cheaper to reach without starting vLLM.
Each case runs in a fresh interpreter, as each vLLM process is one; the plugin is the one
installed in this venv (its entry point, as vLLM finds it), and the library it finds is
the real libiomp5.so the intel-openmp wheel put into this venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SystemHost, clean_environ
from vllm_cpu_launch.handoff import PLANNED_VARIABLE, PLUGIN_VARIABLE
from vllm_cpu_launch.plugin import in_process_message, one_worker

PLATFORMS = """\
import os


class Platform:
    device = {device!r}

    def is_cpu(self):
        if self.device == "broken":
            raise RuntimeError("a platform that fails")
        return self.device == "cpu"

    @classmethod
    def check_and_update_config(cls, vllm_config):
        # vLLM decides its children's LD_PRELOAD here: record what it sees.
        vllm_config.seen.append(os.environ.get("LD_PRELOAD"))
        return "vLLM's own result"


current_platform = Platform()
"""
# vLLM's offline engine (vllm/v1/engine/llm_engine.py): `from_engine_args` builds the
# configuration, which calls check_and_update_config (here: `build`).
OFFLINE_ENGINE = """\
class LLMEngine:
    @classmethod
    def from_engine_args(cls, build):
        return build()
"""
# What vLLM does in a process: load the plugin (more than once, as several entry points
# may), then build configurations, each calling check_and_update_config.
# What both harnesses start with: vLLM's logger kept, and our entry point found as vLLM does.
LOGGED_PLUGIN = """\
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
vllm_logger = logging.getLogger("vllm")
vllm_logger.addHandler(Keep())
vllm_logger.setLevel(logging.DEBUG)

(plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "vllm_cpu_launch"]
"""
PROCESS = (
    """\
import json, logging, os, sys, types
from importlib.metadata import entry_points

"""
    + LOGGED_PLUGIN
    + """\
register = plugin.load()
register()
register()
from vllm.platforms import current_platform

case = json.loads(sys.argv[1])
sys.argv = case.get("argv", sys.argv)  # the process's command line, as vLLM's CLI has it
config = types.SimpleNamespace(seen=[])
if "argv" in case:
    pass  # a configuration without the field: the plugin reads the command line
elif case["sd"]:
    config.speculative_config = types.SimpleNamespace(method="ngram")
else:
    config.speculative_config = None
if case.get("parallel", True):
    config.parallel_config = types.SimpleNamespace(
        tensor_parallel_size=case.get("tp", 1), pipeline_parallel_size=1, data_parallel_size=1
    )
def build():
    return type(current_platform).check_and_update_config(config)
if case.get("offline"):  # vLLM's offline engine builds the configuration (LLM(...))
    from vllm.v1.engine.llm_engine import LLMEngine
    results = [LLMEngine.from_engine_args(build) for _ in range(2)]
else:
    results = [build() for _ in range(2)]
wrapped = getattr(type(current_platform).check_and_update_config, "_vllm_cpu_launch_wrapped", False)
names = ("LD_PRELOAD", "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND", "VLLMCPULAUNCH_PLANNED")
print(json.dumps({
    "results": results,
    "seen": config.seen,
    "wrapped": wrapped,
    "env": {name: os.environ.get(name) for name in names},
    "records": records,
}))
"""
)
# The process as vLLM starts it: its front end, or (case["spawned"]) a process spawned by
# multiprocessing, as vLLM starts its engine cores and workers.
HARNESS = f"""\
import json, multiprocessing, sys
if json.loads(sys.argv[1]).get("spawned"):
    child = multiprocessing.get_context("spawn").Process(target=exec, args=({PROCESS!r}, {{}}))
    child.start()
    child.join()
    sys.exit(child.exitcode)
exec({PROCESS!r}, {{}})
"""
LIBRARY = str(Path(sys.prefix) / "lib" / "libiomp5.so")
PREFIX = "vllm-cpu-launch plugin: "


def run_standin(
    tmp_path: Path,
    platforms: str,
    script: str,
    argument: object,
    variables: dict[str, str] | None,
) -> dict[str, Any]:
    """Run `script` (its argument as JSON) in a fresh Python whose `vllm` is a stand-in
    package with `platforms` as vllm/platforms/__init__.py; what it printed, as JSON."""
    package = tmp_path / "standin" / "vllm"
    (package / "platforms").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "platforms" / "__init__.py").write_text(platforms)
    (package / "v1" / "engine").mkdir(parents=True, exist_ok=True)
    (package / "v1" / "__init__.py").write_text("")
    (package / "v1" / "engine" / "__init__.py").write_text("")
    (package / "v1" / "engine" / "llm_engine.py").write_text(OFFLINE_ENGINE)
    environ = clean_environ(tmp_path, **(variables or {}))
    environ["PYTHONPATH"] = f"{package.parent}:{environ['PYTHONPATH']}"
    completed = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argument)],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    outcome: dict[str, Any] = json.loads(completed.stdout)
    return outcome


def run_vllm_process(
    tmp_path: Path,
    variables: dict[str, str] | None = None,
    *,
    device: str = "cpu",
    sd: bool = True,
    case: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One vLLM process (the stand-in platform `device`, a configuration with SD or not,
    and `case`'s parallel settings) with the plugin; what happened."""
    platforms = PLATFORMS.format(device=device)
    argument = {"sd": sd, **(case or {})}
    outcome = run_standin(tmp_path, platforms, HARNESS, argument, variables)
    assert outcome["results"] == ["vLLM's own result"] * 2
    return outcome


def said(outcome: dict[str, Any], level: str) -> list[str]:
    return [text for kind, text in outcome["records"] if kind == level]


def test_the_entry_point_is_installed_as_vllm_looks_for_it() -> None:
    (plugin,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "vllm_cpu_launch"
    ]
    assert plugin.value == "vllm_cpu_launch.plugin:register"


def test_sd_preloads_intel_openmp_before_vllm_decides(
    tmp_path: Path, system_host: SystemHost
) -> None:
    outcome = run_vllm_process(tmp_path)
    assert outcome["wrapped"]
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert outcome["seen"] == [preload, preload]  # both calls: vLLM sees it, once added
    assert outcome["env"]["LD_PRELOAD"] == preload and outcome["env"]["KMP_BLOCKTIME"] == "5"
    assert outcome["env"][PLANNED_VARIABLE] is None  # LD_PRELOAD shows the choice
    (line,) = said(outcome, "INFO")  # once, though vLLM built two configurations
    assert line.startswith(f"{PREFIX}speculative decoding requested by vLLM's speculative_config")
    assert f"preloading {LIBRARY} (intel, from vllm-environment)" in line


def test_a_kept_block_time_is_said_to_stop_at_the_workers_vllm_binds(tmp_path: Path) -> None:
    """The plugin door's INFO line says where the user's KMP_BLOCKTIME reaches, and that
    vLLM sets 5 in each worker it binds (VLLM_CPU_OMP_THREADS_BIND unset: it binds)."""
    outcome = run_vllm_process(tmp_path, {"KMP_BLOCKTIME": "1"})
    assert outcome["env"]["KMP_BLOCKTIME"] == "1"  # kept
    (line,) = said(outcome, "INFO")
    assert (
        "KMP_BLOCKTIME=1 in the front end and engine core; KMP_BLOCKTIME=5 in the workers "
        "vLLM binds (VLLM_CPU_OMP_THREADS_BIND=nobind keeps yours)" in line
    )
    unbound = run_vllm_process(
        tmp_path / "nobind", {"KMP_BLOCKTIME": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    )
    assert "in the workers vLLM binds" not in said(unbound, "INFO")[0]


def test_without_sd_the_children_get_what_vllm_makes(tmp_path: Path) -> None:
    outcome = run_vllm_process(tmp_path, sd=False)
    assert outcome["seen"] == [None, None]
    assert set(outcome["env"].values()) == {None}
    (line,) = said(outcome, "INFO")
    assert "no speculative decoding requested" in line


@pytest.mark.parametrize("device", ["cuda", "broken"])
def test_another_platform_is_left_alone(tmp_path: Path, device: str) -> None:
    outcome = run_vllm_process(tmp_path, device=device)
    assert not outcome["wrapped"] and outcome["seen"] == [None, None]
    assert set(outcome["env"].values()) == {None}
    warnings = said(outcome, "WARNING")
    if device == "broken":  # the platform's own failure is said, not raised into vLLM
        assert len(warnings) == 1 and "a platform that fails" in warnings[0]
    else:
        assert warnings == [] and said(outcome, "INFO") == []


@pytest.mark.parametrize(
    ("variables", "spawned"),
    [
        ({"LD_PRELOAD": "/torch/lib/libgomp.so.1"}, True),  # an engine core or worker of vLLM
        ({"LD_PRELOAD": LIBRARY}, True),  # ... whose front end chose Intel OpenMP
        ({PLANNED_VARIABLE: "launcher"}, False),  # the launcher kept libgomp here
        ({PLANNED_VARIABLE: "launcher:started", "LD_PRELOAD": LIBRARY}, False),  # it preloaded
        ({PLANNED_VARIABLE: "launcher:started"}, False),  # a start without SD
        ({PLUGIN_VARIABLE: "0"}, False),
        ({PLUGIN_VARIABLE: "off"}, False),
        ({"VLLM_PLUGINS": "vllm_cpu_launch", PLUGIN_VARIABLE: "false"}, False),
    ],
)
def test_where_a_choice_was_made_or_it_is_switched_off_it_wraps_nothing(
    tmp_path: Path, variables: dict[str, str], spawned: bool
) -> None:
    outcome = run_vllm_process(tmp_path, variables, case={"spawned": spawned})
    assert not outcome["wrapped"] and outcome["records"] == []
    assert outcome["seen"] == [variables.get("LD_PRELOAD")] * 2


def test_a_front_end_with_a_runtime_in_ld_preload_keeps_it_and_says_so(
    tmp_path: Path, debian_root: Path
) -> None:
    """vLLM's official CPU image sets LD_PRELOAD (tcmalloc, then its libiomp5) for every
    process: in the front end the plan keeps it, adds nothing, and says so in one line;
    the processes vLLM spawns from it say nothing."""
    tcmalloc = debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    preload = f"{tcmalloc}:{LIBRARY}"
    outcome = run_vllm_process(tmp_path, {"LD_PRELOAD": preload})
    assert outcome["wrapped"] and outcome["seen"] == [preload] * 2
    assert outcome["env"] == {
        "LD_PRELOAD": preload,
        "KMP_BLOCKTIME": None,
        "VLLM_CPU_OMP_THREADS_BIND": None,
        PLANNED_VARIABLE: None,
    }
    ((level, line),) = outcome["records"]
    assert level == "INFO" and line.startswith(f"{PREFIX}speculative decoding requested")
    assert f"kept as set, nothing added; keeping your {LIBRARY} (intel" in line
    spawned = run_vllm_process(tmp_path / "child", {"LD_PRELOAD": preload}, case={"spawned": True})
    assert not spawned["wrapped"] and spawned["records"] == []


def test_the_config_file_switch(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("plugin: off\n")
    outcome = run_vllm_process(tmp_path, {"VLLMCPULAUNCH_CONFIG": str(config)})
    assert outcome["seen"] == [None, None]
    (line,) = said(outcome, "INFO")
    assert line == f"{PREFIX}switched off (plugin: off, from {config}); vLLM unchanged"


def test_the_old_switch_is_obeyed_and_said_deprecated_once_in_the_front_end(
    tmp_path: Path,
) -> None:
    """VLLM_CPU_LAUNCH_PLUGIN=0 still stands the plugin down before it reads a setting;
    the front end says once (vLLM loads plugins once, the harness registers twice) that
    the name is deprecated and which to use; the processes it spawns say nothing."""
    old = {"VLLM_CPU_LAUNCH_PLUGIN": "0"}
    outcome = run_vllm_process(tmp_path, old)
    assert not outcome["wrapped"] and outcome["seen"] == [None, None]
    ((level, line),) = outcome["records"]
    assert level == "WARNING" and line.startswith(f"{PREFIX}VLLM_CPU_LAUNCH_PLUGIN is deprecated")
    assert line.endswith(f"rename it to {PLUGIN_VARIABLE}")
    spawned = run_vllm_process(tmp_path / "child", old, case={"spawned": True})
    assert not spawned["wrapped"] and spawned["records"] == []
    both = run_vllm_process(tmp_path / "both", {**old, PLUGIN_VARIABLE: "0"})
    ((level, line),) = both["records"]
    assert line.endswith(f"(ignored: {PLUGIN_VARIABLE} is set too)")


def test_iomp_never_keeps_libgomp_and_marks_it(tmp_path: Path) -> None:
    outcome = run_vllm_process(tmp_path, {"VLLMCPULAUNCH_IOMP": "never"})
    assert outcome["seen"] == [None, None]
    assert outcome["env"][PLANNED_VARIABLE] == "plugin"
    (line,) = said(outcome, "INFO")
    assert line.startswith(
        f"{PREFIX}VLLMCPULAUNCH_IOMP=never; vLLM's engine processes start unchanged"
    )


def test_a_broken_config_is_said_and_vllm_goes_on(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("iomp: sometimes\n")
    outcome = run_vllm_process(tmp_path, {"VLLMCPULAUNCH_CONFIG": str(config)})
    assert outcome["seen"] == [None, None]
    (warning,) = said(outcome, "WARNING")
    assert str(config) in warning and "'sometimes' is not one of auto, always, never" in warning


def test_a_config_with_a_yaml_alias_is_one_short_warning_and_vllm_goes_on(tmp_path: Path) -> None:
    """The plugin reads the launcher's config inside vLLM: an alias bomb there (issue 45)
    is refused as the launcher refuses it, in one warning, and vLLM starts unchanged."""
    config = tmp_path / "config.yaml"
    levels = [f"&l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 6)]
    config.write_text(f"iomp: [&l0 [x, x, x, x, x, x, x, x, x], {', '.join(levels)}]\n")
    outcome = run_vllm_process(tmp_path, {"VLLMCPULAUNCH_CONFIG": str(config)})
    assert outcome["seen"] == [None, None]
    (warning,) = said(outcome, "WARNING")
    assert warning == (
        f"{PREFIX}{config}:1:46: holds a YAML alias (of anchor 'l0'); write each value out: "
        "a config file takes none; vLLM starts as it would without the plugin"
    )


def test_a_configuration_it_cannot_read_is_said_and_vllm_goes_on(tmp_path: Path) -> None:
    outcome = run_vllm_process(tmp_path, case={"parallel": False})
    assert outcome["seen"] == [None, None]
    (warning,) = said(outcome, "WARNING")
    assert warning.startswith(f"{PREFIX}could not plan (AttributeError(")


def test_an_engine_in_this_process_is_said_once_with_the_launcher_command(
    tmp_path: Path,
) -> None:
    variables = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    outcome = run_vllm_process(tmp_path, variables, case={"offline": True})
    assert outcome["seen"] == [None, None] and set(outcome["env"].values()) == {None}
    (warning,) = said(outcome, "WARNING")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in warning
    assert f"start it with: vllm-cpu-launch exec -- {sys.executable} -c " in warning


def test_a_server_with_multiprocessing_off_still_spawns_its_engine_and_is_planned(
    tmp_path: Path, system_host: SystemHost
) -> None:
    """vLLM honours VLLM_ENABLE_V1_MULTIPROCESSING=0 in its offline engine only: a
    configuration built elsewhere (`vllm serve`, whose AsyncLLM spawns EngineCore) is
    planned as without it, and no line says the engine runs in this process."""
    plain = run_vllm_process(tmp_path / "plain")
    off = run_vllm_process(tmp_path / "off", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert off["seen"] == plain["seen"] == [system_host.preload(LIBRARY)] * 2
    assert off["env"] == plain["env"]
    assert said(off, "WARNING") == [] and said(off, "INFO") == said(plain, "INFO")


def test_in_process_message_quotes_the_command() -> None:
    message = in_process_message("x", ["/venv/bin/python", "/venv/bin/vllm", "serve", "a b"])
    assert message.endswith(
        "start it with: vllm-cpu-launch exec -- /venv/bin/python /venv/bin/vllm serve 'a b'"
    )


@pytest.mark.parametrize(
    ("sizes", "single"),
    [((1, 1, 1, 1), True), ((2, 1, 1, 1), False), ((1, 2, 1, 1), False), ((1, 1, 2, 1), False)],
)
def test_one_worker_reads_vllms_parallel_config(sizes: tuple[int, ...], single: bool) -> None:
    tp, pp, dp, nodes = sizes

    class Parallel:
        tensor_parallel_size, pipeline_parallel_size, data_parallel_size, nnodes = tp, pp, dp, nodes

    class Config:
        parallel_config = Parallel()

    assert one_worker(Config()) is single


def test_without_the_field_in_vllms_configuration_the_command_line_decides(
    tmp_path: Path, system_host: SystemHost
) -> None:
    argv = ["/venv/bin/vllm", "serve", "m", "-sc", '{"method":"ngram","num_speculative_tokens":3}']
    outcome = run_vllm_process(tmp_path, case={"argv": argv})
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert outcome["seen"] == [preload, preload]
    (line,) = said(outcome, "INFO")
    assert line.startswith(f"{PREFIX}speculative decoding requested by -sc")
    plain = run_vllm_process(tmp_path / "plain", case={"argv": ["/venv/bin/vllm", "serve", "m"]})
    assert plain["seen"] == [None, None]


def test_an_engine_in_this_process_that_the_plan_keeps_on_libgomp_gets_no_advice(
    tmp_path: Path,
) -> None:
    variables = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLMCPULAUNCH_IOMP": "never"}
    outcome = run_vllm_process(tmp_path, variables, case={"offline": True})
    assert said(outcome, "WARNING") == [] and set(outcome["env"].values()) == {None}
    (line,) = said(outcome, "INFO")
    assert line.startswith(f"{PREFIX}VLLMCPULAUNCH_IOMP=never; ")


def test_an_unsafe_callers_entry_is_one_error_and_no_change(
    tmp_path: Path, debian_root: Path
) -> None:
    """Where the launcher refuses to start (exit 126: the caller's tcmalloc in a directory
    anyone may write, beside the plan's own), the plugin cannot: one error, nothing set."""
    shared = tmp_path / "shared"
    shared.mkdir()
    tcmalloc = shared / "libtcmalloc_minimal.so.4"
    shutil.copy2(debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", tcmalloc)
    shared.chmod(0o777)
    outcome = run_vllm_process(tmp_path, {"LD_PRELOAD": str(tcmalloc)})
    assert outcome["seen"] == [str(tcmalloc)] * 2
    assert outcome["env"] == {
        "LD_PRELOAD": str(tcmalloc),
        "KMP_BLOCKTIME": None,
        "VLLM_CPU_OMP_THREADS_BIND": None,
        PLANNED_VARIABLE: None,
    }
    (error,) = said(outcome, "ERROR")
    assert error.startswith(f"{PREFIX}your LD_PRELOAD entry {tcmalloc} is unsafe to preload")
    assert error.endswith("(vLLM starts unchanged)") and "chmod" in error
    assert said(outcome, "INFO") == [] and said(outcome, "WARNING") == []


# ---------------------------------------------------------------- vLLM's hook, as vLLM changes it

# A stand-in vLLM whose platform class the test writes (its check_and_update_config with
# another signature, kind, or behaviour), and a script of what vLLM does in the front end:
# build configurations (new ones, or copies as vLLM's `replace(vllm_config, ...)` makes),
# each calling the hook as the test says. Like vLLM's, each stand-in method appends torch's
# libgomp to LD_PRELOAD when no OpenMP runtime is named there.
STANDIN_HEAD = """\
import os

TORCH_GOMP = "/torch/lib/libgomp.so.1"


def vllms_own_code(vllm_config):
    vllm_config.seen.append(os.environ.get("LD_PRELOAD"))
    preload = os.environ.get("LD_PRELOAD", "")
    if not any(name in preload for name in ("libomp", "libgomp", "libiomp")):
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [preload, TORCH_GOMP]))


class Base:
    def is_cpu(self):
        return True
"""
SCRIPT = (
    """\
import dataclasses, json, logging, os, sys, traceback, types
from importlib.metadata import entry_points

"""
    + LOGGED_PLUGIN
    + """\
plugin.load()()
from vllm import platforms
from vllm.platforms import current_platform


@dataclasses.dataclass
class VllmConfig:
    speculative_config: object
    parallel_config: object
    model_config: object
    cache_config: object
    seen: list


def new_config(sd):
    return VllmConfig(
        types.SimpleNamespace(method="ngram", num_speculative_tokens=3) if sd else None,
        types.SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1
        ),
        types.SimpleNamespace(model="/models/m"),
        types.SimpleNamespace(),
        [],
    )


configs = {}
steps = []
for step in json.loads(sys.argv[1]):
    os.environ.update(step.get("set", {}))
    if "copy_of" in step:  # vLLM's replace(): a new object, the same parts
        config = dataclasses.replace(configs[step["copy_of"]], seen=[])
    else:
        config = new_config(step.get("sd", True))
    configs[step["name"]] = config
    hook = getattr(type(current_platform), "check_and_update_config", None)
    if step.get("on") == "instance":
        hook = current_platform.check_and_update_config
    outcome = {"seen": config.seen}
    try:
        arguments = [] if step.get("keyword") else [config]
        extra = {"vllm_config": config} if step.get("keyword") else {}
        arguments += step.get("args", [])
        outcome["result"] = hook(*arguments, **extra, **step.get("kwargs", {}))
    except Exception as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = frame.filename == platforms.__file__
        outcome["raised"] = [type(error).__name__, str(error), where]
    names = ("LD_PRELOAD", "KMP_BLOCKTIME", "VLLMCPULAUNCH_PLANNED")
    outcome["env"] = {name: os.environ.get(name) for name in names}
    steps.append(outcome)
kinds = {
    c.__name__: type(vars(c).get("check_and_update_config")).__name__
    for c in type(current_platform).__mro__
}
print(json.dumps({"steps": steps, "records": records, "kinds": kinds}))
"""
)
GOMP = "/torch/lib/libgomp.so.1"


def run_vllm_front_end(
    tmp_path: Path,
    platform: str,
    steps: list[dict[str, Any]],
    variables: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The front end of the stand-in vLLM whose platform module ends with `platform`,
    running `steps`; what each step saw, left and returned, and what was logged."""
    return run_standin(tmp_path, STANDIN_HEAD + platform, SCRIPT, steps, variables)


CLASSMETHOD = """
class CpuPlatform(Base):
    @classmethod
    def check_and_update_config(cls, vllm_config):
        vllms_own_code(vllm_config)
        return cls.__name__


current_platform = CpuPlatform()
"""


@pytest.mark.parametrize(
    ("platform", "step", "result"),
    [
        (  # a vLLM that passes more, positional and by keyword
            """
class CpuPlatform(Base):
    @classmethod
    def check_and_update_config(cls, vllm_config, stage, *, strict=False):
        vllms_own_code(vllm_config)
        return [cls.__name__, stage, strict]


current_platform = CpuPlatform()
""",
            {"args": ["final"], "kwargs": {"strict": True}},
            ["CpuPlatform", "final", True],
        ),
        (CLASSMETHOD, {"keyword": True}, "CpuPlatform"),  # the configuration by keyword
        (CLASSMETHOD, {"on": "instance"}, "CpuPlatform"),  # as VllmConfig calls it
        (  # a static method
            """
class CpuPlatform(Base):
    @staticmethod
    def check_and_update_config(vllm_config):
        vllms_own_code(vllm_config)
        return "static"


current_platform = CpuPlatform()
""",
            {"on": "instance"},
            "static",
        ),
        (  # a plain method, called on the platform object
            """
class CpuPlatform(Base):
    def check_and_update_config(self, vllm_config, *rest):
        vllms_own_code(vllm_config)
        return [type(self).__name__, list(rest)]


current_platform = CpuPlatform()
""",
            {"on": "instance", "args": [1, 2]},
            ["CpuPlatform", [1, 2]],
        ),
        (  # zentorch's ZenCpuPlatform: vLLM selects a subclass of its CPU platform
            CLASSMETHOD.replace(
                "current_platform = CpuPlatform()",
                "class ZenCpuPlatform(CpuPlatform):\n    pass\n\n\n"
                "current_platform = ZenCpuPlatform()",
            ),
            {"on": "instance"},
            "ZenCpuPlatform",
        ),
    ],
    ids=["more-arguments", "keyword", "on-the-instance", "staticmethod", "method", "subclass"],
)
def test_whatever_vllm_passes_reaches_vllm_and_its_result_comes_back(
    tmp_path: Path, platform: str, step: dict[str, Any], result: Any, system_host: SystemHost
) -> None:
    outcome = run_vllm_front_end(tmp_path, platform, [{"name": "a", **step}])
    (done,) = outcome["steps"]
    assert done.get("raised") is None and done["result"] == result
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert done["seen"] == [preload]  # the plan was in place before vLLM's own code ran
    assert done["env"]["LD_PRELOAD"] == preload
    assert said(outcome, "WARNING") == [] and len(said(outcome, "INFO")) == 1


def test_a_subclass_is_wrapped_and_the_cpu_platform_left_as_it_is(tmp_path: Path) -> None:
    platform = CLASSMETHOD.replace(
        "current_platform = CpuPlatform()",
        "class ZenCpuPlatform(CpuPlatform):\n    pass\n\n\ncurrent_platform = ZenCpuPlatform()",
    )
    outcome = run_vllm_front_end(tmp_path, platform, [{"name": "a"}])
    assert outcome["kinds"] == {
        "ZenCpuPlatform": "classmethod",  # the wrapper, where vLLM looks first
        "CpuPlatform": "classmethod",
        "Base": "NoneType",
        "object": "NoneType",
    }
    assert outcome["steps"][0]["result"] == "ZenCpuPlatform"


def test_vllms_own_exception_stays_vllms(tmp_path: Path, system_host: SystemHost) -> None:
    """vLLM 0.34 raises from inside the method on x86 without Triton."""
    platform = CLASSMETHOD.replace(
        "        return cls.__name__",
        '        raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")',
    )
    outcome = run_vllm_front_end(tmp_path, platform, [{"name": "a"}])
    (done,) = outcome["steps"]
    # The same exception, raised where vLLM raised it, and nothing said of it by the plugin.
    assert done["raised"] == [
        "RuntimeError",
        "vLLM on x86 CPUs requires Triton (triton-cpu).",
        True,
    ]
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert done["seen"] == [preload] and said(outcome, "WARNING") == []


def test_a_vllm_without_the_method_gets_one_warning(tmp_path: Path) -> None:
    platform = "\n\nclass CpuPlatform(Base):\n    pass\n\n\ncurrent_platform = CpuPlatform()\n"
    outcome = run_vllm_front_end(tmp_path, platform, [{"name": "a"}])
    assert outcome["steps"][0]["raised"][0] == "TypeError"  # the stand-in calls None itself
    assert outcome["kinds"]["CpuPlatform"] == "NoneType"  # nothing was put in its place
    assert said(outcome, "WARNING") == [
        f"{PREFIX}CpuPlatform.check_and_update_config is missing, not a method it can wrap; "
        "vLLM runs without the plugin"
    ]


def test_each_configuration_gets_its_own_plan(tmp_path: Path, system_host: SystemHost) -> None:
    """The offline API builds several: a second LLM(...) is planned as if it were the first."""
    steps: list[dict[str, Any]] = [
        {"name": "plain", "sd": False},
        {"name": "sd"},
        {"name": "plain-again", "sd": False},
    ]
    outcome = run_vllm_front_end(tmp_path, CLASSMETHOD, steps)
    plain, sd, again = outcome["steps"]
    assert plain["seen"] == [None] and plain["env"]["LD_PRELOAD"] == GOMP  # vLLM's own
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert sd["seen"] == [preload] and sd["env"]["KMP_BLOCKTIME"] == "5"
    assert again["seen"] == [None] and again["env"] == plain["env"]  # all of the SD plan undone
    lines = said(outcome, "INFO")
    assert len(lines) == 3 and "speculative decoding requested" in lines[1]
    assert all(line.startswith(f"{PREFIX}no speculative decoding") for line in lines[::2])


def test_a_copy_of_a_configuration_keeps_its_plan(tmp_path: Path, system_host: SystemHost) -> None:
    """vLLM re-runs the hook for replace(vllm_config, ...): not planned again, nothing undone,
    also after another configuration was planned."""
    steps: list[dict[str, Any]] = [
        {"name": "sd"},
        {"name": "sd-copy", "copy_of": "sd"},
        {"name": "plain", "sd": False},
        {"name": "sd-copy-later", "copy_of": "sd"},
    ]
    outcome = run_vllm_front_end(tmp_path, CLASSMETHOD, steps)
    sd, copy, plain, later = outcome["steps"]
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert sd["seen"] == copy["seen"] == [preload] and copy["env"] == sd["env"]
    assert plain["seen"] == [None] and later["env"] == plain["env"]
    assert len(said(outcome, "INFO")) == 2


def test_a_copy_made_inside_vllms_own_method_is_not_planned_again(
    tmp_path: Path, system_host: SystemHost
) -> None:
    platform = """
import dataclasses


class CpuPlatform(Base):
    @classmethod
    def check_and_update_config(cls, vllm_config):
        vllms_own_code(vllm_config)
        if not getattr(vllm_config, "is_copy", False):
            copy = dataclasses.replace(vllm_config, seen=vllm_config.seen)
            copy.is_copy = True
            return ["outer", cls.check_and_update_config(copy)]
        return "inner"


current_platform = CpuPlatform()
"""
    outcome = run_vllm_front_end(tmp_path, platform, [{"name": "sd"}])
    (done,) = outcome["steps"]
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert done["result"] == ["outer", "inner"] and done["seen"] == [preload, preload]
    assert len(said(outcome, "INFO")) == 1


def test_what_the_user_set_between_configurations_is_where_its_plan_starts(
    tmp_path: Path, system_host: SystemHost
) -> None:
    """A script that sets LD_PRELOAD itself before its second LLM(...): that configuration
    is planned from it, as the launcher plans from the caller's: libgomp gives way to
    Intel OpenMP for SD (vLLM refuses both), said in a warning naming the entry."""
    steps: list[dict[str, Any]] = [
        {"name": "sd"},
        {"name": "mine", "set": {"LD_PRELOAD": "/mine/libgomp.so.1"}},
    ]
    outcome = run_vllm_front_end(tmp_path, CLASSMETHOD, steps)
    first, mine = outcome["steps"]
    preload = system_host.preload(LIBRARY)  # what this host adds
    assert first["env"]["LD_PRELOAD"] == preload
    assert mine["seen"] == [preload] and mine["env"]["LD_PRELOAD"] == preload
    (warning,) = said(outcome, "WARNING")
    assert warning.startswith(f"{PREFIX}removed /mine/libgomp.so.1 from LD_PRELOAD")
    assert len(said(outcome, "INFO")) == 2


def test_iomp_never_marks_each_configuration_it_plans(tmp_path: Path) -> None:
    steps: list[dict[str, Any]] = [{"name": "sd"}, {"name": "plain", "sd": False}]
    variables = {"VLLMCPULAUNCH_IOMP": "never"}
    outcome = run_vllm_front_end(tmp_path, CLASSMETHOD, steps, variables)
    sd, plain = outcome["steps"]
    assert sd["env"][PLANNED_VARIABLE] == plain["env"][PLANNED_VARIABLE] == "plugin"
    assert sd["seen"] == plain["seen"] == [None]
    assert len(said(outcome, "INFO")) == 2

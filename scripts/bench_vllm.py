#!/usr/bin/env python3
"""Real vLLM with speculative decoding: where each OpenMP/malloc setting helps or hurts.

A map over the model (`--models`: the tiny random Llama and a compute-bound one of ~105M
parameters, both made locally by scripts/make_tiny_model.py with random weights, whose
drafts are never accepted; or `smollm2`, SmolLM2-135M-Instruct's real weights as
scripts/real_model.py makes them, `--real-model DIR`, drafted for by itself or by a
shallow draft of its first layers, `--real-draft DIR`), the speculative-decoding
method (`--methods`, METHODS in bench_vllm_records: vLLM's ngram proposer; the tiny model
as a draft model, made with the same seed and so the same tokenizer; or an EAGLE head made
for the target; both draft for the larger model only), the worker's OpenMP threads
(`--threads`: vLLM's default reservation, or all CPUs with VLLM_CPU_NUM_OF_RESERVED_CPU=0),
client concurrency (`--concurrency`, measured one after another on the same server) and
the runtime settings a launcher can choose (`--settings`, SETTINGS below): plain
`vllm serve` (vLLM preloads GNU libgomp), and the launcher of this checkout with Intel
OpenMP as vLLM's workers tune it, with tcmalloc beside libgomp or libiomp5 (the vLLM
Docker image's recipe, compared with as a peer), and with libiomp5, alone or beside
tcmalloc, under VLLM_CPU_OMP_THREADS_BIND=nobind, the only mode in which the launcher's
KMP_BLOCKTIME reaches the worker (vLLM then sets no KMP_*, OMP_NUM_THREADS or affinity, so
the worker's team spans every CPU whatever is reserved). Beside Intel's: LLVM's libomp
(`--libomp-path`, preloaded by the launcher as an Intel-interface runtime), libgomp's
waiting policies (OMP_WAIT_POLICY=active, a GOMP_SPINCOUNT of ~200 ms), libiomp5's `dist`
barriers, and one OpenMP thread (`libgomp-1thread`): its TPOT divided by a setting's
threads is the limit the report measures each setting against. After its last phase each
server sits idle for a few seconds, and the CPU it burns then is kept too. `--map real`
names the real-weights map (bench_vllm_records.MAPS): each method with only the settings
its rules' pairs need.

Starts alternate, the order rotating per round (bench_stats.interleaved). For each start:
seconds to a healthy `/health`, then after a short warm-up, per concurrency level, clients
stream greedy `ignore_eos` completions for `--phase-seconds` (one completion prompt per
model, or `--prompts FILE`'s set, vLLM's custom dataset JSONL, sent as chat, client i
asking prompts i, i + C, ...): vLLM's own mean time per output token over the phase
(`vllm:request_time_per_output_token_seconds`), output tokens per second, the CPU each
vLLM process used, and vLLM's SD counters, per phase and per start (acceptance: accepted
of drafted tokens; accepted tokens per verifying step). Every server runs in its own session and is
killed before the next starts; every wait is bounded. The starts of a model and method
share one VLLM_CACHE_ROOT, filled by an unmeasured start first: every measured start finds
the same warm compile cache (30 s to healthy instead of 50 s here; the compiled code does
not depend on the runtime preloaded). `--no-warm-up` skips that start, for smoke tests: the
first measured start then compiles, which its start-up and figures show.

Prints a Markdown report (machine, command, tables, ratios against plain vLLM and against
the Docker image's recipe of the same run with the per-round spread); `--markdown FILE`
puts it between markers in FILE, `--json FILE` keeps every measurement, `--plot FILE.png`
draws TPOT per configuration (matplotlib), and `--from-json FILE` redraws report and plot
from a kept run.

This module is the command line and the order of the starts; each job has a module of its
own beside it: bench_vllm_records (configurations and what a start keeps), bench_vllm_run
(starting and measuring one server), bench_vllm_report (statistics and Markdown) and
bench_vllm_plot (the plot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from bench_stats import REPO, interleaved
from bench_vllm_plot import gain_by_load, gains, plot
from bench_vllm_records import (
    LLVM_OMP,
    MAPS,
    METHODS,
    MODELS,
    REAL,
    SETTINGS,
    SHALLOW_DRAFT,
    SYNTHETIC,
    THREADS,
    Config,
    Made,
    Run,
    grid,
    mapped,
    runs_from_json,
)
from bench_vllm_report import MARKERS, markdown, update_markdown
from bench_vllm_run import (
    COMPILING_LIMIT_S,
    POLL_INTERVAL_S,
    asks_of,
    cache_key,
    load_prompts,
    measure_one,
    warmed_up,
)
from bench_vllm_shape import SHAPES, shaped
from script_cli import ScriptError, exit_code, last_line, narrator
from vllm_server import (
    ENV_SETUP_LIMIT_S,
    MODEL_LIMIT_S,
    Server,
    make_model_command,
    prepare_env_command,
    stop_session,
)

DEBIAN_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
INTERESTING_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "hypervisor",
)

say = narrator("bench_vllm")
FILLED = "bench_vllm-filled"  # in a compile cache an unmeasured start filled


# ---------------------------------------------------------------- set-up


def prepare_env(explicit: Path | None) -> Path:
    if explicit is not None:
        if not (explicit / "bin" / "vllm").exists():
            raise ScriptError(f"{explicit}/bin/vllm does not exist")
        return explicit.absolute()
    # Plain `vllm serve` is measured too: on vllm-cpu 0.32 it starts only after the README's
    # plugin step (doctor's fix), so the environment is the install with that step done.
    say("preparing the vLLM environment (scripts/vllm_env.py --doctored; minutes on first use)")
    command = prepare_env_command(doctored=True)
    return Path(last_line(command, "scripts/vllm_env.py", ENV_SETUP_LIMIT_S))


def prepare_model(made: Made, env: Path, scratch: Path) -> Path:
    options = made.options()
    say(f"making the {made.key} model (scripts/make_tiny_model.py {' '.join(options)})")
    command = [*make_model_command(env, scratch / f"model-{made.key}"), *options]
    return Path(last_line(command, "scripts/make_tiny_model.py", MODEL_LIMIT_S))


def versions(env: Path) -> str:
    code = (
        "import importlib.metadata as m\n"
        "print('vllm-cpu', m.version('vllm-cpu'), '/ torch', m.version('torch'))"
    )
    try:
        return last_line([str(env / "bin" / "python"), "-c", code], "version query", 120)
    except ScriptError:
        return "versions unknown"


def parameter_count(model: Path) -> str:
    """Parameters of a made model, counted from its safetensors header (what an EAGLE head
    leaves out, the target's embeddings and lm_head, is not counted), and its shape."""
    with (model / "model.safetensors").open("rb") as stream:
        size = int.from_bytes(stream.read(8), "little")  # the format: u64 length, JSON header
        header = json.loads(stream.read(size))
    shapes = (entry["shape"] for name, entry in header.items() if name != "__metadata__")
    total = sum(math.prod(shape) for shape in shapes)
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    layers = config["num_hidden_layers"]
    return (
        f"{total / 1e6:.1f}M parameters (hidden {config['hidden_size']}, {layers} "
        f"layer{'s' if layers != 1 else ''}, {config['num_attention_heads']} heads)"
    )


def describe_machine() -> dict[str, str]:
    """CPU model, CPU count, the flags that matter to vLLM on CPU, memory, kernel."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            for line in stream:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    memory = "?"
    try:
        with open("/proc/meminfo", encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("MemTotal:"):
                    memory = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    return {
        "cpu": info.get("model name", "unknown CPU"),
        "cpus": str(os.cpu_count()),
        "flags": " ".join(f for f in INTERESTING_FLAGS if f in flags) or "none of interest",
        "memory": memory,
        "kernel": f"{platform.system()} {platform.release()}",
    }


# ---------------------------------------------------------------- main


def listed(
    parser: argparse.ArgumentParser, option: str, text: str, allowed: Sequence[str]
) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or any(item not in allowed for item in items):
        parser.error(f"{option} takes a comma-separated list from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="starts per configuration")
    parser.add_argument(
        "--models",
        default=",".join(SYNTHETIC),
        help=f"from {', '.join(MODELS)} (default the made ones; {REAL} needs --real-model)",
    )
    parser.add_argument(
        "--map",
        choices=sorted(MAPS),
        help="a named map: its models, methods and settings (each method its own settings), "
        "in place of --models/--methods/--threads/--settings",
    )
    parser.add_argument(
        "--real-model",
        type=Path,
        help=f"the {REAL} model's directory (real weights: scripts/real_model.py makes it)",
    )
    parser.add_argument(
        "--real-draft",
        type=Path,
        help="the shallow draft's directory, cut from the real model's first layers "
        "(scripts/real_model.py makes it): the shallow* methods draft with it",
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"from {', '.join(METHODS)} (default all)"
    )
    parser.add_argument("--threads", default="default,all", help="default,all (default both)")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"from {', '.join(SETTINGS)} (default all)"
    )
    parser.add_argument("--concurrency", default="1,4,8", help="client counts (default 1,4,8)")
    parser.add_argument(
        "--prompts",
        type=Path,
        help="a prompt set in vLLM's custom dataset JSONL, sent as chat (the package ships "
        "vllm_cpu_launch/serving_prompts.jsonl); default: one completion prompt per model",
    )
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        default="idle",
        help="the host shape every server runs in (bench_vllm_shape): a CFS quota of 1.0 or "
        "1.5 CPUs (a cgroup of its own; root), a cpuset of 1 CPU, or 1 or 2 busy loops of "
        "another process beside it (default idle: the whole host)",
    )
    parser.add_argument("--phase-seconds", type=float, default=8.0, help="load per level")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--tcmalloc-path",
        type=Path,
        default=Path(DEBIAN_TCMALLOC),
        help=f"tcmalloc for the +tcmalloc settings (default {DEBIAN_TCMALLOC})",
    )
    parser.add_argument(
        "--libomp-path",
        type=Path,
        help="LLVM's libomp for the libomp settings, by a name holding 'libiomp' as the "
        "launcher requires (Debian's libomp-14-dev: /usr/lib/llvm-14/lib/libiomp5.so; the "
        "cmeel-libomp wheel: cmeel.prefix/lib/libiomp5.so)",
    )
    parser.add_argument(
        "--no-warm-up",
        action="store_true",
        help="no unmeasured start to fill each compile cache: the first measured start "
        "compiles (a smoke test's shortcut; its figures are not comparable)",
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        help="keep each model and method's compile cache (VLLM_CACHE_ROOT) under this "
        "directory across runs: one a run filled needs no unmeasured start again (default: "
        "a temporary one per run)",
    )
    parser.add_argument("--vllm-env", type=Path, help="vLLM environment (default: vllm_env.py)")
    parser.add_argument("--markdown", type=Path, help="also write the report into this file")
    parser.add_argument(
        "--markers",
        default=MARKERS,
        help=f"between <!-- MARKERS: begin/end --> in --markdown FILE (default {MARKERS})",
    )
    parser.add_argument("--json", type=Path, help="also keep every measurement in this file")
    parser.add_argument("--plot", type=Path, help="draw TPOT per configuration into this PNG")
    parser.add_argument(
        "--gains-plot",
        type=Path,
        help="draw each setting's paired gain on plain vLLM, per method with its acceptance, "
        "into this PNG",
    )
    parser.add_argument(
        "--load-plot",
        type=Path,
        help="draw each setting's paired gain on plain vLLM against the concurrency, a "
        "panel per method, into this PNG",
    )
    parser.add_argument("--from-json", type=Path, help="report (and plot) a kept run; no vLLM")
    args = parser.parse_args(argv)
    args.model_sizes = listed(parser, "--models", args.models, MODELS)
    args.method_keys = listed(parser, "--methods", args.methods, tuple(METHODS))
    args.thread_settings = listed(parser, "--threads", args.threads, tuple(THREADS))
    args.setting_keys = listed(parser, "--settings", args.settings, tuple(SETTINGS))
    try:
        args.concurrency_levels = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        parser.error("--concurrency takes whole numbers, comma-separated")
    if min(args.rounds, *args.concurrency_levels) < 1 or args.phase_seconds <= 0:
        parser.error("--rounds and --concurrency must be >= 1, --phase-seconds > 0")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    try:
        args.prompt_set = None if args.prompts is None else load_prompts(args.prompts)
    except (OSError, ScriptError) as error:
        parser.error(f"--prompts: {error}")
    if args.map is not None:
        args.model_sizes, args.thread_settings = [REAL], ["default"]
        args.setting_keys = list(dict.fromkeys(k for keys in MAPS[args.map].values() for k in keys))
    needs_tcmalloc = any(SETTINGS[key].tcmalloc for key in args.setting_keys)
    if needs_tcmalloc and not args.from_json and not args.tcmalloc_path.is_file():
        parser.error(
            f"--tcmalloc-path {args.tcmalloc_path} does not exist; Fix: apt-get install "
            "libtcmalloc-minimal4, or name another file, or leave out the +tcmalloc --settings"
        )
    needs_libomp = any(SETTINGS[key].runtime == LLVM_OMP for key in args.setting_keys)
    if (
        needs_libomp
        and not args.from_json
        and not (args.libomp_path and args.libomp_path.is_file())
    ):
        parser.error(
            f"the libomp settings need --libomp-path FILE (given: {args.libomp_path}): LLVM's "
            "libomp by a libiomp5.so name, as Debian's libomp-14-dev installs it "
            "(/usr/lib/llvm-14/lib/libiomp5.so) or the cmeel-libomp wheel ships it "
            "(cmeel.prefix/lib/libiomp5.so); or leave out the libomp --settings"
        )
    args.configs = (
        mapped(MAPS[args.map])
        if args.map is not None
        else grid(args.model_sizes, args.method_keys, args.thread_settings, args.setting_keys)
    )
    check_real_paths(parser, args)
    if not args.configs:
        parser.error("no configuration: a draft method drafts only for a larger --models one")
    return args


def check_real_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The real model's directories, where a configuration needs them: one line naming the
    option and how to make the directory, before any vLLM starts."""
    if args.from_json is not None:
        return
    fix = "Fix: make it with scripts/real_model.py and name the directory it prints"
    needed = [("--real-model", args.real_model, any(c.model == REAL for c in args.configs))]
    shallow = any(METHODS[c.method].draft == SHALLOW_DRAFT for c in args.configs)
    needed.append(("--real-draft", args.real_draft, shallow))
    for option, path, wanted in needed:
        if wanted and not (path is not None and (path / "config.json").is_file()):
            parser.error(f"{option} {path} is not a model directory (no config.json); {fix}")


def terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def made_models(configs: Sequence[Config]) -> list[Made]:
    """The made models configs need: targets, then what drafts for them."""
    drafts = (METHODS[c.method].draft_for(c.model) for c in configs)
    targets = (Made(c.model) for c in configs if c.model in SYNTHETIC)
    return list(dict.fromkeys([*targets, *filter(None, drafts)]))


def model_keys(configs: Sequence[Config]) -> list[str]:
    """The keys among the map's paths of every model configs serve or draft with."""
    drafts = (METHODS[c.method].draft_key(c.model) for c in configs)
    return list(dict.fromkeys([*(c.model for c in configs), *filter(None, drafts)]))


def prepare(args: argparse.Namespace, scratch: Path, active: list[Server]) -> dict[str, Path]:
    """The vLLM environment, the models, and a compile cache per model and method, filled
    by one unmeasured start (unless --no-warm-up, or a --compile-cache an earlier run
    filled); by key: "env", a model (or draft) key, cache_key(config)."""
    paths = {"env": prepare_env(args.vllm_env)}
    for made in made_models(args.configs):
        paths[made.key] = prepare_model(made, paths["env"], scratch)
    for key, given in ((REAL, args.real_model), (SHALLOW_DRAFT, args.real_draft)):
        if given is not None:
            paths[key] = given.absolute()
    caches = scratch if args.compile_cache is None else args.compile_cache.absolute()
    for model, method in dict.fromkeys((c.model, c.method) for c in args.configs):
        warm = Config(model, method, args.thread_settings[0], "libgomp")
        paths[cache_key(warm)] = caches / f"vllm-cache-{model}-{method}"
        filled = paths[cache_key(warm)] / FILLED
        if args.no_warm_up or filled.exists():
            continue  # no warm-up asked for, or a kept cache an earlier run filled
        say(f"filling the compile cache of the {model} model with {method} (one unmeasured start)")
        where = scratch / f"warm-{model}-{method}"
        with warmed_up(warm, paths, where, args, active, COMPILING_LIMIT_S):
            filled.parent.mkdir(parents=True, exist_ok=True)
            filled.touch()
    return paths


def partial_path(kept: Path) -> Path:
    return kept.with_name(kept.name + ".partial")


def keep_partial(kept: Path | None, run: Run) -> None:
    """Each start as it is measured, one JSON line in KEPT.partial: a map stopped early
    keeps what it measured (the full record replaces it at the end)."""
    if kept is not None:
        with partial_path(kept).open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(asdict(run)) + "\n")


def measure(args: argparse.Namespace, command: str) -> tuple[list[Run], dict[str, Any]]:
    """Every configuration for every round, servers stopped; the runs and what they ran on."""
    active: list[Server] = []
    started = time.time()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-vllm-") as temporary,
            shaped(SHAPES[args.shape]) as args.shape_prefix,
        ):
            scratch = Path(temporary)
            paths = prepare(args, scratch, active)
            configs: list[Config] = args.configs
            total = len(configs) * args.rounds
            say(f"{len(configs)} configurations x {args.rounds} rounds = {total} starts")
            runs: list[Run] = []
            if args.json is not None:
                partial_path(args.json).unlink(missing_ok=True)  # an earlier run's
            for number, (round_index, config) in enumerate(interleaved(configs, args.rounds), 1):
                say(f"start {number}/{total}, round {round_index + 1}: {config.name}")
                where = scratch / f"r{round_index}-{number}"
                run = measure_one(config, round_index, paths, where, args, active)
                say(
                    f"  healthy after {run.startup_s:.0f} s; TPOT "
                    + ", ".join(f"C={p.streams} {p.tpot_ms:.2f} ms" for p in run.phases)
                    + f"; worker {run.worker}"
                )
                runs.append(run)
                keep_partial(args.json, run)
            models = {key: parameter_count(paths[key]) for key in model_keys(configs)}
    finally:
        for server in list(active):
            stop_session(server, POLL_INTERVAL_S)
    runs.sort(key=lambda r: (configs.index(r.config), r.round))
    meta = {
        "command": command,
        "machine": describe_machine(),
        "shape": f"{args.shape}: {SHAPES[args.shape].words()}",
        "versions": versions(paths["env"]),
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "minutes": (time.time() - started) / 60,
        "models": models,
        "concurrency": args.concurrency_levels,
        "phase_seconds": args.phase_seconds,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "prompts": sorted({p for c in configs for p in asks_of(c, args.prompt_set).prompts}),
        "prompt_file": None if args.prompts is None else str(args.prompts),
    }
    return runs, meta


def bench(args: argparse.Namespace, command: str) -> None:
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text(encoding="utf-8"))
        runs, meta = runs_from_json(data), data["meta"]
    else:
        runs, meta = measure(args, command)
        if args.json is not None:
            kept = {"meta": meta, "runs": [asdict(run) for run in runs]}
            args.json.write_text(json.dumps(kept, indent=1) + "\n", encoding="utf-8")
            partial_path(args.json).unlink(missing_ok=True)
            say(f"kept every measurement in {args.json}")
    report = markdown(runs, meta, redrawn=args.from_json is not None)
    print(report)
    if args.markdown is not None:
        update_markdown(args.markdown, report, args.markers)
        say(f"wrote the report into {args.markdown}")
    if args.plot is not None:
        plot(runs, meta, args.plot)
        say(f"drew {args.plot}")
    if args.gains_plot is not None:
        gains(runs, meta, args.gains_plot)
        say(f"drew {args.gains_plot}")
    if args.load_plot is not None:
        gain_by_load(runs, meta, args.load_plot)
        say(f"drew {args.load_plot}")
    print(f"rerun: cd {REPO} && {meta['command']}")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(arguments)
    command = shlex.join(["python", "scripts/bench_vllm.py", *arguments])
    signal.signal(signal.SIGTERM, terminate)
    return exit_code("bench_vllm", lambda: bench(args, command), "interrupted; servers stopped")


if __name__ == "__main__":
    raise SystemExit(main())

"""The vLLM map's plot: TPOT per configuration, median bars and min-max whiskers.

scripts/bench_vllm.py's drawing job, the same from a fresh run and from `--from-json`.
matplotlib (the `bench` extra) is imported only when a plot is asked for.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_vllm_records import NOBIND, SETTINGS, THREADS, Config, Run
from bench_vllm_report import speedup
from script_cli import ScriptError


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (the `bench` extra), or one line saying so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScriptError(
            "--plot needs matplotlib; Fix: python -m pip install -e '.[bench]'"
        ) from None
    return plt


def palette(index: int) -> Any:
    """One colour per setting, the same in every plot (tab20: more than SETTINGS)."""
    import matplotlib

    return matplotlib.colormaps["tab20"](index)


def plot(runs: Sequence[Run], meta: dict[str, Any], path: Path) -> None:
    """TPOT per configuration: a row of panels per model and method, a panel per thread
    setting, bars per concurrency, whiskers from the fastest to the slowest round."""
    plt = pyplot()
    levels: list[int] = meta["concurrency"]
    rows = list(dict.fromkeys((r.config.model, r.config.method) for r in runs))
    panels = ["default", "all"]
    # One scale per row: the Docker recipe (bound, left) and the nobind settings (right) meet
    # across panels.
    figure, axes = plt.subplots(
        len(rows), len(panels), figsize=(13, 4.2 * len(rows)), squeeze=False, sharey="row"
    )
    for row, (model, method) in enumerate(rows):
        for column, threads in enumerate(panels):
            axis = axes[row][column]
            wanted = (threads, NOBIND) if threads == "all" else (threads,)
            mine = (r.config for r in runs if (r.config.model, r.config.method) == (model, method))
            configs = list(dict.fromkeys(mine))
            configs = [c for c in configs if c.threads in wanted]
            if not configs:
                axis.set_visible(False)
                continue
            width = 0.8 / max(len(configs), 1)
            for index, config in enumerate(configs):
                group = [r for r in runs if r.config == config]
                medians, lows, highs = [], [], []
                for level in levels:
                    values = [r.phase(level).tpot_ms for r in group]
                    middle = statistics.median(values)
                    medians.append(middle)
                    lows.append(middle - min(values))
                    highs.append(max(values) - middle)
                positions = [
                    i + (index - (len(configs) - 1) / 2) * width for i in range(len(levels))
                ]
                label = config.setting + (" (nobind)" if config.threads == NOBIND else "")
                # One colour per setting, the same in every panel (tab20: more than SETTINGS).
                colour = palette(list(SETTINGS).index(config.setting))
                axis.bar(
                    positions,
                    medians,
                    width,
                    yerr=[lows, highs],
                    capsize=2,
                    label=label,
                    color=colour,
                )
            axis.set_xticks(range(len(levels)), [f"C={c}" for c in levels])
            # A shared scale labels only the first column, which a row without bound
            # settings hides: every drawn panel labels its own.
            axis.yaxis.set_tick_params(labelleft=True)
            axis.set_title(f"{model} model, {method}, threads: {THREADS[threads]}")
            axis.set_ylabel("TPOT ms (vLLM's own, lower is better)")
            axis.legend(fontsize=7)
    title = (
        f"{meta['versions']}, speculative decoding, on {meta['machine']['cpu']}, "
        f"{meta['machine']['cpus']} CPUs: median of {meta['rounds']} rounds, whiskers min-max"
    )
    save(plt, figure, title, path)


def grouped(runs: Sequence[Run]) -> dict[Config, list[Run]]:
    """The runs of each configuration, in the order first seen."""
    by_config: dict[Config, list[Run]] = {}
    for run in runs:
        by_config.setdefault(run.config, []).append(run)
    return by_config


def save(plt: Any, figure: Any, title: str, path: Path) -> None:
    """Title the figure, write it to path and free it."""
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def gains(runs: Sequence[Run], meta: dict[str, Any], path: Path) -> None:
    """What each setting gains on plain vLLM as installed, per method: the paired TPOT ratio
    (plain's / this one's, > 1 faster) per concurrency level, median bar, whiskers from the
    worst to the best round; each method labelled with its acceptance and accepted tokens
    per step, the figures the gain moves with."""
    plt = pyplot()
    levels: list[int] = meta["concurrency"]
    by_config = grouped(runs)
    methods = list(dict.fromkeys((c.model, c.method) for c in by_config))
    settings = list(dict.fromkeys(c.setting for c in by_config if c.setting != "libgomp"))
    width_in = max(10.0, 4 + 2.2 * len(methods) * len(levels))
    figure, axes = plt.subplots(1, len(levels), figsize=(width_in, 5.5), squeeze=False)
    width = 0.8 / max(len(settings), 1)
    for axis, level in zip(axes[0], levels, strict=True):
        for index, setting in enumerate(settings):
            xs, medians, lows, highs = [], [], [], []
            for x, (model, method) in enumerate(methods):
                plain = by_config.get(Config(model, method, "default", "libgomp"))
                mine = [
                    g
                    for c, g in by_config.items()
                    if (c.model, c.method, c.setting) == (model, method, setting)
                ]
                if not plain or not mine:
                    continue
                ratio = speedup(mine[0], plain, level, "tpot")
                xs.append(x + (index - (len(settings) - 1) / 2) * width)
                medians.append(ratio.median)
                lows.append(ratio.median - ratio.low)
                highs.append(ratio.high - ratio.median)
            colour = palette(list(SETTINGS).index(setting))
            # Points, not bars: on a log scale a bar's height from the axis means nothing.
            axis.errorbar(
                xs, medians, yerr=[lows, highs], fmt="o", capsize=3, label=setting, color=colour
            )
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_yscale("log")  # a loss of 2x as far from 1 as a gain of 2x
        axis.set_xticks(range(len(methods)), [method_label(by_config, *m) for m in methods])
        axis.set_title(f"C={level} concurrent request{'s' if level > 1 else ''}")
        axis.set_ylabel("TPOT of plain vLLM / this (> 1 faster)")
        axis.legend(fontsize=7)
    title = (
        f"{meta['versions']}, {meta['machine']['cpus']} CPUs: gain on plain vLLM (libgomp, "
        f"vLLM's binding),\npaired by round, {meta['rounds']} rounds, whiskers min-max"
    )
    save(plt, figure, title, path)


def method_label(by_config: dict[Config, list[Run]], model: str, method: str) -> str:
    """`method`, and its acceptance and accepted tokens per step (median over its starts)."""
    group = [r for c, g in by_config.items() if (c.model, c.method) == (model, method) for r in g]
    if not all(r.sd_counts for r in group):
        return f"{model}\n{method}"
    acceptance = statistics.median(r.acceptance for r in group)
    per_step = statistics.median(r.accepted_per_step for r in group)
    return f"{method}\naccepted {acceptance:.0%}\n{per_step:.1f}/step"


def gain_by_load(runs: Sequence[Run], meta: dict[str, Any], path: Path) -> None:
    """How each setting's gain on plain vLLM moves with load: a panel per method, the
    paired TPOT ratio (plain's / this one's, > 1 faster) against the concurrency, median
    point and min-max whiskers over the rounds; each concurrency labelled with the share
    of drafts accepted there (every start of the method)."""
    plt = pyplot()
    levels: list[int] = meta["concurrency"]
    by_config = grouped(runs)
    methods = list(dict.fromkeys((c.model, c.method) for c in by_config))
    figure, axes = plt.subplots(
        1, len(methods), figsize=(4.6 * len(methods), 4.8), squeeze=False, sharey=True
    )
    for axis, (model, method) in zip(axes[0], methods, strict=True):
        plain = by_config.get(Config(model, method, "default", "libgomp"), [])
        mine = {
            c.setting: g
            for c, g in by_config.items()
            if (c.model, c.method) == (model, method) and c.setting != "libgomp"
        }
        for setting, group in mine.items():
            ratios = [speedup(group, plain, level, "tpot") for level in levels]
            axis.errorbar(
                range(len(levels)),
                [r.median for r in ratios],
                yerr=[[r.median - r.low for r in ratios], [r.high - r.median for r in ratios]],
                fmt="o-",
                capsize=3,
                label=setting,
                color=palette(list(SETTINGS).index(setting)),
            )
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_yscale("log")
        axis.set_yticks(GAIN_TICKS, [f"{tick:g}" for tick in GAIN_TICKS])
        axis.minorticks_off()
        method_runs = [
            r for c, g in by_config.items() if (c.model, c.method) == (model, method) for r in g
        ]
        axis.set_xticks(range(len(levels)), [load_label(method_runs, level) for level in levels])
        axis.set_title(f"{model}, {method}")
        axis.set_ylabel("TPOT of plain vLLM / this (> 1 faster)")
        axis.legend(fontsize=7)
    title = (
        f"{meta['versions']}, {meta['machine']['cpus']} CPUs: gain on plain vLLM (libgomp, "
        f"vLLM's binding) by concurrent requests,\npaired by round, {meta['rounds']} rounds, "
        "whiskers min-max"
    )
    save(plt, figure, title, path)


GAIN_TICKS = (0.5, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0)


def load_label(runs: Sequence[Run], level: int) -> str:
    """`C=4`, and the share of drafts accepted at that concurrency where it was kept."""
    phases = [run.phase(level) for run in runs]
    drafted = sum(p.sd_counts.get("draft_tokens", 0.0) for p in phases)
    if not drafted:
        return f"C={level}"
    accepted = sum(p.sd_counts.get("accepted_tokens", 0.0) for p in phases)
    return f"C={level}\naccepted {accepted / drafted:.0%}"

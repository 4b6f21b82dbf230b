"""The vLLM map's plot: TPOT per configuration, median bars and min-max whiskers.

scripts/bench_vllm.py's drawing job, the same from a fresh run and from `--from-json`.
matplotlib (the `bench` extra) is imported only when a plot is asked for.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_vllm_records import NOBIND, SETTINGS, THREADS, Run
from script_cli import ScriptError


def plot(runs: Sequence[Run], meta: dict[str, Any], path: Path) -> None:
    """TPOT per configuration: a row of panels per model and method, a panel per thread
    setting, bars per concurrency, whiskers from the fastest to the slowest round."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScriptError(
            "--plot needs matplotlib; Fix: python -m pip install -e '.[bench]'"
        ) from None
    palette = matplotlib.colormaps["tab20"]
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
    figure.suptitle(
        f"{meta['versions']}, speculative decoding, on {meta['machine']['cpu']}, "
        f"{meta['machine']['cpus']} CPUs: median of {meta['rounds']} rounds, whiskers min-max"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)

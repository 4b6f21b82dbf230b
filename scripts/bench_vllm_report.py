"""The vLLM map's statistics and Markdown report: tables, paired ratios, sign-test verdicts.

scripts/bench_vllm.py's reporting job, the same from a fresh run and from `--from-json`:
every ratio pairs a configuration with its baseline round by round (both measured in the
same run), and a verdict is `loss` or `gain` only when every round agrees, 4 or more.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench_vllm_records import (
    DOCKER_RECIPE,
    EAGLE_HEAD,
    IDLE_WINDOW_S,
    METHODS,
    ONE_THREAD,
    ROLES,
    SELF_DRAFT,
    SHALLOW_DRAFT,
    TPOT_METRIC,
    WARMUP_REQUESTS,
    Config,
    Run,
    baseline_of,
)

MARKERS = "bench_vllm"  # the report's markers in a Markdown file: <!-- bench_vllm: begin -->
# The fewest paired rounds whose agreement is a verdict: 4 the same way, p = 1/16 (one-sided).
SIGN_TEST_ROUNDS = 4


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Ratio:
    """Plain vLLM's TPOT / this configuration's (> 1: faster than plain), paired by round."""

    median: float
    low: float
    high: float
    rounds: int

    @property
    def verdict(self) -> str:
        """`loss`/`gain` when every round agrees, at least SIGN_TEST_ROUNDS of them (a sign
        test), else `=`: one round, or two, agree by chance too often to mean anything."""
        if self.rounds < SIGN_TEST_ROUNDS:
            return "="
        return "loss" if self.high < 1 else "gain" if self.low > 1 else "="

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f}) {self.verdict}"


def speedup(runs: Sequence[Run], baseline: Sequence[Run], streams: int, metric: str) -> Ratio:
    """How much better than plain, round by round: plain's TPOT / this one's ("tpot"), or
    this one's tokens per second / plain's ("tok/s")."""

    def better(run: Run, plain: Run) -> float:
        ours, theirs = run.phase(streams), plain.phase(streams)
        if metric == "tpot":
            return theirs.tpot_ms / ours.tpot_ms
        return ours.tokens_per_s / theirs.tokens_per_s

    plain = {run.round: run for run in baseline}
    paired = [better(run, plain[run.round]) for run in runs if run.round in plain]
    return Ratio(statistics.median(paired), min(paired), max(paired), len(paired))


def omp_threads(run: Run, cpus: int) -> int:
    """The OpenMP threads the run's worker ran: one for ONE_THREAD, vLLM's bound cores
    (its `core ids=[...]` line), else every CPU (nobind: the team spans them all)."""
    if run.config.setting == ONE_THREAD:
        return 1
    ids = run.core_ids.strip("[]")
    return len(ids.split(",")) if run.core_ids.startswith("[") and ids else cpus


def limit_rows(
    mine: Sequence[Config], by_config: dict[Config, list[Run]], meta: dict[str, Any]
) -> list[str]:
    """Each setting's idle cost and its distance from the limit: the TPOT this host would
    give if the worker's threads shared the work with no cost (ONE_THREAD's TPOT divided by
    the threads it runs), against what it gave (1.00 = at the limit)."""
    levels: list[int] = meta["concurrency"]
    cpus = int(meta["machine"]["cpus"])
    one = next((c for c in mine if c.setting == ONE_THREAD), None)
    lines = [
        "",
        f"Idle: cores busy over {IDLE_WINDOW_S:.0f} s after the last request, median "
        "(worker / EngineCore / API server). The limit: the one-thread TPOT "
        f"(`{ONE_THREAD}`, OpenMP threads 1) divided by the threads the worker runs; "
        "`limit/this` > 1 would beat it. The gap holds synchronisation and the Python "
        "(scheduler, proposer, sampler) that no thread count divides.",
        "",
        "| threads | setting | OpenMP threads | idle cores | "
        + " | ".join(f"limit ms C={c} (limit/this)" for c in levels)
        + " |",
        "|---|---|---|---|" + "---|" * len(levels),
    ]
    for config in mine:
        group = by_config[config]
        threads = omp_threads(group[0], cpus)
        idle = (
            " / ".join(
                f"{statistics.median(r.idle.get(role, 0.0) for r in group):.2f}" for role in ROLES
            )
            if all(r.idle for r in group)
            else "not read"
        )
        cells = []
        for c in levels:
            if one is None:
                cells.append("no one-thread run")
                continue
            limit = statistics.median(r.phase(c).tpot_ms for r in by_config[one]) / threads
            mine_tpot = statistics.median(r.phase(c).tpot_ms for r in group)
            cells.append(f"{limit:.2f} ({limit / mine_tpot:.2f})")
        lines.append(
            f"| {config.threads} | {config.setting} | {threads} | {idle} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def spread(values: Sequence[float]) -> str:
    """`median (min-max)`."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


# ---------------------------------------------------------------- report


def ratio_table(
    pairs: Sequence[tuple[Config, Config]],
    by_config: dict[Config, list[Run]],
    levels: Sequence[int],
) -> list[str]:
    """Rows of speedup() per concurrency level, TPOT then tok/s, for (config, baseline)
    pairs, both measured in this run."""
    lines = [
        "Paired by round, `median (min-max)`, > 1 = better than the baseline: TPOT "
        "baseline/this and tok/s this/baseline; `loss`/`gain` when every round agrees, "
        f"{SIGN_TEST_ROUNDS} or more.",
        "",
        "| threads | setting | baseline | "
        + " | ".join(f"{m} C={c}" for m in ("TPOT", "tok/s") for c in levels)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(levels)),
    ]
    for config, baseline in pairs:
        cells = [
            str(speedup(by_config[config], by_config[baseline], c, metric))
            for metric in ("tpot", "tok/s")
            for c in levels
        ]
        lines.append(
            f"| {config.threads} | {config.setting} | {baseline.threads}/{baseline.setting} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def comparison(
    title: str,
    pairs: Sequence[tuple[Config, Config]],
    by_config: dict[Config, list[Run]],
    levels: Sequence[int],
) -> list[str]:
    """The ratio table of the pairs measured in this run under its title, or nothing where
    none was (a map of vLLM's default reservation only has no `all` rows, say)."""
    measured = [(c, b) for c, b in pairs if c in by_config and b in by_config]
    return ["", title, "", *ratio_table(measured, by_config, levels)] if measured else []


def method_line(key: str) -> str:
    """How a method asked vLLM for speculative decoding, for the report's header."""
    method = METHODS[key]
    if method.draft is None:
        return f"`{key}`: `--speculative-config '{method.speculative_config('')}'`"
    if method.draft == EAGLE_HEAD:
        config = method.speculative_config("<an EAGLE head made for the target>")
        note = "random weights; vLLM shares the target's embeddings and lm_head"
        return f"`{key}`: `--speculative-config '{config}'` ({note})"
    if method.draft == SELF_DRAFT:
        config = method.speculative_config("<the target itself>")
        return f"`{key}`: `--speculative-config '{config}'` (the target drafts for itself)"
    if method.draft == SHALLOW_DRAFT:
        config = method.speculative_config("<the shallow draft>")
        return f"`{key}`: `--speculative-config '{config}'` (the target's first layers)"
    config = method.speculative_config(f"<the {method.draft} model>")
    return f"`{key}`: `--speculative-config '{config}'` (same seed, so the target's tokenizer)"


def drafting(group: Sequence[Run]) -> list[str]:
    """`acceptance` and `accepted/step` cells, `median (min-max)` over the group's starts;
    none for runs kept before the map read the SD counters."""
    if not all(run.sd_counts for run in group):
        return []
    return [spread([r.acceptance for r in group]), spread([r.accepted_per_step for r in group])]


def section(
    model: str, method: str, by_config: dict[Config, list[Run]], meta: dict[str, Any]
) -> list[str]:
    """The tables of one model and method: medians, ratios against plain vLLM (as installed,
    and with the same threads and binding), reserving no CPU, and where the CPU went."""
    levels: list[int] = meta["concurrency"]
    mine = [c for c in by_config if c.model == model and c.method == method]
    header = " | ".join(f"TPOT ms C={c}" for c in levels)
    header += " | " + " | ".join(f"tok/s C={c}" for c in levels)
    counted = all(drafting(by_config[c]) for c in mine)
    header += " | acceptance | accepted/step" if counted else ""
    lines = [
        f"### Model `{model}`, method `{method}`",
        "",
        f"| threads (cores) | setting | worker maps | start-up s | {header} |",
        "|---|---|---|---|" + "---|" * (2 * len(levels) + 2 * counted),
    ]
    for config in mine:
        group = by_config[config]
        tpots = [spread([r.phase(c).tpot_ms for r in group]) for c in levels]
        rates = [f"{statistics.median(r.phase(c).tokens_per_s for r in group):.0f}" for c in levels]
        lines.append(
            f"| {config.threads} ({group[0].core_ids}) | {config.setting} | {group[0].worker} "
            f"| {statistics.median(r.startup_s for r in group):.0f} | "
            + " | ".join(tpots + rates + (drafting(group) if counted else []))
            + " |"
        )
    against_plain = [(c, baseline_of(c)) for c in mine if c != baseline_of(c)]
    as_installed = Config(model, method, "default", "libgomp")
    docker = Config(model, method, "default", DOCKER_RECIPE)
    comparisons = [
        (
            "Against plain vLLM as installed (libgomp, vLLM's default reservation and binding):",
            [(c, as_installed) for c in mine if c != as_installed],
        ),
        (
            "Against the vLLM Docker image's recipe (tcmalloc and libiomp5 preloaded, vLLM's "
            "default reservation and binding):",
            [(c, docker) for c in mine if c not in (docker, as_installed)],
        ),
        (
            "Against plain vLLM with the same threads and binding (libgomp, or libgomp-nobind):",
            against_plain,
        ),
        (
            "Reserving no CPU (`all`) against vLLM's default reservation, same setting:",
            [(c, replace(c, threads="default")) for c in mine if c.threads == "all"],
        ),
    ]
    for title, pairs in comparisons:
        lines += comparison(title, pairs, by_config, levels)
    lines += [
        "",
        "Where the CPU went during each phase (cores busy of "
        f"{meta['machine']['cpus']}, median; worker / EngineCore / API server):",
        "",
        "| threads | setting | " + " | ".join(f"C={c}" for c in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    for config in mine:
        group = by_config[config]
        cells = [
            " / ".join(
                f"{statistics.median(r.phase(c).cores.get(role, 0.0) for r in group):.2f}"
                for role in ROLES
            )
            for c in levels
        ]
        lines.append(f"| {config.threads} | {config.setting} | " + " | ".join(cells) + " |")
    return [*lines, *limit_rows(mine, by_config, meta), ""]


def round_loads(runs: Sequence[Run]) -> str:
    """`1: median (min-max)` of the load average before each start, per round: what else
    ran on the host then (the rounds pair configurations measured under the same load)."""
    rounds = sorted({run.round for run in runs})
    return "; ".join(
        f"{r + 1}: {spread([run.load_before for run in runs if run.round == r])}" for r in rounds
    )


def markdown(runs: Sequence[Run], meta: dict[str, Any], redrawn: bool = False) -> str:
    configs = list(dict.fromkeys(run.config for run in runs))
    by_config = {c: [r for r in runs if r.config == c] for c in configs}
    levels: list[int] = meta["concurrency"]
    machine = meta["machine"]
    loads = [run.load_before for run in runs]
    methods = list(dict.fromkeys(c.method for c in configs))
    lines = [
        "## vLLM with speculative decoding: the map (`bench_vllm.py`)",
        "",
        f"- Machine: {machine['cpu']}, {machine['cpus']} CPUs, {machine['memory']}, "
        f"{machine['kernel']}; CPU flags: {machine['flags']}",
        f"- Host shape of every server: {meta.get('shape', 'idle: the whole host, idle')}",
        f"- Software: {meta['versions']}; Python {meta['python']}",
        f"- Command: `{meta['command']}`",
        f"- Ran {meta['started']}, {meta['minutes']:.0f} min, {len(runs)} vLLM starts; "
        f"1-min load average before each start: {min(loads):.1f}-{max(loads):.1f} "
        f"(by round: {round_loads(runs)})",
        *(f"- Model `{name}`: {text}" for name, text in meta["models"].items()),
        "- Methods: " + "; ".join(method_line(key) for key in methods),
        f"- Load per start, after {WARMUP_REQUESTS} warm-up requests: for each concurrency "
        f"level C in {levels}, C clients stream greedy completions of exactly "
        f"{meta['max_tokens']} tokens (`ignore_eos`) one after another for "
        f"{meta['phase_seconds']:.0f} s. TPOT = mean of vLLM's own `{TPOT_METRIC}` over the "
        "phase (ms); tok/s = output tokens / phase wall time.",
        f"- {meta['rounds']} rounds, the order of the starts rotated each round; cells are "
        "`median (min-max)` over rounds. Threads: `default` = vLLM's default reservation "
        "(one CPU per local rank kept for the front end), `all` = "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=0, both bound by vLLM (VLLM_CPU_OMP_THREADS_BIND "
        "`auto`, its default); `nobind` = VLLM_CPU_OMP_THREADS_BIND=nobind (vLLM binds "
        "nothing and sets no OMP_*/KMP_*; the team spans every CPU).",
        "",
    ]
    for model, method in dict.fromkeys((c.model, c.method) for c in configs):
        lines += section(model, method, by_config, meta)
    warned = sorted({r.config.setting for r in runs if r.sd_warning})
    acceptance = [
        f"{key} {spread([r.acceptance for r in runs if r.config.method == key])}" for key in methods
    ]
    lines += [
        f"SD acceptance per start, by method: {'; '.join(acceptance)}. vLLM's SD warning "
        f"printed by: {', '.join(warned) or 'none'}.",
    ]
    if redrawn:  # the launcher has changed since: only a run shows what it prints now
        lines += [
            "",
            "The launcher's INFO lines are listed by a run, not by a redraw: those kept in the "
            "JSON (`launcher_info`) are what the launcher of that day printed; "
            "`vllm-cpu-launch --dry-run` shows today's.",
        ]
    else:
        infos = dict.fromkeys(r.launcher_info for r in runs if r.launcher_info)
        lines += ["", "The launcher's INFO lines:", "", *(f"- `{info}`" for info in infos)]
    return "\n".join(lines) + "\n"


def update_markdown(path: Path, section: str, markers: str = MARKERS) -> None:
    """Replace the section of `path` between `<!-- MARKERS: begin -->` and `end` (or append
    it), leaving the rest as it is: one file can hold the reports of several maps."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    begin, end = f"<!-- {markers}: begin -->", f"<!-- {markers}: end -->"
    block = f"{begin}\n{section}{end}\n"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail.lstrip("\n")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    path.write_text(text, encoding="utf-8")

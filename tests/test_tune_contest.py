"""vllm_cpu_launch/verbs/tune/contest.py without vLLM: the order of the rounds, the noise
rule that names a winner, what is compared besides the runtime, and a serving tune's
readings, tables and verdict over its concurrencies (the whole verb runs in
tests/test_tune.py against a stand-in vLLM, and in tests/e2e/test_tune.py for real)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_cpu_launch.errors import EXIT_PROBLEM, LaunchError
from vllm_cpu_launch.settings import Mode
from vllm_cpu_launch.verbs.tune.command import Load
from vllm_cpu_launch.verbs.tune.contest import (
    CONTENDERS,
    Outcome,
    Reading,
    Summary,
    besides_runtime,
    outcome_of,
    overall,
    reading_of,
    rotated,
    table_at,
)

GOMP, IOMP = CONTENDERS


def test_rounds_rotate_the_order() -> None:
    names = [(r, c.name) for r, c in rotated(CONTENDERS, 3)]
    assert names == [
        (0, "libgomp"),
        (0, "libiomp5"),
        (1, "libiomp5"),
        (1, "libgomp"),
        (2, "libgomp"),
        (2, "libiomp5"),
    ]


def test_a_winner_won_every_round_and_the_result_says_what_was_measured() -> None:
    clear = outcome_of([Summary(GOMP, (0.10, 0.11, 0.10)), Summary(IOMP, (0.19, 0.20, 0.21))], IOMP)
    assert clear.winner == GOMP and clear.iomp == "never"
    assert clear.result == (
        "libgomp 2.00x faster than libiomp5: libgomp won 3 of 3 rounds; median 0.1 s vs "
        "0.2 s for libiomp5, spread 0.01 s and 0.02 s"
    )
    noisy = outcome_of([Summary(GOMP, (0.10, 0.14)), Summary(IOMP, (0.11, 0.12))], IOMP)
    assert noisy.winner is None and noisy.iomp == "auto"
    assert noisy.result.startswith("no clear winner: libiomp5 won 1 of 2 rounds; median 0.115")
    assert "faster" not in noisy.result
    default_wins = outcome_of([Summary(GOMP, (0.2, 0.2)), Summary(IOMP, (0.1, 0.1))], IOMP)
    assert default_wins.winner == IOMP and default_wins.iomp == "auto"  # auto already does it
    without_sd = outcome_of([Summary(GOMP, (0.2, 0.2)), Summary(IOMP, (0.1, 0.1))], GOMP)
    assert without_sd.iomp == "always"
    once = outcome_of([Summary(GOMP, (0.1,)), Summary(IOMP, (0.2, 0.2))], IOMP)
    assert once.winner is None and "fewer than 2 runs" in once.result


def test_the_issues_tune_every_round_won_at_1_6x_is_a_winner_not_noise() -> None:
    """SmolLM2-135M, draft_model k=7, 3 rounds: libiomp5 21.6/10.6/17.2 s, libgomp
    27.0/27.5/29.2 s, its order rotated. Its 2x spread exceeds the gap of the medians, so
    the range rule said "within the noise"; it won every round: it wins, and no result
    says "faster" beside "no clear winner"."""
    measured = [Summary(GOMP, (27.0, 27.5, 29.2)), Summary(IOMP, (21.6, 10.6, 17.2))]
    outcome = outcome_of(measured, IOMP)
    assert outcome.winner == IOMP and outcome.iomp == "auto"
    assert outcome.result.startswith("libiomp5 1.60x faster than libgomp: libiomp5 won 3 of 3")
    assert "median 17.2 s vs 27.5 s for libgomp, spread 11 s and 2.2 s" in outcome.result
    # One round lost: no winner, and the line says what happened, not "faster".
    split = outcome_of([Summary(GOMP, (27.0, 10.0, 29.2)), Summary(IOMP, (21.6, 10.6, 17.2))], IOMP)
    assert split.winner is None and "faster" not in split.result
    assert split.result.startswith("no clear winner: libiomp5 won 2 of 3 rounds; median 17.2")
    # Two rounds both won, but within the larger range: not enough for a winner.
    two = outcome_of([Summary(GOMP, (0.20, 0.21)), Summary(IOMP, (0.19, 0.10))], IOMP)
    assert two.winner is None and "won 2 of 2 rounds" in two.result


def test_the_table_names_what_else_the_candidates_differ_in() -> None:
    gomp = {"VLLMCPULAUNCH_PLANNED": "launcher"}
    iomp = {"LD_PRELOAD": "/l/libtcmalloc_minimal.so.4:/v/libiomp5.so", "KMP_BLOCKTIME": "5"}
    line = besides_runtime({"libgomp": gomp, "libiomp5": iomp}, "")
    assert line == (
        "compared:  the OpenMP runtime and more: libgomp adds nothing else; "
        "libiomp5 preloads /l/libtcmalloc_minimal.so.4"
    )
    both = {**iomp, "LD_PRELOAD": "/l/libtcmalloc_minimal.so.4"}
    alike = besides_runtime({"libgomp": both, "libiomp5": iomp}, "")
    assert alike == "compared:  the OpenMP runtime only (and its KMP_BLOCKTIME)"
    nobind = {**iomp, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert "sets VLLM_CPU_OMP_THREADS_BIND=nobind" in besides_runtime(
        {"libgomp": both, "libiomp5": nobind}, ""
    )


# ---------------------------------------------------------------- a serving tune


def saved_result(path: Path, **figures: float) -> str:
    """A result file as `vllm bench serve --save-result` writes it (the keys tune reads,
    among others it ignores)."""
    saved = {"date": "20261205-142300", "backend": "openai-chat", "num_prompts": 8}
    path.write_text(json.dumps({**saved, **figures}), encoding="utf-8")
    return str(path)


def test_a_reading_is_what_the_client_saved(tmp_path: Path) -> None:
    figures = {"mean_tpot_ms": 22.1, "output_throughput": 45.2, "completed": 8}
    drafts = {"spec_decode_draft_tokens": 120, "spec_decode_accepted_tokens": 84}
    result = saved_result(tmp_path / "c4.json", **figures, **drafts)
    assert reading_of(4, result, str(tmp_path / "c4.log")) == Reading(4, 22.1, 45.2, 8, 120, 84)
    # Without SD the client saves no draft counts: none drafted.
    plain = saved_result(tmp_path / "plain.json", **figures)
    assert reading_of(1, plain, "log").drafted == 0


@pytest.mark.parametrize(
    ("figures", "part"),
    [
        ({"output_throughput": 45.2, "completed": 8}, "lacks its figures"),
        ({"mean_tpot_ms": "n/a", "output_throughput": 45.2, "completed": 8}, "lacks its figures"),
        ({"mean_tpot_ms": 0.0, "output_throughput": 0.0, "completed": 0}, "no request completed"),
    ],
)
def test_a_result_without_a_measurement_is_one_error_naming_it_and_the_log(
    tmp_path: Path, figures: dict[str, object], part: str
) -> None:
    """vLLM's client exits 0 when every request failed, or may save other keys: the tune
    stops with EXIT_PROBLEM, naming the result or the concurrency and the log kept."""
    result = tmp_path / "c1.json"
    result.write_text(json.dumps(figures), encoding="utf-8")
    log = str(tmp_path / "c1.log")
    with pytest.raises(LaunchError) as raised:
        reading_of(1, str(result), log)
    assert raised.value.code == EXIT_PROBLEM and part in raised.value.message
    assert raised.value.message.endswith(f"; log: {log}") and "\n" not in raised.value.message
    missing = tmp_path / "never-written.json"
    with pytest.raises(LaunchError) as raised:
        reading_of(1, str(missing), log)
    assert f"its result {missing} lacks its figures" in raised.value.message


def test_a_winner_overall_won_at_every_concurrency() -> None:
    iomp_won = outcome_of([Summary(GOMP, (20.0, 21.0, 20.5)), Summary(IOMP, (10.0,) * 3)], IOMP)
    gomp_won = outcome_of([Summary(GOMP, (10.0,) * 3), Summary(IOMP, (20.0, 21.0, 20.5))], IOMP)
    noise = outcome_of([Summary(GOMP, (10.0, 20.0)), Summary(IOMP, (20.0, 10.0))], IOMP)
    everywhere = overall({1: iomp_won, 4: iomp_won, 8: iomp_won}, IOMP)
    assert everywhere == Outcome(IOMP, Mode.AUTO, "libiomp5 won at every concurrency (1, 4, 8)")
    assert overall({1: gomp_won, 4: gomp_won}, IOMP).iomp == Mode.NEVER  # not the default
    split = overall({1: iomp_won, 4: gomp_won, 8: noise}, IOMP)
    assert split == Outcome(
        None,
        Mode.AUTO,
        "no candidate won at every concurrency "
        "(at 1: libiomp5; at 4: libgomp; at 8: no clear winner)",
    )
    assert overall({1: noise, 4: noise}, IOMP).winner is None  # no winner anywhere: none


def test_a_concurrencys_table_shows_tpot_speed_and_accepted_drafts() -> None:
    load = Load((1, 4), "prompts.jsonl", ("a b c d",), None, 64)
    runs = {
        GOMP: [Reading(4, 30.0, 100.0, 16, 300, 150), Reading(4, 32.0, 90.0, 16, 300, 160)],
        IOMP: [Reading(4, 20.0, 150.0, 16, 0, 0), Reading(4, 22.0, 140.0, 16, 0, 0)],
    }
    title, header, gomp, iomp = table_at(4, runs, load)
    assert title == "concurrency 4 (16 requests of 64 tokens a start)"  # 4 a stream
    columns = "candidate --iomp rounds TPOT ms min-max ms tokens/s accepted speed vs libgomp"
    assert header.split() == columns.split()
    gomp_row = ["libgomp", "never", "2", "31.00", "30.00-32.00", "95.0", "310/600", "1.00x"]
    assert gomp.split() == gomp_row
    iomp_row = ["libiomp5", "always", "2", "21.00", "20.00-22.00", "145.0", "none", "drafted"]
    assert iomp.split() == [*iomp_row, f"{31.0 / 21.0:.2f}x"]

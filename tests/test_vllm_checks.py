"""What vLLM itself will do with a command that the plan does not: refuse its speculative
config or an unknown option, and write over the block time and thread count handed on in
each worker it binds. Each case is the launcher as a fresh process (`--dry-run --json`,
a start of a recording `vllm`, `rules serve`); the command always reaches vLLM unchanged.
tests/e2e/test_readme_commands.py checks the refusals against vLLM 0.32's own checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch.command import REFUSALS, SPECULATIVE_SOURCE
from vllm_cpu_launch.rules import BOUND_WORKERS_SOURCE

from .conftest import clean_environ, read_record, run_launcher

NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
REFUSED = "vLLM will refuse this speculative config"


def dry_run(tmp_path: Path, vllm_env: Path, vllm_args: list[str], **extra: str) -> dict[str, Any]:
    """`--dry-run --json serve m VLLM_ARGS...`: the decision record."""
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "--json", "serve", "m"]
    result = run_launcher([*args, *vllm_args], clean_environ(tmp_path, **extra))
    assert result.returncode == 0, result.stderr
    record: dict[str, Any] = json.loads(result.stdout)
    assert record["command"][3:] == vllm_args  # what the user gave reaches vLLM unchanged
    return record


@pytest.mark.parametrize(
    ("vllm_args", "problem", "fix"),
    [
        (["-sc", '{"method":"ngram"}'], "ngram without num_speculative_tokens", '"num_spec'),
        (["--speculative-config", '{"model":"ngram"}'], "ngram without num_spec", "add"),
        (["--speculative-config.method", "ngram"], "ngram without num_speculative_tokens", "3"),
        (["-sc", '{"method":"ngram","num_speculative_tokens":0}'], "greater than zero", "3"),
        (["-sc", NGRAM, "--speculative-config.num_speculative_tokens", "-1"], "than zero", "3"),
        (
            ["-sc", '{"method":"ngram","num_speculative_tokens":3,"tensor_parallel_size":1}'],
            "tensor_parallel_size is no field",
            "draft_tensor_parallel_size",
        ),
        (
            ["-sc", NGRAM[:-1] + ',"prompt_lookup_min":5,"prompt_lookup_max":3}'],
            "prompt_lookup_min is greater than prompt_lookup_max",
            "at most",
        ),
    ],
)
def test_a_speculative_config_vllm_refuses_is_one_warning_with_vllms_source_and_the_fix(
    tmp_path: Path, vllm_env: Path, vllm_args: list[str], problem: str, fix: str
) -> None:
    record = dry_run(tmp_path, vllm_env, vllm_args)
    (warning,) = [w for w in record["warnings"] if w.startswith(REFUSED)]
    assert problem in warning.split("; Fix: ")[0] and fix in warning.split("; Fix: ")[1]
    assert SPECULATIVE_SOURCE in warning and "vllm/config/speculative.py" in warning
    assert record["speculative"]["requested"]


@pytest.mark.parametrize(
    "vllm_args",
    [
        ["-sc", NGRAM],
        [
            "--speculative-config.method",
            "ngram",
            "--speculative-config.num_speculative_tokens",
            "3",
        ],
        ["--spec-method", "ngram", "--spec-tokens", "3"],
        ["-sc", '{"method":"draft_model","model":"/m/draft"}'],  # the draft's n_predict may do
    ],
)
def test_a_config_vllm_accepts_gets_no_refusal(
    tmp_path: Path, vllm_env: Path, vllm_args: list[str]
) -> None:
    record = dry_run(tmp_path, vllm_env, vllm_args)
    assert not [w for w in record["warnings"] if w.startswith(REFUSED)], record["warnings"]


def test_each_refusal_names_vllms_file_and_a_fix() -> None:
    for refusal in REFUSALS:
        assert refusal.source.startswith("vllm/config/speculative.py, SpeculativeConfig.")
        assert refusal.fix and refusal.problem


@pytest.mark.parametrize(
    "word", ["--speculative-confg", "--speculative_confg", "--speculatve-config", "--spec-metod"]
)
def test_a_near_miss_of_an_sd_option_is_a_did_you_mean(
    tmp_path: Path, vllm_env: Path, word: str
) -> None:
    record = dry_run(tmp_path, vllm_env, [word, NGRAM])
    meant = "--spec-method" if word == "--spec-metod" else "--speculative-config"
    assert f"did you mean {meant}?" in record["reason"], record["reason"]
    (warning,) = [w for w in record["warnings"] if word in w]
    assert warning == f"{word} is no option of vLLM's (vLLM will refuse it): did you mean {meant}?"
    assert not record["speculative"]["requested"] and record["preload"] == []


@pytest.mark.parametrize(
    "vllm_args",
    [
        ["--compilation-config", "{}"],  # vLLM 0.32's option nearest an SD option (0.7)
        ["--max-num-scheduled-tokens", "8"],
        ["--model", "m2"],
        ["--specu", NGRAM],  # an abbreviation argparse expands to --speculative-config
    ],
)
def test_vllms_own_options_are_no_near_miss(
    tmp_path: Path, vllm_env: Path, vllm_args: list[str]
) -> None:
    record = dry_run(tmp_path, vllm_env, vllm_args)
    assert "did you mean" not in json.dumps(record)


# --------------------------------------------------- what vLLM writes in its bound workers


def test_a_kept_block_time_is_said_to_stop_at_the_bound_workers(
    tmp_path: Path, vllm_env: Path, record_file: Path
) -> None:
    """The user's KMP_BLOCKTIME=1 is kept (no map rule applies over it), and vLLM sets 5
    in each worker it binds: the INFO line, --dry-run and `rules serve` say so."""
    record = dry_run(tmp_path, vllm_env, ["-sc", NGRAM], KMP_BLOCKTIME="1")
    assert record["relies_on"] == {"KMP_BLOCKTIME": "1"} and "KMP_BLOCKTIME" not in record["env"]
    (note,) = [n for n in record["notes"] if BOUND_WORKERS_SOURCE in n]
    assert note.startswith("KMP_BLOCKTIME=1 reaches the front end and the engine core; ")
    assert "vLLM sets KMP_BLOCKTIME=5 in each worker it binds" in note
    assert note.endswith("VLLM_CPU_OMP_THREADS_BIND=nobind lets yours through to the workers")
    vllm = str(vllm_env / "bin" / "vllm")
    environ = clean_environ(tmp_path, KMP_BLOCKTIME="1", RECORD_TO=str(record_file))
    started = run_launcher(["--vllm", vllm, "serve", "m", "-sc", NGRAM], environ)
    assert started.returncode == 0, started.stderr
    assert read_record(record_file)["KMP_BLOCKTIME"] == "1"  # handed on as set
    (info,) = [line for line in started.stderr.splitlines() if "requested by -sc" in line]
    assert info.endswith(
        "KMP_BLOCKTIME=1 in the front end and engine core; KMP_BLOCKTIME=5 in the workers "
        "vLLM binds (VLLM_CPU_OMP_THREADS_BIND=nobind keeps yours)"
    )
    rules = run_launcher(["--vllm", vllm, "rules", "serve", "m", "-sc", NGRAM], environ)
    assert rules.returncode == 0, rules.stderr
    assert f"vLLM:     {note}" in rules.stdout.splitlines()


@pytest.mark.parametrize(
    "variables",
    [
        {"KMP_BLOCKTIME": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},  # vLLM sets nothing
        {"KMP_BLOCKTIME": "5"},  # what vLLM sets anyway
        {},  # the plan's own block time (a rule's nobind, or vLLM's 5)
    ],
)
def test_where_the_workers_get_the_value_handed_on_nothing_is_said(
    tmp_path: Path, vllm_env: Path, variables: dict[str, str]
) -> None:
    record = dry_run(tmp_path, vllm_env, ["-sc", NGRAM], **variables)
    assert not [n for n in record["notes"] if BOUND_WORKERS_SOURCE in n], record["notes"]


def test_a_kept_thread_count_is_said_to_stop_at_the_bound_workers(
    tmp_path: Path, vllm_env: Path
) -> None:
    record = dry_run(tmp_path, vllm_env, ["-sc", NGRAM], OMP_NUM_THREADS="1")
    (note,) = [n for n in record["notes"] if BOUND_WORKERS_SOURCE in n]
    assert note.startswith("OMP_NUM_THREADS=1 reaches the front end and the engine core; ")

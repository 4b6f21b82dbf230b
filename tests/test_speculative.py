"""SD detection in every form vLLM accepts, both ways (requested and not)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_cpu_launch.speculative import detect, parse_json

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


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "m", "--speculative-config", "{method: ngram}"],
        ["serve", "m", "-sc={"],
        ["serve", "m", "--speculative-config"],  # value missing
    ],
)
def test_malformed_json_counts_as_requested_with_a_note(argv: list[str]) -> None:
    result = detect(argv)
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
        (None, "cannot be read"),  # missing file
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


@pytest.mark.parametrize("form", ["positional", "--model", "--model="])
def test_a_speculators_checkpoint_requests_sd_by_itself(tmp_path: Path, form: str) -> None:
    """vLLM turns SD on for a model whose config.json has speculators_config."""
    model = str(speculators_model(tmp_path / "eagle", True))
    argv = {
        "positional": ["serve", model],
        "--model": ["serve", "--model", model],
        "--model=": ["bench", "latency", f"--model={model}"],
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


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(value=JSON_VALUES, spaces=st.sampled_from(["", " ", "\n\t ", "\r\n"]))
def test_parse_json_returns_what_json_loads_returns(value: object, spaces: str) -> None:
    text = spaces + json.dumps(value) + spaces
    assert parse_json(text) == json.loads(text)


@given(text=st.text(max_size=40) | st.sampled_from(["{", "[1,]", '{"a":1} x', "nul", "NaN"]))
def test_parse_json_fails_exactly_where_json_loads_fails(text: str) -> None:
    try:
        expected: object = json.loads(text)
    except ValueError as error:
        with pytest.raises(ValueError) as raised:
            parse_json(text)
        assert str(raised.value) == str(error)
    else:
        parsed = parse_json(text)
        assert parsed == expected or (parsed != parsed and expected != expected)  # NaN


@pytest.mark.parametrize(
    ("argv", "method", "tokens"),
    [
        (["serve", "m", "-sc", '{"method":"ngram","num_speculative_tokens":3}'], "ngram", 3),
        # vLLM infers the method from the draft (draft_model, eagle...): not known here
        (["serve", "m", "-sc", '{"model":"/d","num_speculative_tokens":7}'], None, 7),
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
        (["serve", "m", "--spec-model", "/d"], None, None),
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
            None,
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


def test_the_method_and_token_count_in_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "speculative_config:\n  method: draft_model\n  model: /d\n  num_speculative_tokens: 7\n"
        "  nested: {deep: [1, 2]}\n"
    )
    request = detect(["serve", "m", "--config", str(config)])
    assert (request.requested, request.method, request.tokens) == (True, "draft_model", 7)
    assert detect(["serve", "m"]).method is None

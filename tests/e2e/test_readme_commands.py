"""Every `vllm-cpu-launch ... serve` and `vllm serve` command in README.md and docs/ is a
command vLLM accepts, as far as vLLM's own argument parser and its SpeculativeConfig.

The commands are read from the fenced blocks of the markdown (a line, or lines joined by a
trailing backslash, whose program is `vllm-cpu-launch` or `vllm`, `~/vllm-env/bin/...` and
`ExecStart=...` and `eval "$(...)"` included, with `serve` among its words); none is
skipped silently: a line that is no command (a usage synopsis) is listed in NOT_RUN with
its reason, and a listed line that is no longer in the docs fails too. Each command's
`serve` arguments are given to vLLM 0.32.0's own parser (`make_arg_parser`), then to
`AsyncEngineArgs.from_cli_args`, `create_model_config` and `create_speculative_config`,
in one Python of the real vLLM environment, without starting a server. The model each
names (`MODEL`, `$MODEL`, a path of another host) is the real model here, and `$SPEC` is
the value the docs give it: the check is of the options, not of the weights.

The launcher's own reading of the same commands (REFUSALS, the SD near-miss) is checked
against vLLM's verdict here too, on the docs' commands and on ones vLLM refuses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from .conftest import REAL_VLLM, SCRIPTS, last_json_line_of

pytestmark = REAL_VLLM

REPO = SCRIPTS.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
PROGRAMS = ("vllm-cpu-launch", "vllm")
# Lines the extraction finds that are no command to run, each with why (file, text start).
NOT_RUN = {
    ("docs/design.md", "vllm-cpu-launch systemd-unit [UNIT OPTIONS]"): "a usage synopsis",
    ("docs/design.md", "vllm-cpu-launch tune [--write] [TUNE OPTIONS]"): "a usage synopsis",
    ("docs/operating.md", "vllm-cpu-launch systemd-unit [--name NAME]"): "a usage synopsis",
}
# `$SPEC` as docs/operating.md gives it for its multi-node commands.
SPEC = re.compile(r"`SPEC='([^']*)'`")
# Runs in the vLLM environment: for each argv (after `serve`), vLLM's verdict.
CHECK_WITH_VLLM = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.29 to 0.32
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.config import ParallelConfig

parser = make_arg_parser(FlexibleArgumentParser())
verdicts = []
for argv in json.load(sys.stdin):
    try:
        args = parser.parse_args(argv)
    except SystemExit as exited:  # argparse: --help (0) or a refusal (2), said on stderr
        verdicts.append({"parser": exited.code, "speculative": None, "refused": None})
        continue
    if args.model_tag:  # as `vllm serve` does (vllm/entrypoints/cli/serve.py)
        args.model = args.model_tag
    engine = AsyncEngineArgs.from_cli_args(args)
    try:
        config = engine.create_speculative_config(engine.create_model_config(), ParallelConfig())
    except Exception as error:  # vLLM's own refusal (pydantic's ValidationError, ValueError)
        verdicts.append({"parser": 0, "speculative": None, "refused": str(error)[:500]})
        continue
    method = config.method if config is not None else None
    verdicts.append({"parser": 0, "speculative": method, "refused": None})
print(json.dumps(verdicts))
"""
CHECK_LIMIT_S = 600
# Commands vLLM 0.32 refuses, which the launcher says it will (REFUSALS, the near-miss).
REFUSED = [
    ["-sc", '{"method":"ngram"}'],  # the README's dry-run example before issue 36
    ["-sc", '{"method":"ngram","num_speculative_tokens":0}'],
    ["-sc", '{"method":"ngram","num_speculative_tokens":3,"tensor_parallel_size":1}'],
    [
        "-sc",
        '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":5,"prompt_lookup_max":3}',
    ],
    ["--speculative-config.method", "ngram"],
    ["--speculative-confg", '{"method":"ngram","num_speculative_tokens":3}'],
    ["--speculative_confg", '{"method":"ngram","num_speculative_tokens":3}'],
]


def logical_lines(block: str) -> list[str]:
    """A fenced block's lines, a trailing backslash joining a line to the next."""
    lines: list[str] = []
    for line in block.splitlines():
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + line.strip()
        else:
            lines.append(line)
    return lines


def command_words(line: str) -> list[str] | None:
    """The words of a command line whose program is vllm-cpu-launch or vllm and that has a
    `serve` word; None for any other line (a comment, output, another program)."""
    text = line.strip().removeprefix("ExecStart=")
    text = re.sub(r'^eval "\$\((.*)\)"', r"\1", text.split("   #")[0])
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return None
    operators = [i for i, word in enumerate(words) if not word.strip("();<>|&")]
    words = words[: operators[0]] if operators else words  # up to `>`, `|`, `&&`...
    if not words or os.path.basename(words[0]) not in PROGRAMS or "serve" not in words:
        return None
    return words


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(file, line as written, words) of every serve command in the docs' fenced blocks."""
    found = []
    for path in DOCS:
        for block in FENCE.findall(path.read_text(encoding="utf-8")):
            for line in logical_lines(block):
                words = command_words(line)
                if words is not None:
                    found.append((str(path.relative_to(REPO)), line.strip(), words))
    return found


def serve_arguments(words: list[str], model: Path, spec: str) -> list[str]:
    """What `serve` is given, as vLLM's parser receives it: the model the real one, `$SPEC`
    the docs' value."""
    arguments = words[words.index("serve") + 1 :]
    arguments = [spec if word == "$SPEC" else word for word in arguments]
    if arguments and not arguments[0].startswith("-"):
        arguments[0] = str(model)
    return arguments


def vllm_verdicts(vllm_env: Path, cases: list[list[str]]) -> list[dict[str, Any]]:
    verdicts: list[dict[str, Any]] = last_json_line_of(
        vllm_env, CHECK_WITH_VLLM, cases, CHECK_LIMIT_S
    )
    return verdicts


def launcher_warnings(vllm_env: Path, arguments: list[str]) -> list[str]:
    """The warnings of the launcher's plan for `serve ARGUMENTS` (a fresh process)."""
    launcher = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(vllm_env / "bin" / "vllm")]
    result = subprocess.run(
        [*launcher, "--dry-run", "--json", "serve", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    warnings: list[str] = json.loads(result.stdout)["warnings"]
    return warnings


def vllms_word(warnings: list[str]) -> list[str]:
    """The launcher's warnings that vLLM will refuse the command."""
    return [w for w in warnings if "vLLM will refuse" in w]


def test_every_documented_serve_command_passes_vllms_checks(
    vllm_env: Path, real_model: Path
) -> None:
    operating = (REPO / "docs" / "operating.md").read_text(encoding="utf-8")
    (spec,) = set(SPEC.findall(operating))
    found = documented_commands()
    skipped = {
        key for key in NOT_RUN if any(w == key[0] and t.startswith(key[1]) for w, t, _ in found)
    }
    assert skipped == set(NOT_RUN), f"NOT_RUN lists lines not in the docs: {set(NOT_RUN) - skipped}"
    runs = [
        (where, line, serve_arguments(words, real_model, spec))
        for where, line, words in found
        if not any(where == f and line.startswith(start) for f, start in NOT_RUN)
    ]
    assert any(where == "README.md" for where, _, _ in runs) and len(runs) >= 15, runs
    verdicts = vllm_verdicts(vllm_env, [arguments for _, _, arguments in runs])
    for (where, line, arguments), verdict in zip(runs, verdicts, strict=True):
        said = f"{where}: {line}\n  vLLM: {verdict}"
        assert verdict["parser"] == 0 and verdict["refused"] is None, said
        if "--help" not in arguments:
            assert verdict["speculative"] == "ngram", said  # every documented start asks SD
            assert vllms_word(launcher_warnings(vllm_env, arguments)) == [], said
        print(f"ok {where}: {line}")


def test_what_vllm_refuses_the_launcher_says_it_will(vllm_env: Path, real_model: Path) -> None:
    cases = [[str(real_model), *arguments] for arguments in REFUSED]
    verdicts = vllm_verdicts(vllm_env, cases)
    for arguments, verdict in zip(cases, verdicts, strict=True):
        warnings = launcher_warnings(vllm_env, arguments)
        if verdict["parser"] != 0:  # an unknown option: the launcher's near-miss
            assert any("did you mean --speculative-config?" in w for w in warnings), warnings
        else:
            assert verdict["refused"], (arguments, verdict)
            assert len(vllms_word(warnings)) == 1, (arguments, verdict, warnings)

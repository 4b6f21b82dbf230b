"""The command line: the first word picks a verb or starts vLLM; exit codes, never a
traceback for a user's mistake. Everything else is the launch core's (launch.py) or a
verb's (verbs/)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import __version__
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.launch import parse_options, run_exec, run_plan, write_stdout
from vllm_cpu_launch.messages import did_you_mean, emit

if TYPE_CHECKING:
    from collections.abc import Sequence

VERBS = ("doctor", "env", "verify", "systemd-unit", "exec", "tune", "rules")
# vLLM's own subcommands (vllm/entrypoints/cli/main.py, CMD_MODULES, the same in vLLM 0.32,
# 0.33 and 0.34): always passed on, never taken for a mistyped verb.
VLLM_SUBCOMMANDS = (
    "serve",
    "chat",
    "complete",
    "bench",
    "collect-env",
    "run-batch",
    "launch",
    "preload",
    "download-kernels",
    "snapshot",
)

USAGE = """\
usage: vllm-cpu-launch [OPTIONS] [--] VLLM_SUBCOMMAND [VLLM ARGS...]
       vllm-cpu-launch exec [OPTIONS] -- PROGRAM [ARGS...]
       vllm-cpu-launch doctor [--json] [--measure]
       vllm-cpu-launch env [--format shell|systemd|docker|kubernetes|json] [OPTIONS]
                           [--] VLLM_SUBCOMMAND ...
       vllm-cpu-launch verify [--json] [--speculative] PID
       vllm-cpu-launch systemd-unit [UNIT OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]
       vllm-cpu-launch tune [--write] [TUNE OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]
       vllm-cpu-launch rules [--json] [[OPTIONS] [--] VLLM_SUBCOMMAND ...]
"""

HELP = (
    USAGE
    + """
Start vLLM on CPU with Intel OpenMP (libiomp5.so) preloaded when speculative
decoding is requested, then exec it: vLLM keeps the launcher's PID.
Example: vllm-cpu-launch serve MODEL --speculative-config '{"method":"ngram",...}'
Everything from the vLLM subcommand on is passed to vLLM unchanged;
`vllm-cpu-launch serve --help` shows vLLM's help. `tune` measures libgomp against
libiomp5 with vLLM's own `vllm bench latency` on your command (see tune --help).

options (before the vLLM subcommand; each has a VLLMCPULAUNCH_* variable):
  --iomp auto|always|never   preload libiomp5: auto = when SD is requested on x86-64,
                             but on a host the benchmark map measured (2 CPUs, vLLM
                             0.32) what measured fastest there (docs/benchmarks.md)
  --iomp-path FILE           use this libiomp5.so (absolute path; still validated)
  --tcmalloc auto|always|never
                             preload tcmalloc: auto = when found, if iomp is preloaded
  --tcmalloc-path FILE       use this tcmalloc library
  --kmp-blocktime VALUE      set KMP_BLOCKTIME (default: keep yours, else 5; 200 under
                             VLLM_CPU_OMP_THREADS_BIND=nobind on the map's host)
  --vllm EXECUTABLE          the vllm to start (default: beside this Python, else PATH)
  --strict                   a wanted library that is missing is an error (exit 3)
  --dry-run [--json]         print the plan, exec nothing
  --launcher-config FILE     YAML settings (default ~/.config/vllm-cpu-launch/config.yaml)
  -q, --quiet                no INFO line    -v, --verbose   explain every candidate
  -h, --help                 this help       --version       the launcher's version

exit codes: 0 ok, 1 verify found a problem, 2 usage or config error, 3 --strict and a
library missing, 126 target not executable, 127 target not found; otherwise vLLM's own.
"""
)


def run_verb(verb: str, values: dict[str, object], rest: list[str]) -> int:
    if verb == "exec":
        return run_exec(values, rest)
    if verb == "doctor":
        from vllm_cpu_launch.verbs.doctor import main as doctor_main

        return doctor_main(values, rest)
    if verb == "env":
        from vllm_cpu_launch.verbs.env import main as env_main

        return env_main(values, rest)
    if verb == "verify":
        from vllm_cpu_launch.verbs.verify import main as verify_main

        return verify_main(values, rest)
    if verb == "tune":
        from vllm_cpu_launch.verbs.tune import main as tune_main

        return tune_main(values, rest)
    if verb == "rules":
        from vllm_cpu_launch.verbs.rules import main as rules_main

        return rules_main(values, rest)
    from vllm_cpu_launch.verbs.systemd_unit import main as systemd_main

    return systemd_main(values, rest)


def dispatch(argv: Sequence[str]) -> int:
    values, rest = parse_options(argv)
    if values.get("help"):
        write_stdout(HELP.rstrip())
        return 0
    if values.get("version"):
        write_stdout(f"vllm-cpu-launch {__version__}")
        return 0
    if not rest:
        raise LaunchError(
            EXIT_USAGE, "no vLLM subcommand given (e.g. serve MODEL); see vllm-cpu-launch --help"
        )
    if "--" not in argv[: len(argv) - len(rest)]:
        if rest[0] in VERBS:
            return run_verb(rest[0], values, rest[1:])
        check_verb(rest[0])
    return run_plan(values, rest, program=None)


def check_verb(word: str) -> None:
    """A first word close to one of our verbs and no vLLM subcommand is a typo: say which
    verb it resembles (`--` before it still passes it to vLLM)."""
    if word in VLLM_SUBCOMMANDS:
        return
    close = did_you_mean(word, VERBS)
    if close:
        raise LaunchError(
            EXIT_USAGE,
            f"unknown verb {word!r}: did you mean {close}? (to pass it to vLLM as a "
            f"subcommand: vllm-cpu-launch -- {word} ...)",
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point: the exit code, never a traceback for user errors."""
    try:
        return dispatch(sys.argv[1:] if argv is None else argv)
    except LaunchError as error:
        emit("error", error.message)
        return error.code
    except KeyboardInterrupt:
        return 130

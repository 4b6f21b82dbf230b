"""The command line: the first word (a verb or vLLM), the dispatch, the exec of the plan,
and exit codes, never a traceback for a user's mistake. The launch core (launch.py) is
below it and below the verbs, which it imports only for the verb named.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import __version__, errors, launch
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.gather import FIRST, LAST
from vllm_cpu_launch.messages import did_you_mean, emit
from vllm_cpu_launch.plan import plan_as_json, plan_as_text

if TYPE_CHECKING:
    from collections.abc import Sequence


EXEC_USAGE = """\
usage: vllm-cpu-launch exec [OPTIONS] -- PROGRAM [ARGS...]

Exec PROGRAM with the same preload as a vLLM launch (Intel OpenMP unless --iomp never),
for programs other than vllm: benchmarks, a Python that imports vLLM, a wrapper script.
The launcher's options (see vllm-cpu-launch --help) go before `--`.
"""


def run_plan(values: dict[str, object], arguments: Sequence[str], program: str | None) -> int:
    if values.get("json") and not values.get("dry_run"):
        raise LaunchError(EXIT_USAGE, "--json goes with --dry-run (or use: env --format json)")
    command = read_command(arguments, vllm=program is None)  # its --config read here, once
    plan = launch.plan_from_options(values, command, program)
    if values.get("dry_run"):
        text = json.dumps(plan_as_json(plan), indent=2) if values.get("json") else None
        launch.write_stdout(text or plan_as_text(plan))
        return 0
    launch.report(plan, values)
    launch.provide_metadata(plan)
    # Python ignores SIGPIPE and SIGXFSZ at start-up, and ignored signals stay ignored
    # across exec: hand the program the default dispositions a shell or subprocess would.
    restored = (signal.SIGPIPE, signal.SIGXFSZ)
    previous = [signal.signal(number, signal.SIG_DFL) for number in restored]
    try:
        os.execve(plan.command[0], list(plan.command), {**os.environ, **dict(plan.env)})
    except OSError as error:
        missing = isinstance(error, FileNotFoundError)
        code = errors.EXIT_NOT_FOUND if missing else errors.EXIT_NOT_EXECUTABLE
        why = error if missing else error.strerror
        raise LaunchError(code, f"cannot start {plan.command[0]}: {why}") from None
    finally:  # only reached when the exec failed: a closed stderr must not kill us
        for number, handler in zip(restored, previous, strict=True):
            signal.signal(number, handler)


# The first word: a verb or vLLM

VERBS = ("doctor", "env", "verify", "systemd-unit", "servers", "exec", "tune", "rules")
# vLLM's own subcommands (vllm/entrypoints/cli/main.py, CMD_MODULES, the same in vLLM 0.32,
# 0.33 and 0.34): always passed on, never taken for a mistyped verb.
VLLM_SUBCOMMANDS = (
    *("serve", "chat", "complete", "bench", "collect-env", "run-batch", "launch", "preload"),
    *("download-kernels", "snapshot"),
)

USAGE = """\
usage: vllm-cpu-launch [OPTIONS] [--] VLLM_SUBCOMMAND [VLLM ARGS...]
       vllm-cpu-launch exec [OPTIONS] -- PROGRAM [ARGS...]
       vllm-cpu-launch doctor [--json]
       vllm-cpu-launch env [--format shell|systemd|docker|kubernetes|json] [OPTIONS]
                           [--] VLLM_SUBCOMMAND ...
       vllm-cpu-launch verify [--json] [--speculative] PID
       vllm-cpu-launch systemd-unit [UNIT OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]
       vllm-cpu-launch servers N [--format FORMAT] [--directory DIR] [OPTIONS] [--] serve MODEL ...
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
libiomp5 on your `serve` command, driven by vLLM's own `vllm bench serve` (see tune --help).

options (before the vLLM subcommand; each has a VLLMCPULAUNCH_* variable):
  --iomp auto|always|never   preload libiomp5: auto = when SD is requested on x86-64,
                             but on a host the benchmark map measured (2 CPUs, vLLM
                             0.32) what measured fastest there (docs/benchmarks.md)
  --iomp-path FILE           use this libiomp5.so (absolute path; still validated)
  --tcmalloc auto|always|never
                             preload tcmalloc: auto = when found, if iomp is preloaded
  --tcmalloc-path FILE       use this tcmalloc library
  --kmp-blocktime VALUE      set KMP_BLOCKTIME (default: keep yours, else 5; 200 under
                             VLLM_CPU_OMP_THREADS_BIND=nobind on the map's host, 0
                             on CPUs shared with other work)
  --host-cpus auto|own|shared
                             whose the CPUs are (the maps ran on vLLM's own): auto =
                             a quota or cpuset says, else a 0.3 s watch of the host
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
    if verb == "exec":  # `exec [OPTIONS] -- PROGRAM [ARGS...]`: the launch, for any program
        more, command = launch.parse_options(rest, verb="exec")
        if more.get("help"):
            launch.write_stdout(EXEC_USAGE.rstrip())
            return 0
        if not command:
            raise LaunchError(EXIT_USAGE, "exec needs a program: vllm-cpu-launch exec -- PROGRAM")
        return run_plan({**values, **more}, command[1:], program=command[0])
    # lazy: only the verb named is imported (the exec path imports none).
    if verb == "doctor":
        from vllm_cpu_launch.verbs.doctor import main as verb_main
    elif verb == "env":
        from vllm_cpu_launch.verbs.env import main as verb_main
    elif verb == "verify":
        from vllm_cpu_launch.verbs.verify import main as verb_main
    elif verb == "tune":
        from vllm_cpu_launch.verbs.tune import main as verb_main
    elif verb == "rules":
        from vllm_cpu_launch.verbs.rules import main as verb_main
    elif verb == "servers":
        from vllm_cpu_launch.verbs.servers import main as verb_main
    else:
        from vllm_cpu_launch.verbs.systemd_unit import main as verb_main
    return verb_main(values, rest)


def dispatch(argv: Sequence[str]) -> int:
    """A verb of ours, else vLLM's subcommand; a near miss of a verb is a typo (`--` before
    it passes it to vLLM)."""
    values, rest = launch.parse_options(argv)
    if values.get("help") or values.get("version"):
        version = f"vllm-cpu-launch {__version__} (vLLM {FIRST} to {LAST} supported)"
        launch.write_stdout(HELP.rstrip() if values.get("help") else version)
        return 0
    if not rest:
        raise LaunchError(
            EXIT_USAGE, "no vLLM subcommand given (e.g. serve MODEL); see vllm-cpu-launch --help"
        )
    word = rest[0]
    if "--" not in argv[: len(argv) - len(rest)]:
        if word in VERBS:
            return run_verb(word, values, rest[1:])
        close = None if word in VLLM_SUBCOMMANDS else did_you_mean(word, VERBS)
        if close:
            raise LaunchError(
                EXIT_USAGE,
                f"unknown verb {word!r}: did you mean {close}? (to pass it to vLLM as a "
                f"subcommand: vllm-cpu-launch -- {word} ...)",
            )
    return run_plan(values, rest, program=None)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return dispatch(sys.argv[1:] if argv is None else argv)
    except LaunchError as error:
        emit("error", error.message)
        return error.code
    except KeyboardInterrupt:
        return 130

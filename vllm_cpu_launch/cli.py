"""The command line: the option grammar, the first word (a verb or vLLM), the plan, the exec,
and exit codes, never a traceback for a user's mistake. The exec path imports neither
psutil, cpuinfo nor yaml (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import __version__, errors
from vllm_cpu_launch.command import SpeculativeRequest, detect, single_worker
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError, did_you_mean, emit
from vllm_cpu_launch.gather import FIRST, LAST, Facts, gather, write_alias
from vllm_cpu_launch.libraries import Host, system_root
from vllm_cpu_launch.plan import STRICT_REFUSAL, plan_as_json, plan_as_text, plan_of, summary_line
from vllm_cpu_launch.settings import Settings, load_settings
from vllm_cpu_launch.target import Target, resolve_program, resolve_vllm

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm_cpu_launch.plan import Plan


SETTING_KEYS = ("iomp", "iomp_path", "tcmalloc", "tcmalloc_path", "kmp_blocktime", "vllm")
# Launcher options that take a value -> the key they fill: --iomp-path fills iomp_path.
VALUED_OPTIONS = {f"--{key.replace('_', '-')}": key for key in SETTING_KEYS}
VALUED_OPTIONS["--launcher-config"] = "config"
FLAG_OPTIONS = {
    **{"--strict": "strict", "--dry-run": "dry_run", "--json": "json"},
    **{"-q": "quiet", "--quiet": "quiet", "-v": "verbose", "--verbose": "verbose"},
    **{"-h": "help", "--help": "help", "--version": "version"},
}
EXEC_USAGE = """\
usage: vllm-cpu-launch exec [OPTIONS] -- PROGRAM [ARGS...]

Exec PROGRAM with the same preload as a vLLM launch (Intel OpenMP unless --iomp never),
for programs other than vllm: benchmarks, a Python that imports vLLM, a wrapper script.
The launcher's options (see vllm-cpu-launch --help) go before `--`.
"""


def unknown_option(token: str, verb: str | None, known: Sequence[str]) -> str:
    """Before the vLLM subcommand an unknown option is most likely vLLM's put too early,
    unless a typo of one of `known` (0.8: --iomp-pth, --stric, but not vLLM's --config)."""
    close = did_you_mean(token.partition("=")[0], known, cutoff=0.8)
    hint = f" (did you mean {close}?)" if close else ""
    if verb is not None:
        return f"unknown option {token!r} for {verb}{hint}; see vllm-cpu-launch {verb} --help"
    if close:
        return f"unknown launcher option {token!r}{hint}; see vllm-cpu-launch --help"
    return (
        f"unknown launcher option {token!r}; vLLM's options go after the subcommand "
        "(vllm-cpu-launch serve MODEL --option ...); see vllm-cpu-launch --help"
    )


def parse_options(
    args: Sequence[str],
    valued: dict[str, str] = VALUED_OPTIONS,
    flags: dict[str, str] = FLAG_OPTIONS,
    repeatable: tuple[str, ...] = (),
    verb: str | None = None,
) -> tuple[dict[str, object], list[str]]:
    """Options up to the first other word or `--`, and the rest untouched; `verb`: whose
    options (None: the launcher's)."""
    values: dict[str, object] = {}
    index = 0
    while index < len(args):
        token = args[index]
        if token == "--":
            return values, list(args[index + 1 :])
        if not token.startswith("-") or token == "-":
            return values, list(args[index:])
        name, has_value, value = token.partition("=")
        if name in valued:
            if not has_value:
                if index + 1 >= len(args):
                    raise LaunchError(EXIT_USAGE, f"{name} needs a value")
                index += 1
                value = args[index]
            key = valued[name]
            if key in repeatable:
                previous = values.get(key, [])
                values[key] = [*previous, value] if isinstance(previous, list) else [value]
            else:
                values[key] = value
        elif name in flags and not has_value:
            values[flags[name]] = True
        else:
            raise LaunchError(EXIT_USAGE, unknown_option(token, verb, [*valued, *flags]))
        index += 1
    return values, []


def current_host() -> Host:
    return Host(
        environ=os.environ,
        machine=os.uname().machine,
        euid=os.geteuid(),
        launcher_prefix=sys.prefix,
        search_path=tuple(sys.path),
        root=system_root(os.environ),
        cpus=len(os.sched_getaffinity(0)),
    )


def launch_settings(values: dict[str, object]) -> Settings:
    options = {key: values[key] for key in (*SETTING_KEYS, "config") if key in values}
    if values.get("strict"):
        options["strict"] = True
    return load_settings(options, os.environ)


def launch_facts(
    settings: Settings,
    target: Target,
    arguments: Sequence[str],
    program: str | None = None,
    host: Host | None = None,
) -> Facts:
    """`vllm ARGUMENTS` as vLLM reads them, or `exec -- PROGRAM ARGUMENTS` (Intel OpenMP by
    default); `rules serve` and doctor's advice gather the same (plan.start_of)."""
    speculative = detect(arguments) if program is None else SpeculativeRequest(False)
    return gather(
        settings,
        arguments,
        speculative,
        target,
        host or current_host(),
        speculative.requested or program is not None,
        one_worker=single_worker(arguments),
        supply_metadata=program is None,
    )


def prepare_launch(
    values: dict[str, object], arguments: Sequence[str], program: str | None = None
) -> tuple[Settings, Target, Plan]:
    settings = launch_settings(values)
    if program is None:
        target = resolve_vllm(settings.vllm, os.environ, sys.executable)
    else:
        target = resolve_program(program, os.environ)
    return settings, target, plan_of(launch_facts(settings, target, arguments, program))


def plan_from_options(
    values: dict[str, object], arguments: Sequence[str], program: str | None = None
) -> Plan:
    """The plan to exec or print. A refused plan is fatal (126); with --strict, so are an
    unsafe target (126) and a wanted library missing (3): one error line, other warnings."""
    settings, _, plan = prepare_launch(values, arguments, program)
    if plan.refused:  # never two OpenMP runtimes, nor a library others can change
        raise LaunchError(errors.EXIT_NOT_EXECUTABLE, f"not starting: {plan.refused[0]}")
    if not settings.strict or not (plan.unsafe or plan.missing):
        return plan
    fatal = list(plan.unsafe or plan.fatal)
    for warning in plan.warnings:
        if warning not in fatal:
            emit("warning", warning)
    if plan.unsafe:
        raise LaunchError(errors.EXIT_NOT_EXECUTABLE, f"{STRICT_REFUSAL}: {'; '.join(fatal)}")
    raise LaunchError(errors.EXIT_LIBRARY_MISSING, "; ".join(fatal))


def write_stdout(text: str) -> None:
    if sys.stdout is None:  # started with file descriptor 1 closed
        raise LaunchError(EXIT_USAGE, "cannot write to standard output: it is closed")
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except (OSError, AttributeError, ValueError) as error:
        raise LaunchError(EXIT_USAGE, f"cannot write to standard output: {error}") from None


def report(plan: Plan, values: dict[str, object], unchanged: str | None = None) -> None:
    """Warnings always; the INFO line unless quiet; notes and candidates when verbose."""
    for warning in plan.warnings:
        emit("warning", warning)
    if not values.get("quiet"):
        emit("info", summary_line(plan, unchanged))
    if values.get("verbose"):
        for note in plan.notes:
            emit("info", note)
        for c in plan.candidates:
            emit("info", f"{c.kind} candidate {c.path!r} from {c.origin}: {c.verdict}, {c.reason}")


def provide_metadata(plan: Plan) -> None:
    """The `vllm` metadata the plan puts on PYTHONPATH; where it cannot be written, start
    anyway (a missing PYTHONPATH entry is ignored)."""
    if plan.metadata is None:
        return
    try:
        write_alias(plan.metadata)
    except OSError as error:
        emit(
            "warning",
            f"cannot write vLLM's missing `vllm` metadata to {plan.metadata.metadata}: "
            f"{error.strerror}; `vllm` may fail with PackageNotFoundError (set "
            "XDG_CACHE_HOME to a directory you can write)",
        )


def run_plan(values: dict[str, object], arguments: Sequence[str], program: str | None) -> int:
    if values.get("json") and not values.get("dry_run"):
        raise LaunchError(EXIT_USAGE, "--json goes with --dry-run (or use: env --format json)")
    plan = plan_from_options(values, arguments, program)
    if values.get("dry_run"):
        json_plan = values.get("json")
        write_stdout(json.dumps(plan_as_json(plan), indent=2) if json_plan else plan_as_text(plan))
        return 0
    report(plan, values)
    provide_metadata(plan)
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

VERBS = ("doctor", "env", "verify", "systemd-unit", "exec", "tune", "rules")
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
    if verb == "exec":  # `exec [OPTIONS] -- PROGRAM [ARGS...]`: the launch, for any program
        more, command = parse_options(rest, verb="exec")
        if more.get("help"):
            write_stdout(EXEC_USAGE.rstrip())
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
    else:
        from vllm_cpu_launch.verbs.systemd_unit import main as verb_main
    return verb_main(values, rest)


def dispatch(argv: Sequence[str]) -> int:
    """A verb of ours, else vLLM's subcommand; a near miss of a verb is a typo (`--` before
    it passes it to vLLM)."""
    values, rest = parse_options(argv)
    if values.get("help") or values.get("version"):
        version = f"vllm-cpu-launch {__version__} (vLLM {FIRST} to {LAST} supported)"
        write_stdout(HELP.rstrip() if values.get("help") else version)
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

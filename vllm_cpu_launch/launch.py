"""The launch core, below the command line and the verbs: the one way every verb, the
launcher and the plugin go from what they were given (options, the vLLM command, a host)
to facts and a plan; the option grammar and what a verb writes. The exec path imports
neither psutil, cpuinfo nor yaml (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import TYPE_CHECKING

from vllm_cpu_launch import errors
from vllm_cpu_launch.command import VllmCommand
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.gather import Facts, gather, write_alias
from vllm_cpu_launch.handoff import Planner
from vllm_cpu_launch.libraries import Host, system_root
from vllm_cpu_launch.messages import did_you_mean, emit
from vllm_cpu_launch.plan import STRICT_REFUSAL, plan_of, summary_line
from vllm_cpu_launch.records import replace
from vllm_cpu_launch.settings import Settings, load_settings, said_setting
from vllm_cpu_launch.shape import host_use, read_others, read_shape
from vllm_cpu_launch.target import Target, resolve_program, resolve_vllm

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm_cpu_launch.plan import Plan


SETTING_KEYS = (
    "iomp",
    "iomp_path",
    "tcmalloc",
    "tcmalloc_path",
    "kmp_blocktime",
    "host_cpus",
    "vllm",
)
# Launcher options that take a value -> the key they fill: --iomp-path fills iomp_path.
VALUED_OPTIONS = {f"--{key.replace('_', '-')}": key for key in SETTING_KEYS}
VALUED_OPTIONS["--launcher-config"] = "config"
FLAG_OPTIONS = {
    **{"--strict": "strict", "--dry-run": "dry_run", "--json": "json"},
    **{"-q": "quiet", "--quiet": "quiet", "-v": "verbose", "--verbose": "verbose"},
    **{"-h": "help", "--help": "help", "--version": "version"},
}


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
    cpus = os.sched_getaffinity(0)
    return Host(
        environ=os.environ,
        machine=os.uname().machine,
        euid=os.geteuid(),
        launcher_prefix=sys.prefix,
        search_path=tuple(sys.path),
        root=system_root(os.environ),
        cpus=len(cpus),
        shape=read_shape(cpus),
    )


def with_use(host: Host, settings: Settings) -> Host:
    """`host` with whose its CPUs are (shape.host_use), where not read yet: only the rules of
    SD on x86-64 ask, and the watch takes shape.WATCH_S. tune reads it once for all starts."""
    if host.use is not None or host.shape is None or host.machine != "x86_64":
        return host
    watch = partial(read_others, host.shape.cpus)
    told = said_setting(settings, "host_cpus")
    return replace(host, use=host_use(host.shape, settings.host_cpus, told, os.cpu_count(), watch))


def launch_settings(values: dict[str, object]) -> Settings:
    options = {key: values[key] for key in (*SETTING_KEYS, "config") if key in values}
    if values.get("strict"):
        options["strict"] = True
    return load_settings(options, os.environ)


def launch_facts(
    settings: Settings,
    target: Target,
    command: VllmCommand,
    program: str | None = None,
    host: Host | None = None,
    planner: Planner = Planner.LAUNCHER,
) -> Facts:
    """The facts of `vllm COMMAND`, or of `exec -- PROGRAM COMMAND` (Intel OpenMP by
    default): for the launcher, every verb and the plugin (planner), which supplies no
    `vllm` metadata (its vLLM has started)."""
    host = host or current_host()
    sd = command.speculative.requested or program is not None
    if sd:
        host = with_use(host, settings)
    return gather(
        settings,
        command,
        target,
        host,
        sd,
        planner=planner,
        supply_metadata=program is None and planner == Planner.LAUNCHER,
    )


def prepare_launch(
    values: dict[str, object],
    command: VllmCommand,
    program: str | None = None,
    host: Host | None = None,
) -> tuple[Settings, Target, Plan]:
    settings = launch_settings(values)
    if program is None:
        target = resolve_vllm(settings.vllm, os.environ, sys.executable)
    else:
        target = resolve_program(program, os.environ)
    return settings, target, plan_of(launch_facts(settings, target, command, program, host))


def plan_from_options(
    values: dict[str, object],
    command: VllmCommand,
    program: str | None = None,
    host: Host | None = None,
) -> Plan:
    """The plan to exec or print (on `host`, else this one's). A refused plan is fatal (126);
    with --strict, so are an unsafe target (126) and a wanted library missing (3): one error
    line, other warnings."""
    settings, _, plan = prepare_launch(values, command, program, host)
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

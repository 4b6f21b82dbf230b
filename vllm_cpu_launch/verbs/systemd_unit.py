"""`vllm-cpu-launch systemd-unit`: a service unit whose ExecStart runs the launcher."""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING, cast

from vllm_cpu_launch import __version__, launch, systemd_syntax
from vllm_cpu_launch.command import VllmCommand, read_command
from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.libraries import SYSTEM_ROOT_VARIABLE
from vllm_cpu_launch.messages import emit
from vllm_cpu_launch.settings import DEPRECATED_PREFIX, SYSTEM_CONFIG, VARIABLE_PREFIX

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm_cpu_launch.target import Target

DEFAULT_NAME = "vllm-cpu-launch"
UNIT_OPTIONS = {"--name": "unit_name", "--user": "unit_user", "--group": "unit_group"}
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.\\-]*\Z")
UNIT_FILE_NAME_MAX = 255  # NAME_MAX: the unit file NAME.service is one file name
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
STOP_MARGIN_S = 60  # beyond vLLM's own --shutdown-timeout (drain), for the engine to exit
DEFAULT_STOP_TIMEOUT_S = 120
# Baked into ExecStart: every valued launcher option (VALUED_OPTIONS' order), then these.
BAKED_FLAGS = (("strict", "--strict"), ("quiet", "--quiet"), ("verbose", "--verbose"))
PATH_KEYS = ("iomp_path", "tcmalloc_path", "config")
PRIVATE_TMP_DIRS = ("/tmp/", "/var/tmp/")  # what PrivateTmp=yes replaces with empty ones

USAGE = """\
usage: vllm-cpu-launch systemd-unit [--name NAME] [--user USER] [--group GROUP]
                                    [--env KEY=VALUE ...] [OPTIONS] [--] serve MODEL [ARGS...]
       vllm-cpu-launch systemd-unit [UNIT OPTIONS] [OPTIONS] [--] exec [--] PROGRAM [ARGS...]

Print a systemd service unit whose ExecStart runs this launcher (by absolute path) with
the launcher OPTIONS given here and the vLLM command line, every word escaped as systemd
requires. Save it as /etc/systemd/system/NAME.service.

  --name NAME         unit, cache and state directory name (default vllm-cpu-launch)
  --user USER         run as USER (default: DynamicUser=yes, a transient user, which
                      always has a private /tmp: a deployment under /tmp needs --user)
  --group GROUP       run with group GROUP
  --env KEY=VALUE     an Environment= line for the service (repeatable)
"""
DYNAMIC_USER = (
    "# No --user given: a transient user; the model must be world-readable.\nDynamicUser=yes"
)
NO_PRIVATE_TMP = "# No PrivateTmp=yes: the launcher, vLLM or a library it preloads is under /tmp."
UNIT = """\
# {name}.service, written by vllm-cpu-launch {version} systemd-unit.
# Install: save as /etc/systemd/system/{name}.service, then
#   systemctl daemon-reload && systemctl enable --now {name}.service
# Logs: journalctl -u {name}.service (launcher messages keep their levels)
[Unit]
Description={description}
Wants=network-online.target
After=network-online.target

[Service]
# exec: started once the launcher runs; it execs vLLM, which keeps the main PID.
Type=exec
ExecStart={exec_start}
{identity}
# vLLM, Hugging Face and torch write caches under HOME/XDG_CACHE_HOME: point them
# at the directories systemd creates for this unit (%S = /var/lib, %C = /var/cache).
Environment=HOME=%S/{name}
Environment=XDG_CACHE_HOME=%C/{name}
Environment=HF_HOME=%C/{name}/huggingface
Environment=VLLM_CACHE_ROOT=%C/{name}/vllm
{environment}CacheDirectory={name}
StateDirectory={name}
WorkingDirectory=%S/{name}
Restart=on-failure
RestartSec=10s
# SIGTERM makes vLLM drain (its --shutdown-timeout) and stop its engine processes;
# mixed: only the main process gets SIGTERM, all of them SIGKILL at the timeout.
KillMode=mixed
TimeoutStopSec={stop_timeout}s
# vLLM's API server and engine open many sockets and files.
LimitNOFILE=65535
# Hardening that vLLM on CPU tolerates. Not MemoryDenyWriteExecute: torch compiles
# kernels at run time. /dev/shm stays writable for vLLM's shared-memory queues.
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
{private_tmp}
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes
SyslogIdentifier={name}

[Install]
WantedBy=multi-user.target"""


def launcher_command() -> list[str]:
    """This launcher by absolute path: its console script, else `python -m`."""
    python = os.path.abspath(sys.executable)
    script = os.path.join(os.path.dirname(python), "vllm-cpu-launch")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    return [python, "-m", "vllm_cpu_launch"]


def baked_options(values: dict[str, object], target: Target | None) -> list[str]:
    """The launcher options of ExecStart, with every path made absolute."""
    options: list[str] = []
    for option, key in launch.VALUED_OPTIONS.items():
        value = values.get(key)
        if key == "vllm" and target is not None and target.found_via != "launcher-environment":
            # The same vLLM as now, whether --vllm, a variable, a config file or PATH
            # found it: the service sees none of the last three as they are here.
            value = target.executable
        if isinstance(value, str):
            absolute = key in PATH_KEYS or (key == "vllm" and os.sep in value)
            options += [option, os.path.abspath(value) if absolute else value]
    return options + [option for key, option in BAKED_FLAGS if values.get(key)]


def user_environment(values: dict[str, object]) -> list[tuple[str, str]]:
    """The --env assignments, each KEY=VALUE with KEY a variable name."""
    pairs = []
    for assignment in cast("list[str]", values.get("unit_env") or []):
        key, has_value, value = assignment.partition("=")
        if not has_value or not VARIABLE_NAME.match(key):
            raise LaunchError(
                EXIT_USAGE, f"--env {assignment!r}: expected KEY=VALUE with KEY a variable name"
            )
        pairs.append((key, value))
    return pairs


def stop_timeout(arguments: Sequence[str]) -> int:
    """TimeoutStopSec: vLLM's `--shutdown-timeout N` (its drain on SIGTERM) and a margin."""
    drain = None
    for index, token in enumerate(arguments):
        option, has_value, value = token.partition("=")
        if not has_value and index + 1 < len(arguments):
            value = arguments[index + 1]
        given = option in ("--shutdown-timeout", "--shutdown_timeout")
        if given and value.isascii() and value.isdigit():
            drain = int(value)
    return DEFAULT_STOP_TIMEOUT_S if drain is None else drain + STOP_MARGIN_S


def render_unit(
    values: dict[str, object],
    environment: list[tuple[str, str]],
    command: list[str],
    arguments: list[str],
    about: str,
    needed: list[str],
    tail: str = "",
) -> str:
    """The unit for `launcher command... -- arguments...` and `tail`, ExecStart's end as
    systemd reads it (servers' `--port ${VARIABLE}`): PrivateTmp only if none of the
    `needed` files is under /tmp."""
    private_tmp = tmp_ok(needed, values)
    user, group = values.get("unit_user"), values.get("unit_group")
    identity = [f"User={user.replace('%', '%%')}" if isinstance(user, str) else DYNAMIC_USER]
    identity += [f"Group={group.replace('%', '%%')}"] if isinstance(group, str) else []
    lines = [f"Environment={systemd_syntax.environment_word(*pair)}\n" for pair in environment]
    return UNIT.format(
        name=values.get("unit_name") or DEFAULT_NAME,
        version=__version__,
        description=systemd_syntax.plain_text(about),
        exec_start=systemd_syntax.exec_line([*launcher_command(), *command, "--", *arguments])
        + tail,
        identity="\n".join(identity),
        environment="".join(lines),
        stop_timeout=stop_timeout(arguments),
        private_tmp="PrivateTmp=yes" if private_tmp else NO_PRIVATE_TMP,
    )


def check_plan(
    values: dict[str, object], given: set[str], command: VllmCommand, program: str | None
) -> tuple[Target | None, list[str]]:
    """Plan now, to warn early about what the service will meet (`given`: the --env names):
    the target (None without one) and the files it will need (programs, environment, libraries)."""
    try:
        settings, target, plan = launch.prepare_launch(values, command, program)
    except LaunchError as error:
        if error.code not in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE):
            raise
        emit("warning", f"{error.message}; the service will fail to start until this is fixed")
        return None, []
    for warning in plan.warnings:
        emit("warning", warning)
    for refused in plan.refused:  # the caller's LD_PRELOAD: never advised into the unit
        emit("warning", f"{refused}; the unit does not pass it on")
    for name, value in plan.relies_on:
        if name not in given and not (plan.refused and name == LD_PRELOAD):
            emit(
                "warning",
                f"the plan relies on your {name}={value}, which the service will not see; "
                f"pass --env {name}={value}",
            )
    for path in settings.config_files:
        if path not in (SYSTEM_CONFIG, values.get("config")):
            emit(
                "warning",
                f"settings from {path} apply here but not to the service (it has its own "
                f"HOME); pass --launcher-config {path} or use {SYSTEM_CONFIG}",
            )
    programs = (target.executable, target.interpreter, target.prefix)
    return target, [p for p in programs if p] + [p.path for p in plan.preload]


def tmp_ok(needed: Sequence[str], values: dict[str, object]) -> bool:
    """Whether the unit may have a private /tmp; warns about what it would hide. Without
    --user, DynamicUser=yes implies PrivateTmp=yes whatever the unit says (systemd.exec(5)),
    and running as root instead is no default to fall back to: an error naming the fix."""
    hidden = ", ".join(
        path
        for path in dict.fromkeys([*launcher_command()[:1], *needed])
        if any(
            f"{form}/".startswith(PRIVATE_TMP_DIRS)
            for form in (os.path.abspath(path), os.path.realpath(path))
        )
    )
    if hidden and not isinstance(values.get("unit_user"), str):
        raise LaunchError(
            EXIT_USAGE,
            f"{hidden} under /tmp would be hidden from the service: without --user it runs as "
            "a transient user (DynamicUser=yes), which always gets a private /tmp; give --user "
            "USER, or install outside /tmp",
        )
    if hidden:
        emit(
            "warning",
            f"{hidden} under /tmp would be hidden from the service by PrivateTmp=yes: left out "
            "of the unit; install outside /tmp to keep it",
        )
    return not hidden


def check_names(values: dict[str, object]) -> None:
    """The unit name, user and group systemd would refuse, refused now with the rule."""
    name = values.get("unit_name")
    if name is not None and not UNIT_NAME.match(str(name)):
        raise LaunchError(
            EXIT_USAGE, f"--name {name!r}: use letters, digits and : _ . - (a unit name)"
        )
    if name is not None and len(f"{name}.service") > UNIT_FILE_NAME_MAX:  # ASCII: chars are bytes
        raise LaunchError(
            EXIT_USAGE,
            f"--name {name!r}: {name}.service is over {UNIT_FILE_NAME_MAX} bytes, the longest "
            "file name; give a shorter name",
        )
    for option in ("--user", "--group"):
        value = values.get(f"unit_{option[2:]}")
        problem = systemd_syntax.user_group_problem(str(value)) if value is not None else None
        if problem:
            raise LaunchError(
                EXIT_USAGE,
                f"{option} {value!r}: systemd refuses it in {option[2:].title()}= ({problem}); "
                "give a user or group name without ':' or '/', or a numeric id",
            )


def main(values: dict[str, object], args: list[str]) -> int:
    valued = {**launch.VALUED_OPTIONS, **UNIT_OPTIONS, "--env": "unit_env"}
    more, rest = launch.parse_options(args, valued, repeatable=("unit_env",), verb="systemd-unit")
    merged = {**values, **more}
    if merged.get("help"):
        launch.write_stdout(USAGE.rstrip())
        return 0
    for key, option in (("dry_run", "--dry-run"), ("json", "--json"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"systemd-unit prints a unit; {option} does not apply")
    check_names(merged)
    if not rest:
        raise LaunchError(
            EXIT_USAGE, "systemd-unit needs the vLLM command: systemd-unit -- serve MODEL [ARGS...]"
        )
    launch.write_stdout(unit_text(merged, rest))
    return 0


def unit_text(merged: dict[str, object], rest: list[str], tail: str = "") -> str:
    """The unit for the launcher's options `merged` and the command `rest` (render_unit's
    `tail` ends ExecStart), with a warning for what the service will not see."""
    environment = user_environment(merged)  # every --env checked before anything else
    given = {name for name, _ in environment}
    # The caller's settings do not reach the service (the system root is a test host's).
    for variable in sorted(os.environ):
        ours = variable.startswith((VARIABLE_PREFIX, DEPRECATED_PREFIX))
        unseen = not variable.endswith("LAUNCH_VLLM") and variable != SYSTEM_ROOT_VARIABLE
        if ours and os.environ[variable] and unseen:
            emit(
                "warning",
                f"{variable} is set here but the service will not see it; pass the option "
                "to systemd-unit or put it in /etc/vllm-cpu-launch/config.yaml",
            )
    if rest[0] == "exec":
        exec_options, program_argv = launch.parse_options(rest[1:], verb="systemd-unit")
        if not program_argv:
            raise LaunchError(EXIT_USAGE, "systemd-unit ... exec needs a program: exec -- PROGRAM")
        merged.update(exec_options)
        exec_command = read_command(program_argv[1:], vllm=False)
        target, needed = check_plan(merged, given, exec_command, program_argv[0])
        program = target.executable if target is not None else program_argv[0]
        description = f"{os.path.basename(program)} with Intel OpenMP (vllm-cpu-launch exec)"
        # `exec` takes the launcher's options after it, and then the program.
        command, arguments = ["exec", *baked_options(merged, None)], [program, *program_argv[1:]]
    else:
        vllm_command = read_command(rest)
        target, needed = check_plan(merged, given, vllm_command, None)
        model = vllm_command.model
        if model is not None and not os.path.isabs(model) and os.path.exists(model):
            emit(
                "warning",
                f"model {model!r} is a relative path; the service runs in its state "
                "directory: give an absolute path",
            )
        description = f"vLLM on CPU: {model or rest[0]} (vllm-cpu-launch)"
        needed += [model] if model and os.path.isabs(model) else []
        command, arguments = baked_options(merged, target), rest
    return render_unit(merged, environment, command, arguments, description, needed, tail)

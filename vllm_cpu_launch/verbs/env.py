"""`vllm-cpu-launch env`: the plan's environment, for those who cannot exec through us.

Each format but json carries the final value of every variable the plan sets or relies on
(a unit or an image inherits no shell) and the mark VLLMCPULAUNCH_PLANNED, without which
vLLM's plugin would undo the plan (preload Intel OpenMP where it kept libgomp on purpose).
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from vllm_cpu_launch import launch
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.plan import plan_as_json
from vllm_cpu_launch.systemd_syntax import check_utf8, environment_file_line, printable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm_cpu_launch.plan import Plan

FORMATS = ("shell", "systemd", "docker", "kubernetes", "json")

USAGE = """\
usage: vllm-cpu-launch env [--format shell|systemd|docker|kubernetes|json]
                           [OPTIONS] [--] VLLM_SUBCOMMAND ...

Print the environment the launcher would give vLLM, for starting it another way:
  shell    export lines:  eval "$(vllm-cpu-launch env serve MODEL ...)"
  systemd  an EnvironmentFile= body (systemd.exec(5) quoting)
  docker   ENV lines for a Dockerfile
  kubernetes  a container's env: list (YAML, every value a quoted string)
  json     the plan, as --dry-run --json prints it
Every format carries the plan's mark VLLMCPULAUNCH_PLANNED, which tells vLLM's plugin
the program was started with this plan. Warnings go to standard error; the launcher
OPTIONS are those of a normal start.
"""


def docker_value(name: str, value: str) -> str:
    """A double-quoted Dockerfile word: JSON-style `\\"` and `\\\\`, and `\\$` (no expansion);
    Docker's lexer reads no other escapes, so a control character cannot be written."""
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise LaunchError(
            EXIT_USAGE, f"{name}'s value holds a control character, which a Dockerfile cannot hold"
        )
    check_utf8(name, value)
    return json.dumps(value, ensure_ascii=False).replace("$", "\\$")


def docker_lines(environment: Mapping[str, str]) -> list[str]:
    return [f"ENV {name}={docker_value(name, value)}" for name, value in environment.items()]


class _Quoted(str):
    """A YAML scalar written double-quoted: Kubernetes wants strings, and `5` or `yes`
    unquoted would be read as a number or a boolean."""


def kubernetes_lines(environment: Mapping[str, str]) -> list[str]:
    """`env:` and its list, `- name: N` / `value: "V"`, for a container spec: `$` doubled,
    as Kubernetes expands `$(NAME)` in a value and reads `$$` as `$` (EnvVar.value)."""
    import yaml  # lazy: the exec path never imports yaml

    class Dumper(yaml.SafeDumper):
        """SafeDumper that writes _Quoted values double-quoted."""

    def quoted(dumper: yaml.SafeDumper, value: _Quoted) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style='"')

    Dumper.add_representer(_Quoted, quoted)
    entries = []
    for name, value in environment.items():
        check_utf8(name, value)
        entries.append({"name": name, "value": _Quoted(value.replace("$", "$$"))})
    text = yaml.dump(
        {"env": entries}, Dumper=Dumper, allow_unicode=True, sort_keys=False, width=2**31
    )
    return text.splitlines()


def render(plan: Plan, output_format: str) -> str:
    """The plan's environment in one of FORMATS."""
    if output_format == "json":
        return json.dumps(plan_as_json(plan), indent=2)
    environment = {**dict(plan.relies_on), **dict(plan.env)}
    if not environment:
        # One comment line in every format (a line break would end it; YAML refuses a
        # control character even in a comment), whatever the reason holds.
        return f"# vllm-cpu-launch: nothing to set ({printable(plan.reason)})"
    if output_format == "shell":
        lines = [f"export {name}={shlex.quote(value)}" for name, value in environment.items()]
    elif output_format == "systemd":
        lines = [environment_file_line(name, value) for name, value in environment.items()]
    else:
        lines = (docker_lines if output_format == "docker" else kubernetes_lines)(environment)
    return "\n".join(lines)


def main(values: dict[str, object], args: list[str]) -> int:
    more, command = launch.parse_options(
        args, {**launch.VALUED_OPTIONS, "--format": "format"}, launch.FLAG_OPTIONS, verb="env"
    )
    merged = {**values, **more}
    if merged.get("help"):
        launch.write_stdout(USAGE.rstrip())
        return 0
    output_format = str(merged.get("format", "json" if merged.get("json") else "shell"))
    if output_format not in FORMATS:
        raise LaunchError(
            EXIT_USAGE, f"--format {output_format!r}: use one of {', '.join(FORMATS)}"
        )
    if merged.get("json") and output_format != "json":
        raise LaunchError(EXIT_USAGE, f"--json contradicts --format {output_format}")
    for key, option in (("dry_run", "--dry-run"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"env never starts anything; {option} does not apply")
    if not command:
        raise LaunchError(
            EXIT_USAGE, "env needs the vLLM command line: vllm-cpu-launch env serve MODEL ..."
        )
    plan = launch.plan_from_options(merged, read_command(command))
    text = render(plan, output_format)
    launch.report(plan, merged, unchanged="nothing to set")  # env starts nothing
    launch.provide_metadata(plan)  # the PYTHONPATH printed names it: it must exist
    launch.write_stdout(text)
    return 0

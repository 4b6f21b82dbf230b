"""`vllm-cpu-launch env`: the plan's environment, for those who cannot exec through us.

The four environment formats carry the final value of every variable the plan sets or
relies on (`relies_on`), since a unit or an image does not inherit the caller's shell, and
the plan's mark VLLMCPULAUNCH_PLANNED: an `eval`ed shell's `vllm serve` is started with the
plan as a unit's is, and without the mark vLLM's plugin would undo it (preload Intel OpenMP
where the plan kept libgomp on purpose).
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from vllm_cpu_launch.cli import (
    FLAG_OPTIONS,
    VALUED_OPTIONS,
    parse_options,
    plan_from_options,
    provide_metadata,
    report,
    write_stdout,
)
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.plan import plan_as_json
from vllm_cpu_launch.systemd_syntax import environment_file_line, printable

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


def shell_lines(environment: Mapping[str, str]) -> list[str]:
    return [f"export {name}={shlex.quote(value)}" for name, value in environment.items()]


def systemd_lines(environment: Mapping[str, str]) -> list[str]:
    return [environment_file_line(name, value) for name, value in environment.items()]


def docker_value(name: str, value: str) -> str:
    """A double-quoted Dockerfile word: JSON-style `\\"` and `\\\\`, and `\\$` (no expansion);
    Docker's lexer reads no other escapes, so a control character cannot be written."""
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise LaunchError(
            EXIT_USAGE, f"{name}'s value holds a control character, which a Dockerfile cannot hold"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LaunchError(EXIT_USAGE, f"{name}'s value is not UTF-8 text") from None
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
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise LaunchError(EXIT_USAGE, f"{name}'s value is not UTF-8 text") from None
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
        # One comment line in every format, whatever the reason holds (a config file's
        # words): a line break would end the comment, and YAML refuses a control
        # character even in a comment.
        return f"# vllm-cpu-launch: nothing to set ({printable(plan.reason)})"
    renderers = {
        "shell": shell_lines,
        "systemd": systemd_lines,
        "docker": docker_lines,
        "kubernetes": kubernetes_lines,
    }
    return "\n".join(renderers[output_format](environment))


def main(values: dict[str, object], args: list[str]) -> int:
    valued = {**VALUED_OPTIONS, "--format": "format"}
    more, command = parse_options(args, valued, FLAG_OPTIONS, verb="env")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    output_format = merged.get("format", "json" if merged.get("json") else "shell")
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
    plan = plan_from_options(merged, command)
    text = render(plan, str(output_format))
    report(plan, merged, unchanged="nothing to set")  # env starts nothing
    provide_metadata(plan)  # the PYTHONPATH printed names it: it must exist
    write_stdout(text)
    return 0

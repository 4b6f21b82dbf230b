"""What a text output must show of its JSON form: the facts of doctor's report, the
plan (`--dry-run`) and verify's report, and the env formats read back.

The facts are read from the JSON by walking every value, not by listing keys, so a key
added to a report is a fact its text must show from the start. The exceptions are
named in one place per report (a value the text gives in other words, or one that is
for programs), each with its reason. Shared by tests/test_render_states.py (real
processes) and tests/test_render_records.py (generated records).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import yaml

from vllm_cpu_launch.elf import kind_of
from vllm_cpu_launch.verbs.doctor import size
from vllm_cpu_launch.verbs.verify import shortened

from .test_containers import kubernetes_reads
from .test_env import docker_word, parse_environment_file

Path = tuple[str | int, ...]  # a place in a JSON document: keys and list indexes
ANY = "*"  # in a pattern: any key or index
Render = Callable[[Any], str]
NOTHING: Mapping[Path, Any] = MappingProxyType({})


def leaves(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every scalar of a JSON document with its place."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path, value


def matches(path: Path, pattern: Path) -> bool:
    """Whether `path` starts with `pattern` (ANY matching one key or index)."""
    return len(path) >= len(pattern) and all(
        want in (ANY, have) for have, want in zip(path, pattern, strict=False)
    )


def facts(
    document: Any, exempt: Mapping[Path, str] = NOTHING, shown: Mapping[Path, Render] = NOTHING
) -> list[str]:
    """The text each value of `document` must appear as: `shown[pattern](value)` where a
    pattern matches (the renderer's own form, such as a size in GiB), else the value
    itself. Booleans and None are said in words; `exempt` patterns are left out."""
    found = []
    for path, value in leaves(document):
        if value is None or isinstance(value, bool) or any(matches(path, p) for p in exempt):
            continue
        render = next((how for pattern, how in shown.items() if matches(path, pattern)), str)
        found.append(render(value))
    return found


# ---------------------------------------------------------------- doctor

# The shape's readings, which doctor and --dry-run say in its one line (shape.shape_line).
SHAPE_KEYS = ("cpus", "quota", "quota_unknown", "nodes", "memory_nodes", "nodes_unknown")

DOCTOR_EXEMPT: dict[Path, str] = {
    ("schema",): "the JSON form's own version, for programs",
    ("recommendations", ANY, "id"): "a stable name for programs; the text gives the sentence",
    **{("shape", key): "said in the shape's line" for key in SHAPE_KEYS},
}
# Values the text gives in its own form: sizes in GiB, a library's kind by its title.
SHOWN: dict[Path, Render] = {
    ("memory", ANY): size,
    ("numa", ANY, "memory_total"): size,
    ("preload", ANY, "kind"): lambda kind: kind_of(kind).title,
}


def doctor_facts(report: dict[str, Any], volatile: tuple[Path, ...] = ()) -> list[str]:
    """`volatile`: host readings that change between two runs (available memory)."""
    exempt = {**DOCTOR_EXEMPT, **dict.fromkeys(volatile, "changes between runs")}
    return facts(report, exempt, SHOWN)


# ---------------------------------------------------------------- the plan


def plan_facts(plan: dict[str, Any]) -> list[str]:
    """The command as one shell line, each variable as NAME=VALUE quoted for a shell."""
    quoted = ("env", "relies_on")  # as NAME=VALUE, the value quoted for a shell
    exempt = ("command", "schema", "inputs", "shape")  # schema: for programs; inputs, shape: below
    rest = {key: value for key, value in plan.items() if key not in exempt + quoted}
    found = [shlex.join(plan["command"]), *facts(rest)]
    found += [plan["shape"]["line"]] if plan["shape"] else []
    pairs = [pair for key in quoted for pair in plan[key].items()]
    found += [f"{name}={shlex.quote(value)}" for name, value in pairs]
    # The caller's variables read: set ones as NAME=VALUE, unset ones by name.
    inputs = plan["inputs"].items()
    return found + [name if v is None else f"{name}={shlex.quote(v)}" for name, v in inputs]


# ---------------------------------------------------------------- verify


def verify_facts(report: dict[str, Any]) -> list[str]:
    """Each process's command as one shell line (cut where long: --json has it whole),
    its runtimes by name, its variables as NAME=VALUE quoted for a shell."""
    processes = report["processes"]
    exempt = ("processes", "schema")  # schema: the JSON form's own version, for programs
    found = facts({key: value for key, value in report.items() if key not in exempt})
    for process in processes:
        found.append(shortened(shlex.join(process["cmdline"])))
        found += [kind_of(r["kind"]).title for r in process["runtimes"]]
        inherited = (process["environment"].get("inherited") or {}).get("env", {})
        for environment in (process["env"], inherited):
            found += [f"{name}={shlex.quote(value)}" for name, value in environment.items()]
        rest = {k: v for k, v in process.items() if k not in ("cmdline", "env")}
        by_name = "by its name, above"
        shown_elsewhere: dict[Path, str] = {
            ("runtimes", ANY, "kind"): by_name,
            ("load_order", ANY, "kind"): by_name,
            ("serves", "kind"): by_name,
            ("environment", "inherited", "env", ANY): "as NAME=VALUE, above",
        }
        found += facts(rest, shown_elsewhere)
        found += [kind_of(r["kind"]).title for r in process["load_order"]]
    return found


def missing_facts(expected: list[str], text: str) -> list[str]:
    return [fact for fact in expected if fact not in text]


# ---------------------------------------------------------------- env formats read back


def shell_reads(text: str) -> dict[str, str]:
    """`export NAME=VALUE` lines as a POSIX shell reads them (shlex's rules: `#` starts
    a comment; a newline between commands is white space to it)."""
    words = shlex.split(text, comments=True)
    assert words[::2] == ["export"] * (len(words) // 2), text
    pairs = (assignment.partition("=") for assignment in words[1::2])
    return {name: value for name, _, value in pairs}


def docker_reads(text: str) -> dict[str, str]:
    """`ENV NAME="VALUE"` lines and `#` comments; an instruction ends at a newline only."""
    result = {}
    for line in text.removesuffix("\n").split("\n"):
        if line.startswith("#"):
            continue
        assert line.startswith("ENV "), line
        name, _, word = line.removeprefix("ENV ").partition("=")
        result[name] = docker_word(word)
    return result


def kubernetes_env_reads(text: str) -> dict[str, str]:
    """A container's `env:` list; comments only are no document at all."""
    document = yaml.safe_load(text)
    if document is None:
        return {}
    return {entry["name"]: kubernetes_reads(entry["value"]) for entry in document["env"]}


# What reads each format's output: a POSIX shell, systemd's EnvironmentFile= rules,
# Docker's, YAML with Kubernetes' `$$` rule; json: the plan's own `env`.
READERS: dict[str, Callable[[str], dict[str, str]]] = {
    "shell": shell_reads,
    "systemd": parse_environment_file,
    "docker": docker_reads,
    "kubernetes": kubernetes_env_reads,
    "json": lambda text: json.loads(text)["env"],
}


def says_why(text: str, reason: str) -> bool:
    """Whether an env format with nothing to set gives the plan's reason: each printable
    run of it (a line break or control character cannot be in its one comment line)."""
    runs = "".join(char if char.isprintable() else "\0" for char in reason).split("\0")
    return all(run in text for run in runs)

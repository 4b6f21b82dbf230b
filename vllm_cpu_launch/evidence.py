"""What the benchmark map says the launcher should do on this host (docs/benchmarks.md).

scripts/bench_vllm.py measured the real vLLM CPU build serving with ngram speculative
decoding on one kind of host (MAP_CPUS usable CPUs, vLLM MAP_VLLM), over model size,
reservation, binding, concurrency and the runtime settings a launcher can choose
(docs/bench_vllm_map.json), then draft-model and EAGLE SD on the same host at vLLM's
default reservation (the SD methods map, docs/bench_vllm_methods.json). Both keep every
run, and tests/test_evidence.py recomputes every figure quoted here from them. A rule
applies only where it was measured: that SD method (and, but for ngram, token count), that
vLLM release (releases.vllm_release: its dist-info in the target's environment) on that
many CPUs, one worker on one node.
Elsewhere the launcher does what vLLM advises: Intel OpenMP for SD, KMP_BLOCKTIME as vLLM
tunes its workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Mapping

MAP_CPUS = 2
MAP_VLLM = "0.32"
MAP = "docs/benchmarks.md, the map"
METHODS_MAP = "docs/benchmarks.md, the SD methods map"
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_VARIABLE = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# The figures the rules rest on: the lowest and highest median TPOT ratio (> 1 = faster)
# over both models and every concurrency level measured; test_evidence.py recomputes them.
NOBIND_BLOCKTIME = "200"
NOBIND_VS_INSTALLED = (0.92, 1.42)  # libiomp5 nobind KMP_BLOCKTIME=200 vs libgomp as installed
NOBIND_VS_NOBIND = (1.26, 1.55)  # the same vs libgomp under nobind
BOUND_IOMP = (0.87, 1.22)  # libiomp5 (+tcmalloc) bound by vLLM vs libgomp, same reservation
NOBIND_BT0_VS_INSTALLED = (0.63, 0.98)  # libiomp5 nobind KMP_BLOCKTIME=0 vs libgomp as installed
BLOCKTIME_VARIABLE = "KMP_BLOCKTIME"
THREADS_VARIABLE = "OMP_NUM_THREADS"


@record
class MethodRows:
    """The SD methods map's figures for a method that runs a drafter, at one token count:
    TPOT ratios (lowest and highest median, > 1 = faster) against libgomp as installed, on
    the 105M-parameter model at vLLM's default reservation, 1 and 4 concurrent requests."""

    unbound: tuple[float, float]  # libiomp5 + tcmalloc, nobind, KMP_BLOCKTIME=200
    bound: tuple[float, float]  # libiomp5, with or without tcmalloc, as vLLM binds it


# (vLLM's method, num_speculative_tokens) -> its rows. Unbound with tcmalloc was a gain in
# every round at 4 concurrent requests for each; bound libiomp5 never a loss.
METHOD_ROWS = {
    ("draft_model", 3): MethodRows(unbound=(1.26, 1.45), bound=(1.02, 1.14)),
    ("draft_model", 7): MethodRows(unbound=(1.22, 1.41), bound=(1.00, 1.04)),
    ("eagle", 3): MethodRows(unbound=(1.31, 1.51), bound=(0.98, 1.08)),
}
DRAFTER_METHODS = tuple(dict.fromkeys(method for method, _ in METHOD_ROWS))
MAP_METHODS = ("ngram", *DRAFTER_METHODS)  # the SD methods mapped: the rules apply to them alone


@record
class MapHost:
    """A host, vLLM and command the map measured, and the OpenMP settings the user chose."""

    cpus: int
    vllm: str  # the release found in the target's environment
    method: str  # the SD method
    binding: str  # VLLM_CPU_OMP_THREADS_BIND as set: "" (unset), "auto" or "nobind"
    reserved: bool  # VLLM_CPU_NUM_OF_RESERVED_CPU set
    blocktime: str | None = None  # the caller's KMP_BLOCKTIME (their environment)
    chosen_blocktime: str | None = None  # --kmp-blocktime (option, variable, config)
    threads: str | None = None  # the caller's OMP_NUM_THREADS
    tokens: int | None = None  # num_speculative_tokens
    tcmalloc: bool = False  # a tcmalloc the settings let the launcher preload was found


@record
class MapChoice:
    """What the map says to do for SD on such a host, and why (for the INFO line)."""

    iomp: bool  # what --iomp auto does: preload Intel OpenMP or keep libgomp
    nobind: bool  # also set VLLM_CPU_OMP_THREADS_BIND=nobind (with Intel OpenMP)
    blocktime: str | None  # KMP_BLOCKTIME by default (with Intel OpenMP), None: vLLM's own
    reason: str
    # Set where the caller's KMP_BLOCKTIME leaves the measured configuration: `blocktime`
    # replaces it, and this warning says so.
    replaces_callers: str | None = None
    tcmalloc: bool = False  # measured with tcmalloc preloaded: the launcher preloads it too


def map_host(
    environ: Mapping[str, str],
    cpus: int,
    release: str | None,
    one_worker: bool,
    method: str | None,
    tokens: int | None,
    chosen_blocktime: str | None = None,
    tcmalloc: bool = False,
) -> MapHost | None:
    """This host, vLLM release and command, where the map measured them; None elsewhere.

    `release`: the target's vLLM (releases.vllm_release). `one_worker`: the command runs
    one worker on one node, as the launcher reads it from the command line
    (single_worker) and the plugin from vLLM's parallel config. `method` and `tokens`: the
    SD method and num_speculative_tokens (None: the command does not say).
    `chosen_blocktime`: the launcher's --kmp-blocktime setting, if any. `tcmalloc`: a
    tcmalloc was found that the settings let the launcher preload.
    """
    if cpus != MAP_CPUS or not one_worker or method not in MAP_METHODS:
        return None
    if release is None or release.split(".")[:2] != MAP_VLLM.split("."):
        return None
    binding = environ.get(BIND_VARIABLE, "")
    if binding not in ("", "auto", "nobind"):
        return None  # a CPU list of the user's: not measured
    reserved = bool(environ.get(RESERVED_VARIABLE))
    # The methods map measured vLLM's default reservation and binding, those tokens only.
    if method in DRAFTER_METHODS and (
        (method, tokens) not in METHOD_ROWS or binding == "nobind" or reserved
    ):
        return None
    return MapHost(
        cpus,
        release,
        method,
        binding,
        reserved,
        environ.get(BLOCKTIME_VARIABLE),
        chosen_blocktime,
        environ.get(THREADS_VARIABLE),
        tokens,
        tcmalloc,
    )


def figures(low_high: tuple[float, float]) -> str:
    low, high = low_high
    return f"{low:.2f}-{high:.2f}x"


def map_choice(host: MapHost) -> MapChoice:
    """The measured best for SD on this host. The launcher chooses vLLM's binding only
    where the user set neither the binding nor the reservation (vLLM's defaults).

    Where the worker would run unbound (rules 1 and 2), the user's own OpenMP settings
    count: under nobind vLLM sets no KMP_* or OMP_NUM_THREADS for its worker. A caller's
    OMP_NUM_THREADS was never measured there: libgomp is kept, as plain vLLM (the map has
    no row for a thread count, and keeping libgomp is never slower than plain vLLM). A
    caller's KMP_BLOCKTIME other than the measured one is replaced, with a warning: the
    block time decides the gain (0 measured 0.63-0.98x of plain vLLM, 200 0.92-1.42x). A
    block time chosen with --kmp-blocktime is kept, and no figure is claimed for it.

    A method with a drafter (METHOD_ROWS) was measured unbound only with tcmalloc and
    without a thread count: without one to preload, with a caller's OMP_NUM_THREADS, or
    with vLLM's binding set, it gets libiomp5 as vLLM binds it (also measured)."""
    rows = METHOD_ROWS.get((host.method, host.tokens or 0))
    if rows is None:
        where, source = f"{host.method} SD on {host.cpus} CPUs with vLLM {host.vllm}", MAP
        unbound = host.binding == "nobind" or (not host.binding and not host.reserved)
    else:
        where = (
            f"{host.method} SD with {host.tokens} tokens on {host.cpus} CPUs with vLLM {host.vllm}"
        )
        source = METHODS_MAP
        unbound = not host.binding and host.tcmalloc and host.threads is None
    if unbound and host.threads is not None:
        why = (
            f"not preloading Intel OpenMP: {where}, under {BIND_VARIABLE}=nobind the worker "
            f"would run {THREADS_VARIABLE}={host.threads} threads, which the map never "
            f"measured ({source}); keeping libgomp as plain vLLM; --iomp always keeps "
            "libiomp5"
        )
        return MapChoice(False, False, None, why)
    if not unbound and rows is not None:
        if host.binding:
            because = f"with your {BIND_VARIABLE}={host.binding}"
        elif not host.tcmalloc:
            because = "with no tcmalloc to preload"
        else:  # unbound, vLLM would leave the worker's team to it
            because = f"with your {THREADS_VARIABLE}={host.threads}, never measured unbound"
        why = (
            f"{where}, {because}: libiomp5 as vLLM binds it measured {figures(rows.bound)} of "
            f"libgomp's speed; unbound ({BIND_VARIABLE}=nobind) with tcmalloc "
            f"{figures(rows.unbound)} ({source})"
        )
        return MapChoice(True, False, None, why, tcmalloc=True)
    if not unbound:
        chosen = f"{RESERVED_VARIABLE} set" if host.reserved else f"{BIND_VARIABLE}=auto"
        why = (
            f"not preloading Intel OpenMP: {where} and {chosen}, vLLM binds the worker, and "
            f"libiomp5 as it binds and tunes it measured {figures(BOUND_IOMP)} of libgomp's "
            f"speed, slower on the 105M-parameter model ({MAP}); --iomp always keeps it"
        )
        return MapChoice(False, False, None, why)
    nobind = host.binding != "nobind"  # the launcher sets it only where the user did not
    blocktime = NOBIND_BLOCKTIME
    runtime = "libiomp5 and tcmalloc" if rows else "libiomp5"
    best = figures(rows.unbound if rows else NOBIND_VS_INSTALLED)
    if host.binding == "nobind":
        why = (
            f"{where}, with your {BIND_VARIABLE}=nobind: libiomp5 with KMP_BLOCKTIME={blocktime} "
            f"measured {figures(NOBIND_VS_NOBIND)} of libgomp's speed ({MAP})"
        )
    else:
        bound = figures(rows.bound if rows else BOUND_IOMP)
        why = (
            f"{where}, {runtime} unbound ({BIND_VARIABLE}=nobind) with KMP_BLOCKTIME="
            f"{blocktime} measured {best} of plain vLLM's speed, libiomp5 as vLLM binds it "
            f"{bound} ({source})"
        )
    # What the block time is measured to do under nobind: 0 and 200 for ngram (the map),
    # 200 alone for a method with a drafter.
    blocktimes = f"0 measured {figures(NOBIND_BT0_VS_INSTALLED)}, {blocktime} " + (
        f"{figures(NOBIND_VS_INSTALLED)} of plain vLLM's speed; {MAP}"
        if rows is None
        else f"{figures(NOBIND_VS_INSTALLED)} for ngram SD ({MAP}); {blocktime} {best} "
        f"here ({source})"
    )
    if host.chosen_blocktime not in (None, blocktime):
        why = (
            f"{where}, {runtime} unbound ({BIND_VARIABLE}=nobind) with your KMP_BLOCKTIME="
            f"{host.chosen_blocktime}, which the map did not measure (KMP_BLOCKTIME={blocktimes})"
        )
        return MapChoice(True, nobind, None, why, tcmalloc=rows is not None)
    replaced = None
    if host.blocktime not in (None, blocktime):
        replaced = (
            f"your {BLOCKTIME_VARIABLE}={host.blocktime} is replaced by {blocktime} for this "
            f"start: under nobind the block time decides the gain ({blocktimes}); "
            f"--kmp-blocktime {host.blocktime} keeps yours"
        )
    return MapChoice(True, nobind, blocktime, why, replaced, tcmalloc=rows is not None)

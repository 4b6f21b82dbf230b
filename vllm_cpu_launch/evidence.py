"""What the benchmark map says the launcher should do on this host (docs/benchmarks.md).

scripts/bench_vllm.py measured the real vLLM CPU build serving with ngram speculative
decoding on one kind of host (MAP_CPUS usable CPUs, vLLM MAP_VLLM), over model size,
reservation, binding, concurrency and the runtime settings a launcher can choose;
docs/bench_vllm_map.json keeps every run, and tests/test_evidence.py recomputes every
figure quoted here from it. A rule applies only where it was measured: that vLLM release
(releases.vllm_release: its dist-info in the target's environment) on that many CPUs, one
worker on one node.
Elsewhere the launcher does what vLLM advises: Intel OpenMP for SD, KMP_BLOCKTIME as vLLM
tunes its workers.
"""

from __future__ import annotations

from vllm_cpu_launch.records import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

MAP_CPUS = 2
MAP_VLLM = "0.32"
MAP_METHODS = ("ngram",)  # the SD methods the map measured: its rules apply to them alone
MAP = "docs/benchmarks.md, the map"
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


def map_host(
    environ: Mapping[str, str],
    cpus: int,
    release: str | None,
    one_worker: bool,
    method: str | None,
    chosen_blocktime: str | None = None,
) -> MapHost | None:
    """This host, vLLM release and command, where the map measured them; None elsewhere.

    `release`: the target's vLLM (releases.vllm_release). `one_worker`: the command runs
    one worker on one node, as the launcher reads it from the command line
    (single_worker) and the plugin from vLLM's parallel config. `method`: the SD method
    (None: the command does not say). `chosen_blocktime`: the launcher's --kmp-blocktime
    setting, if any.
    """
    if cpus != MAP_CPUS or not one_worker or method not in MAP_METHODS:
        return None
    if release is None or release.split(".")[:2] != MAP_VLLM.split("."):
        return None
    binding = environ.get(BIND_VARIABLE, "")
    if binding not in ("", "auto", "nobind"):
        return None  # a CPU list of the user's: not measured
    return MapHost(
        cpus,
        release,
        method,
        binding,
        bool(environ.get(RESERVED_VARIABLE)),
        environ.get(BLOCKTIME_VARIABLE),
        chosen_blocktime,
        environ.get(THREADS_VARIABLE),
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
    block time chosen with --kmp-blocktime is kept, and no figure is claimed for it."""
    where = f"{host.method} SD on {host.cpus} CPUs with vLLM {host.vllm}"
    unbound = host.binding == "nobind" or (not host.binding and not host.reserved)
    if unbound and host.threads is not None:
        why = (
            f"not preloading Intel OpenMP: {where}, under {BIND_VARIABLE}=nobind the worker "
            f"would run {THREADS_VARIABLE}={host.threads} threads, which the map never "
            f"measured ({MAP}); keeping libgomp as plain vLLM; --iomp always keeps "
            "libiomp5"
        )
        return MapChoice(False, False, None, why)
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
    if host.binding == "nobind":
        why = (
            f"{where}, with your {BIND_VARIABLE}=nobind: libiomp5 with KMP_BLOCKTIME={blocktime} "
            f"measured {figures(NOBIND_VS_NOBIND)} of libgomp's speed ({MAP})"
        )
    else:
        why = (
            f"{where}, libiomp5 unbound ({BIND_VARIABLE}=nobind) with KMP_BLOCKTIME="
            f"{blocktime} measured {figures(NOBIND_VS_INSTALLED)} of plain vLLM's speed, "
            f"libiomp5 as vLLM binds it {figures(BOUND_IOMP)} ({MAP})"
        )
    if host.chosen_blocktime not in (None, blocktime):
        why = (
            f"{where}, libiomp5 unbound ({BIND_VARIABLE}=nobind) with your KMP_BLOCKTIME="
            f"{host.chosen_blocktime}, which the map did not measure (KMP_BLOCKTIME=0 "
            f"{figures(NOBIND_BT0_VS_INSTALLED)}, {blocktime} {figures(NOBIND_VS_INSTALLED)} of "
            f"plain vLLM's speed; {MAP})"
        )
        return MapChoice(True, nobind, None, why)
    replaced = None
    if host.blocktime not in (None, blocktime):
        replaced = (
            f"your {BLOCKTIME_VARIABLE}={host.blocktime} is replaced by {blocktime} for this "
            f"start: under nobind the block time decides the gain (0 measured "
            f"{figures(NOBIND_BT0_VS_INSTALLED)}, {blocktime} {figures(NOBIND_VS_INSTALLED)} of "
            f"plain vLLM's speed, {MAP}); --kmp-blocktime {host.blocktime} keeps yours"
        )
    return MapChoice(True, nobind, blocktime, why, replaced)

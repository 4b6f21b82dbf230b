"""scripts/bench_omp_regions.py run for real, at its smallest (issue 37).

The host it needs: gcc (skipped without it), the intel-openmp wheel's libiomp5 of the test
extra, and LLVM's libomp.so.5 for that configuration: Debian's libomp5-14 (downloaded
into the tests' .deb cache, as tests/conftest.py does) or the system's; without one, that
part is skipped with the reason. At most 2 threads (1 on a 1-CPU host), so it runs on any
host. Timings depend on the host, so none is asserted: only that every configuration was
measured, in the table and the JSON, each process by the runtime it was configured with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, debian_packages, unpack

SCRIPT = REPO / "scripts" / "bench_omp_regions.py"
THREADS = [1, 2] if len(os.sched_getaffinity(0)) >= 2 else [1]
ROUNDS = 2
IOMP_CONFIGS = ("libiomp5 bt0", "libiomp5 bt5", "libiomp5 bt200")
SYSTEM_LIBOMP = ("/usr/lib/x86_64-linux-gnu/libomp.so.5", "/usr/lib/aarch64-linux-gnu/libomp.so.5")

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build omp_regions.c"),
]


def run_bench(tmp_path: Path, *arguments: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """The script at its smallest size, with these arguments; its result and its JSON."""
    kept = tmp_path / "regions.json"
    smallest = ["--rounds", str(ROUNDS), "--regions", "50", "--reps", "3", "--warmup", "10"]
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *smallest, "--json", str(kept), *arguments],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed, json.loads(kept.read_text()) if kept.exists() else None


@pytest.fixture(scope="module")
def llvm_libomp(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """LLVM's libomp.so.5: Debian's libomp5-14 unpacked, else the system's (None: neither)."""
    try:
        root = unpack(debian_packages(["libomp5-14"]), tmp_path_factory.mktemp("libomp"))
        found = sorted(root.glob("usr/lib/llvm-*/lib/libomp.so.5"))
    except (pytest.fail.Exception, OSError, subprocess.CalledProcessError):
        found = []
    found += [Path(path) for path in SYSTEM_LIBOMP if Path(path).is_file()]
    return found[0] if found else None


@pytest.fixture(scope="module")
def bench_run(
    tmp_path_factory: pytest.TempPathFactory, real_iomp: Path, llvm_libomp: Path | None
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """One run of every configuration: libgomp, the wheel's libiomp5, libomp where found."""
    arguments = ["--threads", ",".join(map(str, THREADS)), "--iomp", str(real_iomp)]
    if llvm_libomp is not None:
        arguments += ["--libomp", str(llvm_libomp)]
    return run_bench(tmp_path_factory.mktemp("bench"), *arguments)


def table_rows(stdout: str, threads: int) -> list[str]:
    """The runtime column of the table for this many threads."""
    heading = f"### {threads} thread{'s' * (threads != 1)} "
    section = stdout.split(heading, 1)[1].split("\n\n", 2)[1]
    return [line.split(" | ")[0].removeprefix("| ") for line in section.splitlines()[2:]]


def test_every_configuration_is_measured_on_the_runtime_it_names(
    bench_run: tuple[subprocess.CompletedProcess[str], Any], real_iomp: Path
) -> None:
    completed, kept = bench_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    names = [config["name"] for config in kept["configs"]]
    assert names[:4] == ["libgomp", *IOMP_CONFIGS]
    labels = [config["label"] for config in kept["configs"]]
    for threads in THREADS:
        assert [row.split(" (")[0] for row in table_rows(completed.stdout, threads)] == [
            label.split(" (")[0] for label in labels
        ]
        assert set(kept["summary"][str(threads)]) == set(names)
    processes = kept["processes"]
    assert len(processes) == len(names) * len(THREADS) * ROUNDS
    for process in processes:
        assert process["problem"] is None and process["team"] == process["threads"]
        for key in ("runtime", "omp_runtime"):
            if process["config"] == "libgomp":
                assert Path(process[key]).name.startswith("libgomp.so"), process
            elif process["config"] in IOMP_CONFIGS:
                assert Path(process[key]).resolve() == real_iomp.resolve(), process
    for process in (p for p in processes if p["config"] in IOMP_CONFIGS):
        assert (
            process["blocktime_seen"].removesuffix("ms") == process["config"][len("libiomp5 bt") :]
        )
    assert kept["problems"] == [] and "problem:" not in completed.stdout
    assert "rerun: cd " in completed.stdout and "machine: " in completed.stdout


def test_llvm_libomp_is_measured_at_its_default_block_time(
    bench_run: tuple[subprocess.CompletedProcess[str], Any], llvm_libomp: Path | None
) -> None:
    if llvm_libomp is None:
        pytest.skip("no LLVM libomp.so.5: apt-get download libomp5-14 failed, none installed")
    _, kept = bench_run
    served = {
        (process["threads"], Path(process["runtime"]).resolve())
        for process in kept["processes"]
        if process["config"] == "libomp"
    }
    assert served == {(threads, llvm_libomp.resolve()) for threads in THREADS}
    for threads in THREADS:
        row = kept["summary"][str(threads)]["libomp"]
        assert row["blocktime"] is None and row["blocktime_seen"]  # as the runtime says


def test_a_process_not_served_by_its_runtime_is_a_problem(tmp_path: Path) -> None:
    """A "libiomp5" that is no OpenMP runtime (the C library): libgomp serves the process."""
    libc = next(
        line.split()[-1]
        for line in os.fsdecode(Path("/proc/self/maps").read_bytes()).splitlines()
        if Path(line.split()[-1]).name.startswith("libc.so")
    )
    # The later --rounds wins over run_bench's.
    arguments = ["--threads", "1", "--rounds", "1", "--iomp", libc, "--blocktimes", "0"]
    completed, kept = run_bench(tmp_path, *arguments)
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "problem: 1 thread, libiomp5 bt0: runtime " in completed.stdout
    assert f", not {libc}" in completed.stdout
    assert "| libiomp5, KMP_BLOCKTIME=0 | not measured: see the problem lines |" in completed.stdout
    assert kept["problems"] and kept["summary"]["1"]["libiomp5 bt0"]["median_us"] is None

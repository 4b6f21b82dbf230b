"""Which OpenMP runtime serves a real process, read from its link map (linkmap.py).

The proof in a real process: a shared library built here with `gcc -shared -fopenmp`
(linked to the system's libgomp, as torch's and triton-cpu's launchers are) is loaded
by Python with ctypes, runs a parallel region, and prints, from inside, the file that
defines the `GOMP_parallel` its reference resolved to (dladdr of the address the library
itself takes). `vllm-cpu-launch verify --json --speculative PID`, run as a fresh process,
must name the same runtime as serving that process. Intel OpenMP is the intel-openmp
wheel's real libiomp5.so, LLVM's the real libomp.so.5 of Debian's libomp5-14.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AS_NOBODY, clean_environ, run_launcher
from vllm_cpu_launch.linkmap import LinkMap, read_link_map

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build")

PARALLEL_C = """\
#include <omp.h>
extern void GOMP_parallel(void (*)(void *), void *, unsigned, unsigned);
/* The address this library's own reference resolved to (its GOT entry). */
void *gomp_parallel_address(void) { return (void *)&GOMP_parallel; }
int run_parallel(void) {
    int threads = 0;
    #pragma omp parallel
    {
        #pragma omp single
        threads = omp_get_num_threads();
    }
    return threads;
}
"""
# Loads the library (then, late, the libraries named after it), runs the region, prints
# the file behind the GOMP_parallel the library calls, and waits to be read.
PROBE = """\
import ctypes, os, sys, time
class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
library = ctypes.CDLL(sys.argv[1])
for late in sys.argv[2:]:
    ctypes.CDLL(late)
assert library.run_parallel() >= 1
library.gomp_parallel_address.restype = ctypes.c_void_p
info = DlInfo()
address = ctypes.c_void_p(library.gomp_parallel_address())
assert ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
print(os.path.realpath(info.fname.decode()), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def parallel_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libparallel.so, built by gcc -fopenmp: it needs the system's libgomp.so.1."""
    directory = tmp_path_factory.mktemp("gcc")
    source = directory / "parallel.c"
    source.write_text(PARALLEL_C)
    library = directory / "libparallel.so"
    build = ["gcc", "-shared", "-fPIC", "-fopenmp", "-o", str(library), str(source)]
    subprocess.run(build, check=True, timeout=120)
    dynamic = subprocess.run(
        ["readelf", "-d", str(library)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "Shared library: [libgomp.so.1]" in dynamic, dynamic
    return library


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[Callable[..., tuple[int, str]]]:
    """Start PROBE as a real process; returns (PID, the file serving GOMP_parallel)."""
    started: list[subprocess.Popen[str]] = []

    def start(library: Path, *late: str, preload: str | None = None) -> tuple[int, str]:
        env = clean_environ(tmp_path, OMP_NUM_THREADS="2")
        if preload is not None:
            env["LD_PRELOAD"] = preload
        process = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(library), *late],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(process)
        assert process.stdout is not None
        serving = process.stdout.readline().strip()
        assert serving, "the probe printed nothing"
        return process.pid, serving

    yield start
    for process in started:
        os.killpg(process.pid, signal.SIGKILL)  # the process this test started, by its id
        process.wait()


def verify_speculative(tmp_path: Path, pid: int) -> tuple[int, dict[str, Any]]:
    """`verify --json --speculative PID` as a fresh process: (exit code, the process)."""
    result = run_launcher(["verify", "--json", "--speculative", str(pid)], clean_environ(tmp_path))
    assert result.returncode in (0, 1), result.stderr
    (process,) = json.loads(result.stdout)["processes"]
    return result.returncode, process


@pytest.fixture
def llvm_libomp(debian_root: Path) -> Path:
    return debian_root / "usr/lib/llvm-14/lib/libomp.so.5"


@pytest.mark.parametrize(("runtime", "kind"), [("real_iomp", "iomp"), ("llvm_libomp", "llvm")])
@pytest.mark.parametrize("renamed", [None, "libfoo.so"])
def test_a_preloaded_runtime_serves_a_libgomp_linked_library_and_verify_says_so(
    tmp_path: Path,
    parallel_library: Path,
    probe: Callable[..., tuple[int, str]],
    request: pytest.FixtureRequest,
    runtime: str,
    kind: str,
    renamed: str | None,
) -> None:
    """LD_PRELOAD puts the runtime right after the program in the link map; the library's
    GOMP_parallel, bound to libgomp.so.1 at link time, resolves to it. A copy of the
    runtime named libfoo.so is that runtime all the same (its ELF file says so)."""
    preloaded = os.path.realpath(request.getfixturevalue(runtime))
    if renamed is not None:
        preloaded = str(shutil.copy2(preloaded, tmp_path / renamed))
    pid, serving = probe(parallel_library, preload=preloaded)
    assert serving == preloaded  # from inside: the preloaded runtime runs the region
    code, process = verify_speculative(tmp_path, pid)
    assert code == 0, process
    assert process["verdict"] == "ok"
    assert process["serves"] == {"kind": kind, "path": serving}
    assert process["order"].startswith("in load order")
    # libgomp is mapped too (the library needs it), after the preloaded runtime.
    kinds = [runtime["kind"] for runtime in process["load_order"]]
    assert kinds == [kind, "gomp"], process["load_order"]


def test_libgomp_loaded_first_serves_though_intel_openmp_comes_later(
    tmp_path: Path, parallel_library: Path, probe: Callable[..., tuple[int, str]], real_iomp: Path
) -> None:
    """The -fopenmp library first, libiomp5 dlopen'd after (not preloaded): both mapped,
    libgomp serves every GOMP_* call, and verify calls that a problem under SD."""
    pid, serving = probe(parallel_library, str(real_iomp))
    assert os.path.basename(serving).startswith("libgomp")  # from inside
    code, process = verify_speculative(tmp_path, pid)
    assert code == 1
    assert process["verdict"] == "problem"
    assert process["serves"] == {"kind": "gomp", "path": serving}
    assert [r["kind"] for r in process["load_order"]] == ["gomp", "iomp"]
    assert process["reason"].startswith(f"GNU libgomp serves ({serving}, first in the link map)")
    assert "Intel OpenMP was loaded after it, not preloaded" in process["reason"]


def test_the_link_map_is_in_load_order_as_pldd_reads_it() -> None:
    """This process's link map: the program first, the same objects as glibc's pldd."""
    objects = read_link_map(os.getpid()).objects
    assert objects is not None and objects[0][1] == ""
    pldd = shutil.which("pldd")
    if pldd is None:
        return
    listed = subprocess.run(
        [pldd, str(os.getpid())], capture_output=True, text=True, timeout=60, check=False
    )
    if listed.returncode != 0:  # pldd attaches with ptrace, which a sandbox may refuse
        return
    named = [name for _, name in objects[1:]]
    assert listed.stdout.splitlines()[1:] == named


def test_an_unreadable_process_says_why_instead_of_an_order(nobody_launcher: list[str]) -> None:
    """PID 1's memory is closed to an unprivileged user: no order is guessed. Run as uid
    65534 from the public copy of the package (the checkout may be closed to it)."""
    python, public = nobody_launcher[0], nobody_launcher[-1]
    code = (
        f"import sys; sys.path.insert(0, {public!r}); "
        "from vllm_cpu_launch.linkmap import read_link_map; "
        "m = read_link_map(1); print(m.objects, m.unreadable)"
    )
    environ = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [*AS_NOBODY, python, "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.startswith(
        "None /proc/1/exe: permission denied (it needs ptrace access"
    ), result.stderr


SLEEPER_C = """\
#include <stdio.h>
#include <unistd.h>
int main(void) { puts("ready"); fflush(stdout); sleep(600); return 0; }
"""


def built_static(tmp_path: Path, how: str) -> Path:
    """SLEEPER_C built with `gcc HOW` (-static, -static-pie); skips where no static libc is."""
    source = tmp_path / "sleeper.c"
    source.write_text(SLEEPER_C)
    program = tmp_path / "sleeper"
    built = subprocess.run(
        ["gcc", how, "-o", str(program), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if built.returncode != 0:
        pytest.skip(f"gcc {how} failed (no static libc here): {built.stderr.strip()}")
    return program


@contextlib.contextmanager
def sleeping(program: Path) -> Iterator[int]:
    """PROGRAM running until the block ends; its PID once it said "ready"."""
    process = subprocess.Popen(
        [str(program)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        yield process.pid
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the process this test started, by its id
        process.wait()


def test_where_no_link_map_exists_verify_says_so_and_names_no_server(tmp_path: Path) -> None:
    """A statically linked program has no dynamic section: verify says the load order is
    unreadable and why, lists the runtimes in map order, and names none as serving."""
    with sleeping(built_static(tmp_path, "-static")) as pid:
        link_map = read_link_map(pid)
        assert link_map == LinkMap(None, "a statically linked program (no PT_DYNAMIC)")
        code, seen = verify_speculative(tmp_path, pid)
        assert seen["serves"] is None and seen["load_order"] == []
        assert seen["order"] == (
            "load order unreadable: a statically linked program (no PT_DYNAMIC); in "
            "/proc/PID/maps (address) order, which does not say which serves"
        )
        assert code == 1  # SD asked, no runtime loaded and none preloaded: as before


def test_a_static_pie_programs_link_map_is_read(tmp_path: Path) -> None:
    """-static-pie: a dynamic section and glibc's own link map, but no PT_PHDR, whose
    absence once left the load bias 0 and the read at EIO ("[Errno 5] Input/output error").
    The bias comes from the entry point: the program is first in the map, no runtime in it."""
    with sleeping(built_static(tmp_path, "-static-pie")) as pid:
        link_map = read_link_map(pid)
        assert link_map.objects is not None, link_map.unreadable
        assert link_map.objects[0][1] == ""
        code, seen = verify_speculative(tmp_path, pid)
        assert seen["order"] == "in load order (the link map, as pldd reads it)"
        assert seen["load_order"] == [] and code == 1


def test_a_fopenmp_library_named_like_a_runtime_serves_nothing(
    tmp_path: Path, parallel_library: Path, probe: Callable[..., tuple[int, str]], real_iomp: Path
) -> None:
    """Issue 45: the -fopenmp library named libompwork.so, libiomp5 dlopen'd after it: the
    name made it LLVM OpenMP serving, exit 0; it defines no GOMP_parallel, libgomp serves."""
    work = shutil.copy2(parallel_library, tmp_path / "libompwork.so")
    pid, serving = probe(work, str(real_iomp))
    assert os.path.basename(serving).startswith("libgomp")  # from inside
    code, process = verify_speculative(tmp_path, pid)
    assert (code, process["verdict"]) == (1, "problem")
    assert process["serves"] == {"kind": "gomp", "path": serving}
    assert [r["kind"] for r in process["load_order"]] == ["gomp", "iomp"]
    assert str(work) not in [r["path"] for r in process["runtimes"]]

"""What a library file says of itself (vllm_cpu_launch/elf.py), read from real ELF files:
the intel-openmp wheel's, Debian's LLVM OpenMP and allocators, this machine's libgomp, and
libraries gcc builds here: its kind by its DT_SONAME, the GOMP_parallel it defines (looked
up through DT_GNU_HASH and DT_HASH) and its banner, never its file's name; and whether its
ELF header fits a host. The library search that rejects what does not fit, with the
reasons elf.py gives: tests/test_libraries.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from vllm_cpu_launch import runtimes
from vllm_cpu_launch.elf import Library, elf_problem, elf_truncation, identify, library_of

from .conftest import debian_packages, place_library, unpack
from .test_libraries import I386_ELF, MULTIARCH_LIB, big_endian

pytestmark = pytest.mark.skipif(
    os.uname().machine != "x86_64", reason="x86-64 ELF fixtures and wheels"
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("libompl.so", (Library.OTHER, False)),
        ("libompd.so", (Library.OTHER, False)),
        ("libompwork.so", (Library.OTHER, False)),  # it calls GOMP_parallel: no definition
        ("libgomp-0123abcd.so.1.0.0", (runtimes.GNU, True)),  # a wheel's renamed libgomp
        ("libgnu-hash.so", (runtimes.GNU, True)),  # no SONAME: it defines GOMP_parallel
        ("libsysv-hash.so", (runtimes.GNU, True)),  # found through DT_HASH alone too
    ],
)
def test_a_library_is_what_its_elf_file_says_not_its_name(
    built: Path, name: str, expected: tuple[Library, bool]
) -> None:
    """Issue 45: a name starting `libomp` made LLVM OpenMP of libompwork.so (gcc -fopenmp,
    needing libgomp), OMPL's libompl.so and LLVM's libompd.so, none a runtime."""
    assert identify(str(built / name)) == expected
    assert library_of(str(built / name)) is expected[0]


@pytest.mark.parametrize(
    ("runtime", "kind"),
    [
        ("real_iomp", runtimes.INTEL),
        ("llvm-14/lib/libomp.so.5", runtimes.LLVM),
        ("llvm-14/lib/libiomp5.so", runtimes.LLVM),  # Debian's alias: SONAME libomp.so.5
        ("llvm-14/lib/libgomp.so", runtimes.LLVM),
        ("/usr/lib/x86_64-linux-gnu/libgomp.so.1", runtimes.GNU),
    ],
)
@pytest.mark.parametrize("renamed", [None, "libfoo.so", "libompwork.so"])
def test_a_real_runtime_is_itself_under_any_name(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    debian_root: Path,
    runtime: str,
    kind: Library,
    renamed: str | None,
) -> None:
    """Each real runtime, and a copy named libfoo.so or like another runtime: its DT_SONAME
    and the GOMP_parallel it defines say what it is."""
    if runtime == "real_iomp":
        path = request.getfixturevalue(runtime)
    else:
        path = Path(runtime) if runtime.startswith("/") else debian_root / "usr/lib" / runtime
    if not path.is_file():
        pytest.fail(f"{path} missing: apt-get install libgomp1")
    if renamed is not None:
        path = place_library(path, tmp_path / renamed)
    assert identify(str(path)) == (kind, True)


def test_intels_stub_and_debugger_library_are_intels_but_serve_nothing(real_iomp: Path) -> None:
    """By their SONAMEs Intel's (the plan refuses them by name, below); no GOMP_parallel."""
    for name in ("libiompstubs5.so", "libiomp5_db.so"):
        assert identify(str(real_iomp.parent / name)) == (runtimes.INTEL, False)


def test_a_file_is_named_only_where_none_can_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built: Path
) -> None:
    """A missing file, a bare name (the loader's to find, never the working directory's
    file) and a file no ELF shared object by their names (examine says why they are none)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy2(built / "libompl.so", tmp_path / "libiomp5.so")
    assert identify("libiomp5.so") == (runtimes.INTEL, True)
    assert library_of(str(tmp_path / "libiomp5.so")) is Library.OTHER
    assert identify(str(tmp_path / "gone" / "libgomp.so.1")) == (runtimes.GNU, True)
    assert library_of(str(tmp_path / "gone" / "libompwork.so")) is runtimes.LLVM
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "libiomp5.so").write_text("INPUT(libiomp5.so.1)\n")
    assert identify(str(tmp_path / "text" / "libiomp5.so")) == (runtimes.INTEL, True)
    assert identify(str(tmp_path / "text")) == (Library.OTHER, False)


@pytest.mark.parametrize(
    ("machine", "problem"),
    [
        ("s390x", None),
        (
            "ppc64le",
            "a big-endian ELF file built for s390x; this ppc64le host runs little-endian ones",
        ),
    ],
)
def test_a_big_endian_library_fits_a_big_endian_host_alone(
    tmp_path: Path, machine: str, problem: str | None
) -> None:
    """The real libiomp5.so's header as s390x's toolchain writes it (big-endian, EM_S390)."""
    library = tmp_path / "libiomp5.so"
    big_endian(library)
    assert elf_problem(library.read_bytes()[:64], machine) == problem


def test_a_32_bit_library_fits_a_32_bit_host_and_is_whole_or_cut_short(tmp_path: Path) -> None:
    """A real 32-bit shared object (valgrind's i386 preload library): its header fits i686
    and i386 hosts, not x86_64; its 32-bit header tables and segments lie within it, and
    no longer once cut short."""
    if not I386_ELF.is_file():
        pytest.skip(f"no real 32-bit shared object here ({I386_ELF})")
    data = I386_ELF.read_bytes()
    assert elf_problem(data[:64], "i686") is None and elf_problem(data[:64], "i386") is None
    assert elf_problem(data[:64], "x86_64") == "a 32-bit ELF file; this x86_64 host needs 64-bit"
    with open(I386_ELF, "rb") as stream:
        assert elf_truncation(data[:64], stream.fileno(), len(data)) is None
    half = len(data) // 2
    (tmp_path / "cut.so").write_bytes(data[:half])
    with open(tmp_path / "cut.so", "rb") as stream:
        found = elf_truncation(data[:64], stream.fileno(), half)
    assert found is not None and found.startswith(f"a truncated ELF file ({half} bytes;"), found


@pytest.mark.parametrize(
    ("package", "name", "kind"),
    [
        ("libtcmalloc-minimal4", "libtcmalloc_minimal.so.4", Library.TCMALLOC),
        ("libjemalloc2", "libjemalloc.so.2", Library.MALLOC),
    ],
)
def test_an_allocator_is_itself_under_any_name(
    tmp_path: Path, package: str, name: str, kind: Library
) -> None:
    """Debian's tcmalloc and jemalloc, copied as libfoo.so: their DT_SONAMEs say what they
    are, allocators, no OpenMP runtime, defining no GOMP_parallel."""
    root = unpack(debian_packages((package,)), tmp_path / "root")
    renamed = place_library(root / MULTIARCH_LIB / name, tmp_path / "libfoo.so")
    assert identify(str(renamed)) == (kind, False)
    assert kind.allocator and not kind.runtime

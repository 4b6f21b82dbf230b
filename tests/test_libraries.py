"""Discovery over real directory trees holding real ELF libraries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from vllm_cpu_launch.libraries import (
    IOMP,
    TCMALLOC,
    Finding,
    Host,
    examine,
    find_library,
    loader_cache_entries,
)
from vllm_cpu_launch.target import Target

MULTIARCH_LIB = "usr/lib/x86_64-linux-gnu"
pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 ELF fixtures")


def host(
    tmp_path: Path,
    environ: Mapping[str, str] | None = None,
    root: Path | None = None,
    search_path: tuple[str, ...] = (),
    machine: str = "x86_64",
) -> Host:
    """A host whose system places are an empty (or given) tree: only what a test lays out."""
    empty_root = tmp_path / "empty-root"
    empty_root.mkdir(exist_ok=True)
    return Host(
        environ=dict(environ or {}),
        machine=machine,
        euid=os.geteuid(),
        launcher_prefix=str(tmp_path / "launcher-env"),
        search_path=search_path,
        root=str(root or empty_root),
    )


def in_environment(prefix: Path) -> Target:
    """The target of a vLLM installed in the environment at `prefix`."""
    python = str(prefix / "bin" / "python")
    return Target(str(prefix / "bin" / "vllm"), "--vllm", python, str(prefix))


def place_library(source: Path, destination: Path) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, destination)
    return destination


def test_target_environment_wins_over_launcher_conda_and_venv(
    tmp_path: Path, real_iomp: Path
) -> None:
    target = tmp_path / "vllm-env"
    for prefix in ("vllm-env", "launcher-env", "conda", "venv"):
        place_library(real_iomp, tmp_path / prefix / "lib" / "libiomp5.so")
    environ = {"CONDA_PREFIX": str(tmp_path / "conda"), "VIRTUAL_ENV": str(tmp_path / "venv")}
    search = find_library(IOMP, host(tmp_path, environ), in_environment(target))
    assert search.chosen is not None
    assert search.chosen.path == str(target / "lib" / "libiomp5.so")
    assert (search.chosen.origin, search.chosen.flavor) == ("vllm-environment", "intel")
    # The first usable place ends the search: later places are not even examined.
    assert [c.origin for c in search.candidates] == ["vllm-environment"]


@pytest.mark.parametrize(
    ("variable", "origin"), [("CONDA_PREFIX", "conda"), ("VIRTUAL_ENV", "virtualenv")]
)
def test_activated_environments(
    tmp_path: Path, real_iomp: Path, variable: str, origin: str
) -> None:
    library = place_library(real_iomp, tmp_path / "env" / "lib" / "libiomp5.so")
    search = find_library(IOMP, host(tmp_path, {variable: str(tmp_path / "env")}), None)
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (str(library), origin)


def test_launcher_environment(tmp_path: Path, real_iomp: Path) -> None:
    library = place_library(real_iomp, tmp_path / "launcher-env" / "lib" / "libiomp5.so")
    search = find_library(IOMP, host(tmp_path), in_environment(tmp_path / "vllm-env-without-lib"))
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (str(library), "launcher-environment")


def test_installed_intel_openmp_distribution(tmp_path: Path, real_iomp: Path) -> None:
    """The real wheel's RECORD in this test environment leads to its real library."""
    search = find_library(IOMP, host(tmp_path, search_path=tuple(sys.path)), None)
    assert search.chosen is not None
    assert search.chosen.origin == "intel-openmp-package"
    assert os.path.samefile(search.chosen.path, real_iomp)


def test_user_local(tmp_path: Path, real_iomp: Path) -> None:
    library = place_library(real_iomp, tmp_path / "home" / ".local" / "lib" / "libiomp5.so")
    search = find_library(IOMP, host(tmp_path, {"HOME": str(tmp_path / "home")}), None)
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (str(library), "user-base")


def test_oneapi_latest_symlink_kept_as_found(tmp_path: Path, real_iomp: Path) -> None:
    root = tmp_path / "root"
    compiler = root / "opt" / "intel" / "oneapi" / "compiler"
    place_library(real_iomp, compiler / "2024.2" / "lib" / "libiomp5.so")
    (compiler / "latest").symlink_to("2024.2")
    search = find_library(IOMP, host(tmp_path, root=root), None)
    assert search.chosen is not None
    assert search.chosen.origin == "oneapi"
    assert search.chosen.path == str(compiler / "latest" / "lib" / "libiomp5.so")


def test_oneapi_newest_version_and_older_layout(tmp_path: Path, real_iomp: Path) -> None:
    root = tmp_path / "root"
    compiler = root / "opt" / "intel" / "oneapi" / "compiler"
    old_layout = Path("linux") / "compiler" / "lib" / "intel64_lin" / "libiomp5.so"
    place_library(real_iomp, compiler / "2021.4.0" / old_layout)
    place_library(real_iomp, compiler / "2025.1" / old_layout)
    (compiler / "not-a-version").mkdir()
    search = find_library(IOMP, host(tmp_path, root=root), None)
    assert search.chosen is not None
    assert search.chosen.path == str(compiler / "2025.1" / old_layout)


def test_oneapi_variables(tmp_path: Path, real_iomp: Path) -> None:
    library = place_library(real_iomp, tmp_path / "cmplr" / "lib" / "libiomp5.so")
    search = find_library(IOMP, host(tmp_path, {"CMPLR_ROOT": str(tmp_path / "cmplr")}), None)
    assert search.chosen is not None and search.chosen.path == str(library)


def test_debian_llvm_alias_is_found_as_named(tmp_path: Path, debian_root: Path) -> None:
    """Debian's libiomp5.so -> ../llvm-14/lib/libomp.so: LLVM's runtime, path unresolved."""
    search = find_library(IOMP, host(tmp_path, root=debian_root), None)
    assert search.chosen is not None
    assert search.chosen.origin == "system"
    assert search.chosen.flavor == "llvm"
    assert search.chosen.path == str(debian_root / MULTIARCH_LIB / "libiomp5.so")
    assert "libomp.so" in os.path.realpath(search.chosen.path)


def test_intel_preferred_over_llvm_in_the_same_place(
    tmp_path: Path, real_iomp: Path, debian_root: Path
) -> None:
    intel_dir = place_library(real_iomp, tmp_path / "intel" / "libiomp5.so").parent
    llvm_dir = debian_root / "usr" / "lib" / "llvm-14" / "lib"
    environ = {"LD_LIBRARY_PATH": f"{llvm_dir}:{intel_dir}"}
    search = find_library(IOMP, host(tmp_path, environ), None)
    assert search.chosen is not None
    assert (search.chosen.origin, search.chosen.flavor) == ("ld-library-path", "intel")
    assert [c.verdict for c in search.candidates] == ["usable", "chosen"]


def cached_vendor_library(real_iomp: Path, root: Path) -> Path:
    """libiomp5 in /opt/vendor/lib under `root`, listed in ld.so.conf and cached by the real
    ldconfig; the library's path."""
    library = place_library(real_iomp, root / "opt" / "vendor" / "lib" / "libiomp5.so")
    (root / "etc").mkdir()
    (root / "etc" / "ld.so.conf").write_text("/opt/vendor/lib\n")
    subprocess.run(
        ["ldconfig", "-r", str(root), "-C", "/etc/ld.so.cache", "-f", "/etc/ld.so.conf", "-X"],
        check=True,
        timeout=60,
    )
    return library


def test_loader_cache(tmp_path: Path, real_iomp: Path) -> None:
    """A real cache built by ldconfig for a directory listed in ld.so.conf."""
    root = tmp_path / "root"
    library = cached_vendor_library(real_iomp, root)
    search = find_library(IOMP, host(tmp_path, root=root), None)
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (str(library), "loader-cache")


def test_tcmalloc_from_debian_tree(tmp_path: Path, debian_root: Path) -> None:
    search = find_library(TCMALLOC, host(tmp_path, root=debian_root), None)
    assert search.chosen is not None
    assert search.chosen.path == str(debian_root / MULTIARCH_LIB / "libtcmalloc_minimal.so.4")


def test_nothing_found_lists_every_place(tmp_path: Path) -> None:
    search = find_library(IOMP, host(tmp_path), in_environment(tmp_path / "vllm-env"))
    assert search.chosen is None and search.candidates == ()
    assert search.places == (
        "ld-preload",
        "vllm-environment",
        "launcher-environment",
        "conda",
        "virtualenv",
        "intel-openmp-package",
        "cmeel-libomp-package",
        "user-base",
        "oneapi",
        "ld-library-path",
        "loader-cache",
        "system",
    )


def patched_copy(source: Path, destination: Path, offset: int, value: bytes) -> Path:
    """A faithful fake of another build: the real library with one ELF header field changed."""
    place_library(source, destination)
    with open(destination, "r+b") as stream:
        stream.seek(offset)
        stream.write(value)
    return destination


@pytest.mark.parametrize(
    ("offset", "value", "reason"),
    [
        (18, (183).to_bytes(2, "little"), "built for aarch64; this host is x86_64"),
        (4, b"\x01", "32-bit ELF file"),
        (16, (2).to_bytes(2, "little"), "not a shared object"),
        (0, b"MZ", "not an ELF file"),
    ],
)
def test_wrong_elf_is_rejected_and_search_goes_on(
    tmp_path: Path, real_iomp: Path, offset: int, value: bytes, reason: str
) -> None:
    bad = patched_copy(real_iomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so", offset, value)
    good = place_library(real_iomp, tmp_path / "launcher-env" / "lib" / "libiomp5.so")
    search = find_library(IOMP, host(tmp_path), in_environment(tmp_path / "vllm-env"))
    assert search.chosen is not None and search.chosen.path == str(good)
    rejected = search.candidates[0]
    assert (rejected.path, rejected.verdict) == (str(bad), "rejected")
    assert reason in rejected.reason


def test_foreign_architecture_host_accepts_its_own_elf(tmp_path: Path, real_iomp: Path) -> None:
    """On an aarch64 host the real x86-64 library is the foreign one."""
    reason = examine(str(real_iomp), IOMP, host(tmp_path, machine="aarch64")).reason
    assert reason == "built for x86_64; this host is aarch64"
    arm = patched_copy(real_iomp, tmp_path / "arm" / "libiomp5.so", 18, (183).to_bytes(2, "little"))
    assert examine(str(arm), IOMP, host(tmp_path, machine="aarch64")) == Finding(None, "intel")


def test_flavor_without_section_headers_is_found_by_the_whole_file_scan(
    tmp_path: Path, real_iomp: Path
) -> None:
    """Without section headers (e_shoff 0, as sstrip leaves a library) there is no
    .rodata to search first: the banner is still found, in the whole file."""
    stripped = patched_copy(real_iomp, tmp_path / "s" / "libiomp5.so", 40, bytes(8))
    assert examine(str(stripped), IOMP, host(tmp_path)) == Finding(None, "intel")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("libiompstubs5.so", "Intel's serial stub library (OMP library type: stub)"),
        ("libiomp5_db.so", "not an OpenMP runtime: it has no Intel or LLVM 'OMP version' banner"),
    ],
)
def test_intel_stub_and_debugger_library_are_no_runtime(
    tmp_path: Path, real_iomp: Path, name: str, reason: str
) -> None:
    """The intel-openmp wheel's serial stub and debugger support library, beside its
    libiomp5.so: named with `libiomp`, whole ELF files, yet no runtime to preload."""
    shipped = real_iomp.parent / name
    assert shipped.is_file(), f"{shipped} missing: the intel-openmp wheel ships it"
    explicit = find_library(IOMP, host(tmp_path), None, explicit=str(shipped))
    assert explicit.chosen is None and reason in explicit.candidates[0].reason
    good = place_library(real_iomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so")
    environ = {"LD_PRELOAD": str(shipped)}
    search = find_library(IOMP, host(tmp_path, environ), in_environment(tmp_path / "vllm-env"))
    assert search.chosen is not None and search.chosen.path == str(good)
    assert (search.candidates[0].path, search.candidates[0].verdict) == (str(shipped), "rejected")
    assert reason in search.candidates[0].reason


@pytest.mark.parametrize(
    ("mode", "which", "reason"),
    [
        (0o646, "file", "writable by others"),
        (0o664, "file", "writable by its group"),
        (0o777, "directory", "writable by others"),
        (0o1777, "directory", "writable by others"),  # sticky does not save the nearest one
        (0o775, "directory", "writable by its group"),
    ],
)
def test_writable_by_others_is_rejected(
    tmp_path: Path, real_iomp: Path, mode: int, which: str, reason: str
) -> None:
    library = place_library(real_iomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so")
    (library if which == "file" else library.parent).chmod(mode)
    search = find_library(IOMP, host(tmp_path), in_environment(tmp_path / "vllm-env"))
    assert search.chosen is None
    assert reason in search.candidates[0].reason
    assert search.candidates[0].reason.startswith("unsafe to preload")


def test_sticky_ancestor_is_fine_but_open_ancestor_is_not(tmp_path: Path, real_iomp: Path) -> None:
    library = place_library(real_iomp, tmp_path / "shared" / "env" / "lib" / "libiomp5.so")
    (tmp_path / "shared").chmod(0o1777)
    assert examine(str(library), IOMP, host(tmp_path)).reason is None
    (tmp_path / "shared").chmod(0o777)
    reason = examine(str(library), IOMP, host(tmp_path)).reason
    assert reason is not None and f"directory {tmp_path / 'shared'} is writable by others" in reason


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_owned_by_another_user_is_rejected(tmp_path: Path, real_iomp: Path) -> None:
    library = place_library(real_iomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so")
    os.chown(library, 65534, 65534)
    reason = examine(str(library), IOMP, host(tmp_path)).reason
    assert reason is not None and "owned by uid 65534" in reason


def test_symlink_through_unsafe_directory_is_rejected(tmp_path: Path, real_iomp: Path) -> None:
    """The resolved file's directories count too: a safe link to an unsafe place is unsafe."""
    real = place_library(real_iomp, tmp_path / "open" / "libiomp5.so")
    real.parent.chmod(0o777)
    link = tmp_path / "vllm-env" / "lib" / "libiomp5.so"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    reason = examine(str(link), IOMP, host(tmp_path)).reason
    assert reason is not None and f"directory {real.parent} is writable by others" in reason


def test_library_path_empty_and_relative_entries(tmp_path: Path, real_iomp: Path) -> None:
    good = place_library(real_iomp, tmp_path / "good" / "libiomp5.so")
    environ = {"LD_LIBRARY_PATH": f":relative/lib:{good.parent}"}
    search = find_library(IOMP, host(tmp_path, environ), None)
    assert search.chosen is not None and search.chosen.path == str(good)
    reasons = {c.path: c.reason for c in search.candidates if c.verdict == "rejected"}
    assert "current directory" in reasons[""]
    assert "relative path" in reasons["relative/lib/libiomp5.so"]


def test_ld_preload_entry_is_a_candidate_first(tmp_path: Path, real_iomp: Path) -> None:
    preloaded = place_library(real_iomp, tmp_path / "mine" / "libiomp5.so")
    place_library(real_iomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so")
    environ = {"LD_PRELOAD": f"/usr/lib/libfoo.so {preloaded}"}
    search = find_library(IOMP, host(tmp_path, environ), in_environment(tmp_path / "vllm-env"))
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (str(preloaded), "ld-preload")


def test_name_without_libiomp_is_rejected(tmp_path: Path, real_iomp: Path) -> None:
    """vLLM only recognises `libiomp` in LD_PRELOAD: another name would not count."""
    renamed = place_library(real_iomp, tmp_path / "omp-runtime.so")
    reason = examine(str(renamed), IOMP, host(tmp_path)).reason
    assert reason is not None and "lacks 'libiomp'" in reason


def test_path_containing_libgomp_is_rejected(tmp_path: Path, real_iomp: Path) -> None:
    """vLLM would read the substring as GNU OpenMP preloaded next to Intel's and assert."""
    library = place_library(real_iomp, tmp_path / "libgomp-free" / "lib" / "libiomp5.so")
    reason = examine(str(library), IOMP, host(tmp_path)).reason
    assert reason is not None and "contains 'libgomp'" in reason


def test_every_hop_of_a_link_chain_is_checked(tmp_path: Path, real_iomp: Path) -> None:
    """x -> ../y/libiomp5.so -> ../z/libiomp5.so: whoever can write y can swap the 2nd link."""
    place_library(real_iomp, tmp_path / "z" / "libiomp5.so")
    for name, target in (("y", "../z/libiomp5.so"), ("x", "../y/libiomp5.so")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "libiomp5.so").symlink_to(target)
    first = tmp_path / "x" / "libiomp5.so"
    assert examine(str(first), IOMP, host(tmp_path)).reason is None
    (tmp_path / "y").chmod(0o777)
    reason = examine(str(first), IOMP, host(tmp_path)).reason
    assert reason is not None and f"directory {tmp_path / 'y'} is writable by others" in reason


def test_a_directory_link_on_the_way_is_followed(tmp_path: Path, real_iomp: Path) -> None:
    """a/lib -> ../open/dirlink -> ../z: the open directory is searched on the way."""
    place_library(real_iomp, tmp_path / "z" / "libiomp5.so")
    (tmp_path / "open").mkdir()
    (tmp_path / "open" / "dirlink").symlink_to("../z")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "lib").symlink_to("../open/dirlink")
    library = tmp_path / "a" / "lib" / "libiomp5.so"
    assert examine(str(library), IOMP, host(tmp_path)).reason is None
    (tmp_path / "open").chmod(0o777)
    reason = examine(str(library), IOMP, host(tmp_path)).reason
    assert reason is not None and f"directory {tmp_path / 'open'} is writable by others" in reason


def test_rules_for_a_user_other_than_root(tmp_path: Path, real_iomp: Path) -> None:
    """Not root: a group-writable venv (umask 002) or another user's files are fine,
    since that user's Python code runs in vLLM anyway; a world-writable place is not."""
    library = place_library(real_iomp, tmp_path / "env" / "lib" / "libiomp5.so")
    user = Host({}, "x86_64", 1000, str(tmp_path / "none"), (), str(tmp_path))
    library.parent.chmod(0o775)
    assert examine(str(library), IOMP, user) == Finding(None, "intel")  # owned by root, not 1000
    library.parent.chmod(0o777)
    reason = examine(str(library), IOMP, user).reason
    assert reason is not None and "writable by others" in reason


@pytest.mark.parametrize("exhaustive", [False, True])
def test_intel_in_a_later_place_wins_over_llvm_in_an_earlier_one(
    tmp_path: Path, real_iomp: Path, debian_root: Path, exhaustive: bool
) -> None:
    """LLVM's runtime in the vLLM environment, Intel's only in oneAPI's place: Intel's is
    chosen, LLVM's reported usable, whether the search stops there or (doctor) goes on."""
    (libomp,) = (debian_root / "usr/lib/llvm-14/lib").glob("libomp.so.5")
    llvm = place_library(libomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so")
    intel = place_library(real_iomp, tmp_path / "cmplr" / "lib" / "libiomp5.so")
    environ = {"CMPLR_ROOT": str(tmp_path / "cmplr")}
    target = in_environment(tmp_path / "vllm-env")
    search = find_library(IOMP, host(tmp_path, environ), target, exhaustive=exhaustive)
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.flavor, search.chosen.origin) == (
        str(intel),
        "intel",
        "oneapi",
    )
    verdicts = {c.path: (c.flavor, c.verdict) for c in search.candidates}
    assert verdicts[str(llvm)] == ("llvm", "usable")


def big_endian_copy(cache: bytes) -> bytes:
    """An ldconfig cache as a big-endian machine (s390x) writes it: the same strings, its
    header's and entries' numbers byte-swapped, the header's flags saying big-endian."""
    start = cache.index(b"glibc-ld.so.cache1.1")
    data = bytearray(cache)
    count = int.from_bytes(cache[start + 20 : start + 24], "little")
    swap = [start + 20, start + 24, start + 32]  # nlibs, len_strings, extension_offset
    for index in range(count):  # flags, key, value, osversion (hwcap: 8 bytes)
        swap += [start + 48 + 24 * index + field for field in (0, 4, 8, 12)]
    for at in swap:
        data[at : at + 4] = cache[at : at + 4][::-1]
    for index in range(count):
        at = start + 48 + 24 * index + 16
        data[at : at + 8] = cache[at : at + 8][::-1]
    data[start + 28] = 3  # cache_file_new_flags_endian_big
    return bytes(data)


def test_a_big_endian_loader_cache_is_read_in_its_byte_order(
    tmp_path: Path, real_iomp: Path
) -> None:
    """s390x is a listed machine: its cache's numbers are big-endian (issue 29, defect 5)."""
    root = tmp_path / "root"
    library = cached_vendor_library(real_iomp, root)
    cache = root / "etc" / "ld.so.cache"
    little = loader_cache_entries(str(cache))
    assert "/opt/vendor/lib/libiomp5.so" in little
    cache.write_bytes(big_endian_copy(cache.read_bytes()))
    assert loader_cache_entries(str(cache)) == little
    search = find_library(IOMP, host(tmp_path, root=root), None)
    assert search.chosen is not None and search.chosen.path == str(library)

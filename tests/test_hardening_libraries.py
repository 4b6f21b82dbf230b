"""Hostile libiomp5.so candidates: each is rejected with its reason in the plan, without
hanging, and the library is then taken from a safe place further down the search."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch.libraries import IOMP, NOT_FOUND_BY_LOADER, Host, find_library

from .conftest import AS_NOBODY, NOBODY
from .hardening_support import (
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

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 ELF fixtures")
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
    chmod (tests/test_plan_contract.py runs that fix)."""
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

"""Validate the candidates of each place and choose the library to preload."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from vllm_cpu_launch.elf import elf_problem, elf_truncation, openmp_runtime
from vllm_cpu_launch.places import IOMP, MARKER, search_places
from vllm_cpu_launch.records import record
from vllm_cpu_launch.trust import insecure_reason

if TYPE_CHECKING:
    from vllm_cpu_launch.places import Host
    from vllm_cpu_launch.target import Target

LLVM = "llvm"  # the flavor of LLVM's libomp (elf.FLAVOR_MARKERS)
FLAVOR_RANK = {"intel": 0, LLVM: 1, None: 2}
UNSAFE = "unsafe to preload: "  # how a candidate the trust rule refuses is rejected


@record
class Candidate:
    """A library file considered for preloading, with the verdict and its reason."""

    kind: str
    path: str
    origin: str
    verdict: str  # "chosen", "rejected", or "usable" (valid but a better one was chosen)
    reason: str
    flavor: str | None = None
    fix: str = ""  # for a library refused as unsafe: the command that makes it trusted


def runtime_problem(flavor: str | None, library_type: str | None) -> str | None:
    """Why an iomp candidate, a fitting ELF file, is no OpenMP runtime to preload.

    Intel's intel-openmp wheel ships two such files beside libiomp5.so, both named with
    `libiomp`: libiompstubs5.so, the serial stub (`library type: stub`), with which
    every parallel region runs on one thread, and libiomp5_db.so, the debugger support
    library, which has no runtime banner at all.
    """
    if flavor is None:
        return (
            "not an OpenMP runtime: it has no Intel or LLVM 'OMP version' banner (like "
            "libiomp5_db.so, Intel's debugger support library)"
        )
    if library_type == "stub":
        owner = "Intel" if flavor == "intel" else "LLVM"
        return (
            f"{owner}'s serial stub library (OMP library type: stub): every parallel region "
            "would run on one thread; use libiomp5.so"
        )
    return None


def examine(
    path: str, kind: str, host: Host, trusted: frozenset[int] = frozenset()
) -> tuple[str | None, str | None, str]:
    """(reason to reject or None, flavor, fix for an unsafe one) for one candidate file."""
    if not path:
        return "an empty path means the current directory to the loader", None, ""
    if "/" not in path:
        return "a bare name, which the loader looks up itself: give the absolute path", None, ""
    if not os.path.isabs(path):
        return "a relative path depends on the working directory", None, ""
    if " " in path or ":" in path:
        return (
            "its path holds a space or colon, which split LD_PRELOAD: the loader would "
            "not preload it (link it from a path without them)",
            None,
            "",
        )
    if MARKER[kind] not in os.path.basename(path):
        return f"its name lacks '{MARKER[kind]}', the text vLLM looks for in LD_PRELOAD", None, ""
    if "libgomp" in path:
        # vLLM tests LD_PRELOAD for the substring: it would see GNU OpenMP next to Intel's
        # and refuse to start (vllm/utils/ompmultiprocessing.py).
        return "its path contains 'libgomp', which vLLM would take for GNU OpenMP", None, ""
    try:
        status = os.stat(path)
    except OSError as error:
        if os.path.islink(path):
            detail = "a symbolic link loop" if error.errno == 40 else "a dangling symbolic link"
            return detail, None, ""
        missing = isinstance(error, FileNotFoundError)
        return "does not exist" if missing else error.strerror, None, ""
    if not stat.S_ISREG(status.st_mode):
        what = "a directory" if stat.S_ISDIR(status.st_mode) else "not a regular file"
        return what, None, ""
    try:
        # O_NONBLOCK: should the file be swapped for a FIFO after the stat, the open
        # must not wait for a writer.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as error:
        return f"not readable: {error.strerror}", None, ""
    with os.fdopen(descriptor, "rb") as stream:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode):
            return "not a regular file", None, ""
        header = stream.read(64)
        problem = elf_problem(header, host.machine) or elf_truncation(
            header, descriptor, opened.st_size
        )
        if problem:
            return problem, None, ""
        unsafe = insecure_reason(path, host.euid, trusted)
        if unsafe:
            return f"{UNSAFE}{unsafe[0]}", None, unsafe[1]
        if kind != IOMP:
            return None, None, ""
        # The banners are looked for only once it is known to be a fitting ELF file.
        flavor, library_type = openmp_runtime(descriptor, header)
        problem = runtime_problem(flavor, library_type)
        return problem, None if problem else flavor, ""


@record
class Search:
    """The outcome of looking for one kind of library."""

    kind: str
    chosen: Candidate | None
    candidates: tuple[Candidate, ...]
    places: tuple[str, ...]  # the origins searched, for the 'not found' message


def find_library(
    kind: str,
    host: Host,
    target: Target | None,
    exhaustive: bool = False,
    explicit: str | None = None,
    trusted: frozenset[int] = frozenset(),
) -> Search:
    """Search the places in order; the first place with a usable file wins.

    An Intel OpenMP in any place wins over LLVM's: an LLVM runtime (cmeel-libomp,
    llvm-openmp, Debian's alias) is taken only where no place has Intel's, and the plan
    decides whether to preload it for SD (evidence.llvm_runtime). With `exhaustive`
    (doctor) every place is examined and reported. An `explicit` file (--iomp-path)
    is the only candidate: there is no falling back from what the user named.
    `trusted`: uids besides root whose files may be preloaded (the target's owners).
    """
    if explicit is not None:
        reason, flavor, fix = examine(explicit, kind, host, trusted)
        given = Candidate(
            kind,
            explicit,
            "explicit",
            "rejected" if reason else "chosen",
            reason or "given",
            flavor,
            fix,
        )
        return Search(kind, None if reason else given, (given,), ("explicit",))
    seen: set[str] = set()
    candidates: list[Candidate] = []
    searched: list[str] = []
    chosen: Candidate | None = None
    llvm: Candidate | None = None  # the first LLVM runtime, taken if no Intel one is found
    for place in search_places(kind, host, target):
        searched.append(place.origin)
        usable: list[Candidate] = []
        for path in place.paths:
            normalized = os.path.normpath(path) if path else path
            if normalized in seen:
                continue
            seen.add(normalized)
            reason, flavor, fix = examine(path, kind, host, trusted)
            verdict = "rejected" if reason else "usable"
            candidate = Candidate(kind, path, place.origin, verdict, reason or "valid", flavor, fix)
            candidates.append(candidate)
            if not reason:
                usable.append(candidate)
        best = min(usable, key=lambda c: FLAVOR_RANK.get(c.flavor, 2), default=None)
        # The caller's own preloaded runtime is final, whatever its flavor (it is theirs).
        if best is not None and best.flavor == LLVM and place.origin != "ld-preload":
            llvm = llvm or best
        elif best is not None and chosen is None:
            chosen = best
            if not exhaustive:
                break
    winner = chosen or llvm
    if winner is not None:
        why = "first usable" if chosen else "first usable; no Intel OpenMP found, LLVM's"
        chosen = Candidate(kind, winner.path, winner.origin, "chosen", why, winner.flavor)
        candidates = [chosen if c is winner else c for c in candidates]
    return Search(kind, chosen, tuple(candidates), tuple(searched))

"""Validate the candidates of each place and choose the library to preload."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from vllm_cpu_launch.elf import elf_problem, elf_truncation, openmp_runtime
from vllm_cpu_launch.places import IOMP, MARKER, resolve_preload_entry, search_places
from vllm_cpu_launch.records import record
from vllm_cpu_launch.runtimes import LLVM as LLVM  # also the flavor of LLVM's libomp (elf)
from vllm_cpu_launch.trust import insecure_reason, quoted

if TYPE_CHECKING:
    from vllm_cpu_launch.places import Host
    from vllm_cpu_launch.target import Target

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
    unsafe: bool = False  # refused by the trust rule (reason says why, fix how)


@record
class Verdict:
    """What examining one file found: the reason to reject it (None: usable)."""

    reason: str | None
    flavor: str | None = None
    fix: str = ""
    unsafe: bool = False


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


def form_problem(path: str, kind: str) -> str | None:
    """Why a path the plan would put in LD_PRELOAD cannot stand there as written."""
    if not path:
        return "an empty path means the current directory to the loader"
    if "/" not in path:
        return "a bare name, which the loader looks up itself: give the absolute path"
    if not os.path.isabs(path):
        return "a relative path depends on the working directory"
    if " " in path or ":" in path:
        return (
            "its path holds a space or colon, which split LD_PRELOAD: the loader would "
            "not preload it (link it from a path without them)"
        )
    if MARKER[kind] not in os.path.basename(path):
        return f"its name lacks '{MARKER[kind]}', the text vLLM looks for in LD_PRELOAD"
    if "libgomp" in path:
        # vLLM tests LD_PRELOAD for the substring: it would see GNU OpenMP next to Intel's
        # and refuse to start (vllm/utils/ompmultiprocessing.py).
        return "its path contains 'libgomp', which vLLM would take for GNU OpenMP"
    return None


def examine(
    path: str,
    kind: str | None,
    host: Host,
    trusted: frozenset[int] = frozenset(),
    as_written: bool = True,
) -> tuple[str | None, str | None, str]:
    """(reason to reject or None, flavor, fix for an unsafe one) for one candidate file.

    `kind` None: any library (a caller's), examined as a file alone. `as_written` False:
    `path` is where the loader finds a caller's entry (resolve_preload_entry), whose form
    is theirs to choose."""
    found = verdict(path, kind, host, trusted, as_written)
    return found.reason, found.flavor, found.fix


def verdict(
    path: str,
    kind: str | None,
    host: Host,
    trusted: frozenset[int] = frozenset(),
    as_written: bool = True,
    named: bool = False,
) -> Verdict:
    """examine's finding as a record: whether the trust rule refused it is a field.
    `named`: the user named the file (trust.insecure_reason's fixes differ)."""
    problem = form_problem(path, kind) if as_written and kind is not None else None
    if problem:
        return Verdict(problem)
    reason, flavor, fix = file_verdict(path, kind, host, trusted, named)
    if isinstance(reason, Unsafe):
        return Verdict(f"{UNSAFE}{reason.why}", None, fix, unsafe=True)
    return Verdict(reason, flavor, fix)


@record
class Unsafe:
    """file_verdict's refusal by the trust rule, told apart by its type, not its text."""

    why: str


def file_verdict(
    path: str, kind: str | None, host: Host, trusted: frozenset[int], named: bool = False
) -> tuple[str | Unsafe | None, str | None, str]:
    """examine's checks of the file itself: a regular, readable ELF file of this machine
    that the trust rule accepts, and for an OpenMP runtime, a runtime's banner."""
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
        unsafe = insecure_reason(path, host.euid, trusted, named)
        if unsafe:
            return Unsafe(unsafe[0]), None, unsafe[1]
        if kind != IOMP:
            return None, None, ""
        # The banners are looked for only once it is known to be a fitting ELF file.
        flavor, library_type = openmp_runtime(descriptor, header)
        problem = runtime_problem(flavor, library_type)
        return problem, None if problem else flavor, ""


# Why a caller's bare-named LD_PRELOAD entry is rejected where the loader finds no file.
NOT_FOUND_BY_LOADER = (
    "the loader finds no file of that name where it looks (LD_LIBRARY_PATH, its cache, "
    "the system directories): it prints 'cannot be preloaded' and goes on without it"
)


RELATIVE_ENTRY = (
    "a relative path, which the loader opens from each process's working directory (a "
    "unit, container or worker started elsewhere preloads nothing)"
)


def callers_verdict(entry: str, kind: str | None, host: Host, trusted: frozenset[int]) -> Verdict:
    """A caller's LD_PRELOAD entry, judged once for every use: theirs as written, examined
    where the loader finds it (a bare name, `$LIB`), its name unjudged; a relative path is
    refused by the trust rule, as a relative VIRTUAL_ENV is, with the LD_PRELOAD that
    names the same files absolutely."""
    if "/" in entry and not os.path.isabs(entry) and "$" not in entry:
        entries = host.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":")
        absolute = ":".join(
            os.path.abspath(e) if "/" in e and not os.path.isabs(e) and "$" not in e else e
            for e in entries
            if e
        )
        return Verdict(RELATIVE_ENTRY, None, f"export LD_PRELOAD={quoted(absolute)}", unsafe=True)
    resolved = resolve_preload_entry(entry, host)
    if resolved is None:
        return Verdict(NOT_FOUND_BY_LOADER)
    return verdict(resolved, kind, host, trusted, as_written=False, named=True)


def candidate_of(
    kind: str, path: str, origin: str, host: Host, trusted: frozenset[int]
) -> Candidate:
    """One file examined where `origin` proposed it: a caller's LD_PRELOAD entry as
    callers_verdict judges it; ours must be an absolute path vLLM recognises."""
    if origin == "ld-preload":
        found = callers_verdict(path, kind, host, trusted)
    else:
        found = verdict(path, kind, host, trusted, named=origin == "explicit")
    return Candidate(
        kind,
        path,
        origin,
        "rejected" if found.reason else "usable",
        found.reason or "valid",
        found.flavor,
        found.fix,
        found.unsafe,
    )


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
        given = candidate_of(kind, explicit, "explicit", host, trusted)
        if given.verdict == "usable":
            given = Candidate(kind, explicit, "explicit", "chosen", "given", given.flavor)
        return Search(kind, given if given.verdict == "chosen" else None, (given,), ("explicit",))
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
            candidate = candidate_of(kind, path, place.origin, host, trusted)
            candidates.append(candidate)
            if candidate.verdict == "usable":
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

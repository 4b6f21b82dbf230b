"""Where to look for a library, and which candidate to preload: the places of docs/design.md's
search order are read in order, each only when reached, and every candidate is validated."""

from __future__ import annotations

import functools
import os
import stat
import sys
from typing import TYPE_CHECKING, Literal

from vllm_cpu_launch.elf import (
    Kind,
    Library,
    elf_problem,
    elf_truncation,
    library_of,
    openmp_runtime,
    soname_of,
)
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.messages import StrEnum
from vllm_cpu_launch.records import record, replace
from vllm_cpu_launch.runtimes import (
    INTEL,
    LLVM,
    by_soname,
    by_word,
    preloadable,
    rank,
    vllm_reads_gnu,
    vllm_reads_kmp,
)
from vllm_cpu_launch.target import python_user_base, site_packages
from vllm_cpu_launch.trust import insecure_reason, quoted

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

    from vllm_cpu_launch.shape import Shape, Use
    from vllm_cpu_launch.target import Target

    Places = Iterator[tuple["Origin", list[str]]]  # each place's origin and the files it proposes


class Sought(StrEnum):
    """What a search looks for: an OpenMP runtime vLLM takes for Intel's (a KMP family's:
    runtimes.preloadable), or tcmalloc."""

    IOMP = "iomp"
    TCMALLOC = "tcmalloc"


IOMP, TCMALLOC = Sought.IOMP, Sought.TCMALLOC
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so")
TCMALLOC_MARKER = "libtcmalloc"  # vLLM recognises tcmalloc by this substring of LD_PRELOAD


def names(kind: str) -> tuple[str, ...]:
    """The file names a search looks for: the runtime families' (runtimes.family.Family.files)."""
    if kind == TCMALLOC:
        return (*TCMALLOC_NAMES, "libtcmalloc.so")
    return tuple(dict.fromkeys(name for f in preloadable() for name in f.files))


def proposed(kind: str, entry: Kind) -> bool:
    """Whether a search proposes the caller's entry, by what its file is (elf.library_of)."""
    return entry is Library.TCMALLOC if kind == TCMALLOC else entry in preloadable()


MULTIARCH = {m: f"{m}-linux-gnu" for m in ("x86_64", "aarch64", "s390x", "riscv64")}
MULTIARCH["ppc64le"] = "powerpc64le-linux-gnu"
LOADER_CACHE = "etc/ld.so.cache"
ONEAPI_ROOT = "opt/intel/oneapi"

# Where the system places are, for a test that states the host it runs on: it adds no way
# in, since whoever sets it could set LD_PRELOAD, and every library found under it passes
# the same trust rule as one named by --iomp-path (every directory from "/" to the file).
SYSTEM_ROOT_VARIABLE = "VLLMCPULAUNCH_SYSTEM_ROOT"


def system_root(environ: Mapping[str, str]) -> str:
    value = environ.get(SYSTEM_ROOT_VARIABLE, "")
    if value and not os.path.isabs(value):
        raise LaunchError(
            EXIT_USAGE,
            f"{SYSTEM_ROOT_VARIABLE}={value}: not an absolute path; give the directory the "
            "system libraries lie under, or unset it (the system's own: /)",
        )
    return value or "/"


@record
class PreloadEntry:
    """One entry of the caller's LD_PRELOAD, and what its file is (elf.library_of)."""

    path: str  # as written: a path, a bare name, `$LIB` unexpanded
    kind: Kind


@functools.lru_cache(maxsize=4)
def read_preload(value: str) -> tuple[PreloadEntry, ...]:
    """LD_PRELOAD's entries, split where glibc's loader splits them (spaces and colons:
    tabs and other white space are part of an entry, rtld.c " :"), each classified."""
    entries = (entry for entry in value.replace(":", " ").split(" ") if entry)
    return tuple(PreloadEntry(entry, library_of(entry)) for entry in entries)


@record
class Host:
    environ: Mapping[str, str]
    machine: str  # os.uname().machine
    euid: int
    launcher_prefix: str  # sys.prefix of the launcher's own interpreter
    search_path: tuple[str, ...] = ()  # sys.path, for installed distributions
    root: str = "/"  # where the system places are: see SYSTEM_ROOT_VARIABLE
    cpus: int = 0  # CPUs this process may run on (sched_getaffinity); 0: not known
    shape: Shape | None = None  # those CPUs' quota and nodes (shape.py); None: not read
    use: Use | None = None  # whose those CPUs are at start (shape.host_use); None: not asked

    @property
    def preload(self) -> tuple[PreloadEntry, ...]:
        """The caller's LD_PRELOAD, read once (read_preload's cache): every stage and verb
        reads these, never the variable."""
        return read_preload(self.environ.get(LD_PRELOAD, ""))

    @property
    def taken_for_intel(self) -> tuple[str, ...]:
        """The entries whose file's name vLLM takes for Intel OpenMP (`libiomp`, `libomp`)."""
        names = (e.path for e in self.preload)
        return tuple(p for p in names if vllm_reads_kmp(os.path.basename(p)))


class Origin(StrEnum):
    """Where a candidate came from (the word the plan, doctor and --dry-run say)."""

    EXPLICIT = "explicit"
    LD_PRELOAD = "ld-preload"
    VLLM_ENVIRONMENT = "vllm-environment"
    LAUNCHER_ENVIRONMENT = "launcher-environment"
    CONDA = "conda"
    VIRTUALENV = "virtualenv"
    INTEL_OPENMP_PACKAGE = "intel-openmp-package"
    CMEEL_LIBOMP_PACKAGE = "cmeel-libomp-package"
    VLLM_BUNDLED = "vllm-bundled"
    USER_BASE = "user-base"
    ONEAPI = "oneapi"
    LD_LIBRARY_PATH = "ld-library-path"
    LOADER_CACHE = "loader-cache"
    SYSTEM = "system"


def files_named(directories: Iterable[str | None], names: tuple[str, ...]) -> list[str]:
    return [
        os.path.join(directory, name)
        for directory in directories
        if directory
        for name in names
        if os.path.lexists(os.path.join(directory, name))
    ]


# glibc's cache_file_new_flags_endian_{little,big} (2.33 on), under its mask 3; a cache
# without them was written by the machine that reads it, in its byte order (s390x: big).
CACHE_BYTE_ORDER: dict[int, Literal["little", "big"]] = {2: "little", 3: "big"}


def loader_cache_entries(cache_file: str, names: tuple[str, ...] = ()) -> list[str]:
    """Library paths listed in glibc's /etc/ld.so.cache (format 'glibc-ld.so.cache1.1'),
    read directly rather than through `ldconfig -p`: no child process on the exec path."""
    try:
        with open(cache_file, "rb") as stream:
            data = stream.read()
    except OSError:
        return []
    if names and not any(name.encode() in data for name in names):
        return []  # the usual case, decided without parsing hundreds of entries
    start = data.find(b"glibc-ld.so.cache1.1")  # after the old-format table on older systems
    if start < 0 or len(data) < start + 48:
        return []
    order = CACHE_BYTE_ORDER.get(data[start + 28] & 3, sys.byteorder)
    count = int.from_bytes(data[start + 20 : start + 24], order)
    paths = []
    for entry in range(start + 48, start + 48 + 24 * count, 24):
        if entry + 24 > len(data):
            break
        value = start + int.from_bytes(data[entry + 8 : entry + 12], order)
        end = data.find(b"\0", value)
        if end > 0:
            paths.append(data[value:end].decode("utf-8", "surrogateescape"))
    return paths


def system_path(host: Host, path: str) -> str:
    return os.path.join(host.root, path.lstrip("/"))


def version_key(name: str) -> tuple[int, ...]:
    """'2024.2' -> (2024, 2); names that are not versions sort first."""
    parts = name.split(".")
    return tuple(int(part) for part in parts) if all(p.isdigit() for p in parts) else ()


def listing(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def distribution_files(distribution: str, search_path: Iterable[str], name: str) -> list[str]:
    """Files called `name` that an installed distribution's RECORD lists, read directly:
    importlib.metadata costs more to import than the whole launcher."""
    prefix = distribution.replace("-", "_") + "-"
    found = []
    for site in filter(os.path.isabs, search_path):  # "" in sys.path: the working directory
        for entry in listing(site):
            if entry.startswith(prefix) and entry.endswith(".dist-info"):
                try:
                    with open(os.path.join(site, entry, "RECORD"), encoding="utf-8") as stream:
                        relatives = [line.split(",", 1)[0] for line in stream]
                except OSError:
                    continue
                found += [os.path.join(site, r) for r in relatives if os.path.basename(r) == name]
    return [os.path.normpath(path) for path in found]


def lib_directory(prefix: str | None) -> str | None:
    return os.path.join(prefix, "lib") if prefix else None


def cmeel_libomp(target: Target | None, host: Host) -> list[str]:
    """LLVM's runtime by the `cmeel-libomp` wheel's libiomp5.so alias, whose directory also
    holds a `libgomp.so.1` alias: it is never put on a library path, only the file preloaded."""
    prefixes = (target.user_base, target.prefix) if target else ()
    user_base = python_user_base(host.environ)  # where `pip install --user` puts it
    sites = [site for prefix in (*prefixes, user_base) for site in site_packages(prefix)]
    return distribution_files(LLVM.wheel, [*sites, *host.search_path], LLVM.files[0])


def search_places(kind: str, host: Host, target: Target | None) -> Places:
    """The places of docs/design.md's order and what each proposes, each computed when reached."""
    files, environ, search = names(kind), host.environ, host.search_path
    target_prefix = target.prefix if target else None
    target_lib = [lib_directory(target.user_base if target else None), lib_directory(target_prefix)]
    user_lib = [lib_directory(python_user_base(environ))]
    # An entry vLLM takes for Intel OpenMP by its file's name is examined as one: vLLM acts on it.
    named = host.taken_for_intel if kind == IOMP else ()
    preloaded = [e.path for e in host.preload if proposed(kind, e.kind) or e.path in named]
    yield Origin.LD_PRELOAD, preloaded
    yield Origin.VLLM_ENVIRONMENT, files_named(target_lib, files)
    yield Origin.LAUNCHER_ENVIRONMENT, files_named([lib_directory(host.launcher_prefix)], files)
    yield Origin.CONDA, files_named([lib_directory(environ.get("CONDA_PREFIX"))], files)
    yield Origin.VIRTUALENV, files_named([lib_directory(environ.get("VIRTUAL_ENV"))], files)
    if kind == IOMP:
        yield Origin.INTEL_OPENMP_PACKAGE, distribution_files(INTEL.wheel, search, INTEL.files[0])
        yield Origin.CMEEL_LIBOMP_PACKAGE, cmeel_libomp(target, host)
        yield Origin.USER_BASE, files_named(user_lib, files)
        # Intel oneAPI keeps libiomp5 in 2024+ `compiler/X/lib`, older `intel64_lin`.
        compiler_root = system_path(host, os.path.join(ONEAPI_ROOT, "compiler"))
        versions = [n for n in listing(compiler_root) if version_key(n)]
        oneapi = environ.get("ONEAPI_ROOT")
        roots = [
            environ.get("CMPLR_ROOT"),
            os.path.join(oneapi, "compiler", "latest") if oneapi else None,
            os.path.join(compiler_root, "latest"),
            os.path.join(compiler_root, max(versions, key=version_key)) if versions else None,
        ]
        libs = (["lib"], ["linux", "compiler", "lib", "intel64_lin"])
        oneapi_lib = [os.path.join(root, *lib) for root in roots if root for lib in libs]
        yield Origin.ONEAPI, files_named(oneapi_lib, files)
    else:
        # Newer vLLM wheels bundle tcmalloc in `lib/python3.N/site-packages/vllm/libs/`.
        bundles = [os.path.join(site, "vllm", "libs") for site in site_packages(target_prefix)]
        found = [os.path.join(d, n) for d in bundles for n in listing(d) if TCMALLOC_MARKER in n]
        yield Origin.VLLM_BUNDLED, found
        yield Origin.USER_BASE, files_named(user_lib, files)
    yield from loader_places(files, host)


def loader_places(names: tuple[str, ...], host: Host) -> Places:
    """Where the loader looks for a bare name, in its order (relative entries: to reject)."""
    value = host.environ.get("LD_LIBRARY_PATH", "")
    paths: list[str] = []
    for directory in value.split(":") if value else []:
        if os.path.isabs(directory):
            paths.extend(files_named([directory], names))
        else:  # "" is the current directory to the loader
            paths.append(os.path.join(directory, names[0]) if directory else "")
    yield Origin.LD_LIBRARY_PATH, paths
    entries = loader_cache_entries(system_path(host, LOADER_CACHE), names)
    cached = (system_path(host, p) for p in entries if os.path.basename(p) in names)
    yield Origin.LOADER_CACHE, list(dict.fromkeys(cached))
    usr_local = system_path(host, "/usr/local")
    multiarch = MULTIARCH.get(host.machine)
    system = [
        *(os.path.join(usr_local, n) for n in listing(usr_local) if n.startswith("lib")),
        system_path(host, f"/usr/lib/{multiarch}") if multiarch else None,
        system_path(host, "/usr/lib64"),
        system_path(host, "/usr/lib"),
    ]
    yield Origin.SYSTEM, files_named(system, names)


UNSAFE = "unsafe to preload: "  # how a candidate the trust rule refuses is rejected


class CandidateVerdict(StrEnum):
    CHOSEN = "chosen"
    USABLE = "usable"  # valid, but a better one was chosen (or none is wanted beside theirs)
    REJECTED = "rejected"  # its reason says why


@record
class Candidate:
    kind: str
    path: str
    origin: Origin
    verdict: CandidateVerdict
    reason: str
    flavor: str | None = None  # a runtime family's word (runtimes.family.Family.word)
    fix: str = ""  # for a library refused as unsafe: the command that makes it trusted
    unsafe: bool = False  # refused by the trust rule (reason says why, fix how)


@record
class Finding:
    """What examining one file found: the reason to reject it (None: usable)."""

    reason: str | None
    flavor: str | None = None
    fix: str = ""
    unsafe: bool = False


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
    name = os.path.basename(path)
    if not (vllm_reads_kmp(name) if kind == IOMP else TCMALLOC_MARKER in name):
        texts = "' or '".join(f for f in INTEL.vllm_names) if kind == IOMP else TCMALLOC_MARKER
        return f"its name lacks '{texts}', the texts vLLM looks for in LD_PRELOAD"
    if vllm_reads_gnu(path):
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
    named: bool = False,
) -> Finding:
    """Whether a file may be preloaded: a path that can stand in LD_PRELOAD (`as_written`), a
    regular ELF file of this machine the trust rule accepts, and for iomp, a runtime's banner."""
    problem = form_problem(path, kind) if as_written and kind is not None else None
    if problem:
        return Finding(problem)
    try:
        status = os.stat(path)
    except OSError as error:
        if os.path.islink(path):
            loop = error.errno == 40  # ELOOP
            return Finding("a symbolic link loop" if loop else "a dangling symbolic link")
        return Finding("does not exist" if isinstance(error, FileNotFoundError) else error.strerror)
    if not stat.S_ISREG(status.st_mode):
        return Finding("a directory" if stat.S_ISDIR(status.st_mode) else "not a regular file")
    try:
        # O_NONBLOCK: should the file be swapped for a FIFO after the stat, the open
        # must not wait for a writer.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as error:
        return Finding(f"not readable: {error.strerror}")
    with os.fdopen(descriptor, "rb") as stream:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode):
            return Finding("not a regular file")
        header = stream.read(64)
        problem = elf_problem(header, host.machine)
        problem = problem or elf_truncation(header, descriptor, opened.st_size)
        if problem:
            return Finding(problem)
        unsafe = insecure_reason(path, host.euid, trusted, named)
        if unsafe:
            return Finding(f"{UNSAFE}{unsafe[0]}", None, unsafe[1], unsafe=True)
        if kind != IOMP:
            return Finding(None)
        # The banners are looked for only once it is known to be a fitting ELF file.
        flavor, library_type = openmp_runtime(descriptor, header)
        # What the file says of itself first: a family's SONAME, else its banner's.
        family = by_soname(soname_of(descriptor, header)) if flavor else None
    if flavor is None:  # the intel-openmp wheel ships two such `libiomp*` beside libiomp5.so
        return Finding(
            "not an OpenMP runtime: it has no Intel or LLVM 'OMP version' banner (like "
            "libiomp5_db.so, Intel's debugger support library)"
        )
    if library_type == "stub":
        owner = flavor.title.partition(" ")[0]
        return Finding(
            f"{owner}'s serial stub library (OMP library type: stub): every parallel "
            "region would run on one thread; use libiomp5.so"
        )
    return Finding(None, (family or flavor).word)


# Why a caller's bare-named LD_PRELOAD entry is rejected where the loader finds no file.
NOT_FOUND_BY_LOADER = (
    "the loader finds no file of that name where it looks (LD_LIBRARY_PATH, its cache, "
    "the system directories): it prints 'cannot be preloaded' and goes on without it"
)
RELATIVE_ENTRY = (
    "a relative path, which the loader opens from each process's working directory (a "
    "unit, container or worker started elsewhere preloads nothing)"
)


def relative(entry: str) -> bool:
    return "/" in entry and not os.path.isabs(entry) and "$" not in entry


def examine_entry(entry: str, kind: str | None, host: Host, trusted: frozenset[int]) -> Finding:
    """A caller's LD_PRELOAD entry, examined where the loader finds it, its name unjudged; a
    relative path is refused by the trust rule, with the LD_PRELOAD naming it absolutely."""
    if relative(entry):
        written = (p.path for p in host.preload)
        absolute = ":".join(os.path.abspath(p) if relative(p) else p for p in written)
        return Finding(RELATIVE_ENTRY, None, f"export LD_PRELOAD={quoted(absolute)}", unsafe=True)
    if "/" not in entry:  # a bare name, where the loader looks for it
        places = loader_places((entry,), host)
        resolved = next((p for _, paths in places for p in paths if os.path.isabs(p)), None)
    else:  # ld.so(8)'s dynamic string tokens expanded
        paths = [entry.replace("${PLATFORM}", host.machine).replace("$PLATFORM", host.machine)]
        if "$LIB" in entry or "${LIB}" in entry:
            # glibc's build's choice: Debian's lib/<multiarch>, Fedora's lib64, else lib.
            multiarch = MULTIARCH.get(host.machine)
            libs = (*((f"lib/{multiarch}",) if multiarch else ()), "lib64", "lib")
            paths = [p.replace("${LIB}", lib).replace("$LIB", lib) for p in paths for lib in libs]
        # The first that exists, else the first: examined, for the reason it does not load.
        resolved = os.path.abspath(next((p for p in paths if os.path.lexists(p)), paths[0]))
    if resolved is None:
        return Finding(NOT_FOUND_BY_LOADER)
    return examine(resolved, kind, host, trusted, as_written=False, named=True)


def candidate_of(
    kind: str, path: str, origin: Origin, host: Host, trusted: frozenset[int]
) -> Candidate:
    if origin == Origin.LD_PRELOAD:
        found = examine_entry(path, kind, host, trusted)
    else:
        found = examine(path, kind, host, trusted, named=origin == Origin.EXPLICIT)
    verdict = CandidateVerdict.REJECTED if found.reason else CandidateVerdict.USABLE
    reason = found.reason or "valid"
    return Candidate(kind, path, origin, verdict, reason, found.flavor, found.fix, found.unsafe)


@record
class Search:
    kind: str
    chosen: Candidate | None
    candidates: tuple[Candidate, ...]
    places: tuple[Origin, ...]  # the origins searched, for the 'not found' message


def find_library(
    kind: str,
    host: Host,
    target: Target | None,
    exhaustive: bool = False,
    explicit: str | None = None,
    trusted: frozenset[int] = frozenset(),
) -> Search:
    """The first place with a usable file wins, but Intel OpenMP anywhere wins over LLVM's;
    `exhaustive` (doctor) examines every place, `explicit` (--iomp-path) only that file."""
    if explicit is not None:
        given = candidate_of(kind, explicit, Origin.EXPLICIT, host, trusted)
        if given.verdict == CandidateVerdict.USABLE:
            given = replace(given, verdict=CandidateVerdict.CHOSEN, reason="given")
        taken = given if given.verdict == CandidateVerdict.CHOSEN else None
        return Search(kind, taken, (given,), (Origin.EXPLICIT,))
    seen: set[str] = set()
    candidates: list[Candidate] = []
    searched: list[Origin] = []
    chosen: Candidate | None = None
    llvm: Candidate | None = None  # the first stand-in (LLVM's), taken if no other is found
    for origin, paths in search_places(kind, host, target):
        searched.append(origin)
        for path in paths:
            normalized = os.path.normpath(path) if path else path
            if normalized not in seen:
                seen.add(normalized)
                candidates.append(candidate_of(kind, path, origin, host, trusted))
        here = (c for c in candidates if c.origin == origin)
        usable = (c for c in here if c.verdict == CandidateVerdict.USABLE)
        best = min(usable, key=lambda c: rank(by_word(c.flavor)), default=None)
        # The caller's own preloaded runtime is final, whatever its flavor (it is theirs).
        family = by_word(best.flavor) if best is not None else None
        if family is not None and family.stand_in and origin != Origin.LD_PRELOAD:
            llvm = llvm or best
        elif best is not None and chosen is None:
            chosen = best
            if not exhaustive:
                break
    winner = chosen or llvm
    if winner is not None:
        why = "first usable" if chosen else "first usable; no Intel OpenMP found, LLVM's"
        chosen = replace(winner, verdict=CandidateVerdict.CHOSEN, reason=why)
        candidates = [chosen if c is winner else c for c in candidates]
    return Search(kind, chosen, tuple(candidates), tuple(searched))

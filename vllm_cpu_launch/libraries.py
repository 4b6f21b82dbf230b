"""Find, validate and choose the libraries to preload: Intel OpenMP and tcmalloc.

Discovery only stats and reads known places, in the order of DESIGN.md; it never
scans the filesystem. Each place yields candidates lazily, so the usual case (the
library in the vLLM environment) stops after a handful of system calls.
"""

from __future__ import annotations

import os
import stat

from vllm_cpu_launch.records import record
from vllm_cpu_launch.target import python_user_base
from vllm_cpu_launch.trust import insecure_reason

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

    from vllm_cpu_launch.target import Target

IOMP = "iomp"
TCMALLOC = "tcmalloc"
IOMP_NAMES = ("libiomp5.so",)
TCMALLOC_NAMES = (
    "libtcmalloc_minimal.so.4",
    "libtcmalloc.so.4",
    "libtcmalloc_minimal.so",
    "libtcmalloc.so",
)
# vLLM recognises a preloaded library only by these substrings of LD_PRELOAD.
MARKER = {IOMP: "libiomp", TCMALLOC: "libtcmalloc"}
FLAVOR_MARKERS = ((b"Intel(R) OMP version", "intel"), (b"LLVM OMP version", "llvm"))
BANNER = b" OMP version"  # what both markers end with
FLAVOR_RANK = {"intel": 0, "llvm": 1, None: 2}
FLAVOR_SCAN_LIMIT = 64 << 20
PYTHON_MINORS = range(8, 20)  # Python 3.8 to 3.19: the versions a vLLM wheel may be built for

# ELF e_machine for each `uname -m`, and the Debian multiarch triplet.
ELF_MACHINES = {
    "x86_64": 62,
    "aarch64": 183,
    "ppc64le": 21,
    "s390x": 22,
    "riscv64": 243,
    "i686": 3,
    "i386": 3,
}
MULTIARCH = {
    "x86_64": "x86_64-linux-gnu",
    "aarch64": "aarch64-linux-gnu",
    "ppc64le": "powerpc64le-linux-gnu",
    "s390x": "s390x-linux-gnu",
    "riscv64": "riscv64-linux-gnu",
}
ELF_MACHINE_NAMES = {number: name for name, number in ELF_MACHINES.items()}
ELF_TYPE_SHARED = 3
LOADER_CACHE = "etc/ld.so.cache"
ONEAPI_ROOT = "opt/intel/oneapi"


@record
class Host:
    """What discovery needs to know of this process and machine."""

    environ: Mapping[str, str]
    machine: str  # os.uname().machine
    euid: int
    launcher_prefix: str  # sys.prefix of the launcher's own interpreter
    search_path: tuple[str, ...] = ()  # sys.path, for installed distributions
    # Where the system places (/usr/lib..., /opt/intel, /etc/ld.so.cache) are: "/" but
    # in tests, which lay out real Debian and oneAPI trees in a temporary directory.
    root: str = "/"


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


@record
class Place:
    """One step of the search order: where it looked and which files it proposes."""

    origin: str
    paths: tuple[str, ...]


# ---------------------------------------------------------------- validation


def elf_problem(header: bytes, machine: str) -> str | None:
    """Why an ELF header does not fit this machine, or None when it does."""
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return "not an ELF file"
    bits = {1: 32, 2: 64}.get(header[4])
    order = {1: "little", 2: "big"}.get(header[5])
    if bits is None or order is None:
        return "a corrupt ELF header"
    wanted_bits = 32 if machine in ("i686", "i386") else 64
    if bits != wanted_bits:
        return f"a {bits}-bit ELF file; this {machine} host needs {wanted_bits}-bit"
    elf_type = int.from_bytes(header[16:18], order)  # type: ignore[arg-type]
    elf_machine = int.from_bytes(header[18:20], order)  # type: ignore[arg-type]
    if elf_type != ELF_TYPE_SHARED:
        return f"an ELF file of type {elf_type}, not a shared object"
    wanted_machine = ELF_MACHINES.get(machine)
    if wanted_machine is not None and elf_machine != wanted_machine:
        built_for = ELF_MACHINE_NAMES.get(elf_machine, f"ELF machine {elf_machine}")
        return f"built for {built_for}; this host is {machine}"
    return None


PT_LOAD = 1


def elf_truncation(header: bytes, descriptor: int, size: int) -> str | None:
    """Why a fitting ELF file is cut short, or None when it is whole.

    Its header tables and every loadable segment must lie within the file: the loader
    maps them, and a truncated copy (an interrupted download or copy) is refused by the
    loader or dies of SIGBUS when the missing pages are touched. `header` is the ELF
    header (checked by elf_problem); the program headers are read from `descriptor`.
    """
    wide = header[4] == 2
    order = "little" if header[5] == 1 else "big"
    if len(header) < (64 if wide else 52):
        return f"a truncated ELF file ({size} bytes, shorter than its own header)"

    def number(data: bytes, offset: int, width: int) -> int:
        return int.from_bytes(data[offset : offset + width], order)  # type: ignore[arg-type]

    fields = (32, 40, 54, 56, 58, 60) if wide else (28, 32, 42, 44, 46, 48)
    widths = (8, 8, 2, 2, 2, 2) if wide else (4, 4, 2, 2, 2, 2)
    phoff, shoff, phentsize, phnum, shentsize, shnum = (
        number(header, o, w) for o, w in zip(fields, widths, strict=True)
    )
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if end <= size and phentsize:
        table = os.pread(descriptor, phentsize * phnum, phoff)
        for start in range(0, len(table) - phentsize + 1, phentsize):
            entry = table[start : start + phentsize]
            if number(entry, 0, 4) != PT_LOAD:
                continue
            if wide:
                offset, length = number(entry, 8, 8), number(entry, 32, 8)
            else:
                offset, length = number(entry, 4, 4), number(entry, 16, 4)
            end = max(end, offset + length)
    if end > size:
        return f"a truncated ELF file ({size} bytes; its headers and segments need {end})"
    return None


def openmp_flavor(descriptor: int) -> str | None:
    """Intel's or LLVM's OpenMP runtime, told apart by their embedded version banner.

    Searched in a read-only mapping (no copy of the file), in one pass for the text the
    banners share, up to FLAVOR_SCAN_LIMIT: the runtimes are 1-3 MB; a huge file is
    not scanned to its end.
    """
    import mmap  # 0.4 ms, only once a candidate has passed the cheaper checks

    longest = max(len(marker) for marker, _ in FLAVOR_MARKERS)
    with mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ) as mapped:
        position = mapped.find(BANNER, 0, FLAVOR_SCAN_LIMIT)
        while position >= 0:
            start = max(0, position + len(BANNER) - longest)
            around = mapped[start : position + len(BANNER)]
            for marker, flavor in FLAVOR_MARKERS:
                if around.endswith(marker):
                    return flavor
            position = mapped.find(BANNER, position + 1, FLAVOR_SCAN_LIMIT)
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
            return f"unsafe to preload: {unsafe[0]}", None, unsafe[1]
        # The version banner is looked for only once it is known to be a fitting ELF file.
        return None, (openmp_flavor(descriptor) if kind == IOMP else None), ""


# ---------------------------------------------------------------- places


def files_named(origin: str, directories: Iterable[str | None], names: tuple[str, ...]) -> Place:
    """The files with one of `names` that exist in `directories` (skipping unset ones)."""
    paths = [
        os.path.join(directory, name)
        for directory in directories
        if directory
        for name in names
        if os.path.lexists(os.path.join(directory, name))
    ]
    return Place(origin, tuple(paths))


def preload_entries(value: str) -> list[str]:
    """LD_PRELOAD's entries, split where glibc's loader splits them: spaces and colons.

    Tabs and other white space are part of an entry to the loader (rtld.c, " :").
    """
    return [entry for entry in value.replace(":", " ").split(" ") if entry]


def ld_preload_place(kind: str, host: Host) -> Place:
    entries = preload_entries(host.environ.get("LD_PRELOAD", ""))
    return Place("ld-preload", tuple(e for e in entries if MARKER[kind] in os.path.basename(e)))


def library_path_place(names: tuple[str, ...], host: Host) -> Place:
    """LD_LIBRARY_PATH entries; an empty or relative one is proposed only to be rejected."""
    value = host.environ.get("LD_LIBRARY_PATH", "")
    paths: list[str] = []
    for directory in value.split(":") if value else []:
        if os.path.isabs(directory):
            paths.extend(files_named("", [directory], names).paths)
        else:  # "" is the current directory to the loader
            paths.append(os.path.join(directory, names[0]) if directory else "")
    return Place("ld-library-path", tuple(paths))


def loader_cache_entries(cache_file: str, names: tuple[str, ...] = ()) -> list[str]:
    """Library paths listed in glibc's /etc/ld.so.cache (format 'glibc-ld.so.cache1.1').

    Read directly rather than through `ldconfig -p`: no child process on the exec path.
    """
    try:
        with open(cache_file, "rb") as stream:
            data = stream.read()
    except OSError:
        return []
    if names and not any(name.encode() in data for name in names):
        return []  # the usual case, decided without parsing hundreds of entries
    magic = b"glibc-ld.so.cache1.1"
    start = data.find(magic)  # after the old-format table on older systems
    if start < 0 or len(data) < start + 48:
        return []
    count = int.from_bytes(data[start + 20 : start + 24], "little")
    paths = []
    for index in range(count):
        entry = start + 48 + 24 * index
        if entry + 24 > len(data):
            break
        value = int.from_bytes(data[entry + 8 : entry + 12], "little")
        end = data.find(b"\0", start + value)
        if end > 0:
            paths.append(data[start + value : end].decode("utf-8", "surrogateescape"))
    return paths


def system_path(host: Host, path: str) -> str:
    """A system location under the host's root directory."""
    return os.path.join(host.root, path.lstrip("/"))


def loader_cache_place(names: tuple[str, ...], host: Host) -> Place:
    entries = loader_cache_entries(system_path(host, LOADER_CACHE), names)
    found = [system_path(host, p) for p in entries if os.path.basename(p) in names]
    return Place("loader-cache", tuple(dict.fromkeys(found)))


def version_key(name: str) -> tuple[int, ...]:
    """'2024.2' -> (2024, 2); names that are not versions sort first."""
    parts = name.split(".")
    return tuple(int(part) for part in parts) if all(p.isdigit() for p in parts) else ()


def oneapi_directories(host: Host) -> list[str | None]:
    """Where Intel oneAPI keeps libiomp5: 2024+ `compiler/X/lib`, older `intel64_lin`."""
    compiler_root = system_path(host, os.path.join(ONEAPI_ROOT, "compiler"))
    try:
        versions = [n for n in os.listdir(compiler_root) if version_key(n)]
    except OSError:
        versions = []
    newest = max(versions, key=version_key) if versions else None
    roots: list[str | None] = [
        host.environ.get("CMPLR_ROOT"),
        os.path.join(host.environ["ONEAPI_ROOT"], "compiler", "latest")
        if host.environ.get("ONEAPI_ROOT")
        else None,
        os.path.join(compiler_root, "latest"),
        os.path.join(compiler_root, newest) if newest else None,
    ]
    directories: list[str | None] = []
    for root in roots:
        if root:
            directories.append(os.path.join(root, "lib"))
            directories.append(os.path.join(root, "linux", "compiler", "lib", "intel64_lin"))
    return directories


def distribution_files(distribution: str, search_path: Iterable[str], name: str) -> list[str]:
    """Files called `name` that an installed distribution's RECORD lists.

    The RECORD is read directly: importlib.metadata costs more to import than the
    whole launcher, and this place is reached only when the earlier ones failed.
    """
    prefix = distribution.replace("-", "_") + "-"
    found = []
    for site in search_path:
        if not os.path.isabs(site):
            continue  # "" in sys.path is the working directory
        try:
            entries = os.listdir(site)
        except OSError:
            continue
        for entry in entries:
            if not (entry.startswith(prefix) and entry.endswith(".dist-info")):
                continue
            try:
                with open(os.path.join(site, entry, "RECORD"), encoding="utf-8") as stream:
                    for line in stream:
                        relative = line.split(",", 1)[0]
                        if os.path.basename(relative) == name:
                            found.append(os.path.normpath(os.path.join(site, relative)))
            except OSError:
                continue
    return found


def system_directories(host: Host) -> list[str | None]:
    """`/usr/local/lib*`, `/usr/lib/<multiarch>`, `/usr/lib64`, `/usr/lib`."""
    usr_local = system_path(host, "/usr/local")
    try:
        local = sorted(n for n in os.listdir(usr_local) if n.startswith("lib"))
    except OSError:
        local = []
    multiarch = MULTIARCH.get(host.machine)
    return [
        *(os.path.join(usr_local, n) for n in local),
        system_path(host, f"/usr/lib/{multiarch}") if multiarch else None,
        system_path(host, "/usr/lib64"),
        system_path(host, "/usr/lib"),
    ]


def lib_directory(prefix: str | None) -> str | None:
    return os.path.join(prefix, "lib") if prefix else None


def vllm_bundled_tcmalloc(prefix: str | None) -> list[str]:
    """Newer vLLM wheels bundle tcmalloc in `lib/python3.N/site-packages/vllm/libs/`.

    The Python versions are tried by name rather than found by listing `lib/`, which in
    a conda environment holds thousands of files.
    """
    if not prefix:
        return []
    found = []
    for minor in PYTHON_MINORS:
        libs = os.path.join(prefix, "lib", f"python3.{minor}", "site-packages", "vllm", "libs")
        try:
            found += [os.path.join(libs, n) for n in sorted(os.listdir(libs)) if "libtcmalloc" in n]
        except OSError:
            continue
    return found


def search_places(kind: str, host: Host, target: Target | None) -> Iterator[Place]:
    """The places to look, in DESIGN.md's order, each computed only when reached.

    The vLLM environment is its user base (for a `pip install --user` vLLM, where pip
    put intel-openmp too) and its prefix; later, the user base Python would use.
    """
    names = IOMP_NAMES if kind == IOMP else TCMALLOC_NAMES
    environ = host.environ
    target_prefix = target.prefix if target else None
    target_lib = [lib_directory(target.user_base if target else None), lib_directory(target_prefix)]
    user_lib = [lib_directory(python_user_base(environ))]
    steps: list[Callable[[], Place]] = [
        lambda: ld_preload_place(kind, host),
        lambda: files_named("vllm-environment", target_lib, names),
        lambda: files_named("launcher-environment", [lib_directory(host.launcher_prefix)], names),
        lambda: files_named("conda", [lib_directory(environ.get("CONDA_PREFIX"))], names),
        lambda: files_named("virtualenv", [lib_directory(environ.get("VIRTUAL_ENV"))], names),
    ]
    if kind == IOMP:
        steps += [
            lambda: Place(
                "intel-openmp-package",
                tuple(distribution_files("intel-openmp", host.search_path, names[0])),
            ),
            lambda: files_named("user-base", user_lib, names),
            lambda: files_named("oneapi", oneapi_directories(host), names),
        ]
    else:
        steps += [
            lambda: Place("vllm-bundled", tuple(vllm_bundled_tcmalloc(target_prefix))),
            lambda: files_named("user-base", user_lib, names),
        ]
    steps += [
        lambda: library_path_place(names, host),
        lambda: loader_cache_place(names, host),
        lambda: files_named("system", system_directories(host), names),
    ]
    for step in steps:
        yield step()


# ---------------------------------------------------------------- choice


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

    Within one place Intel's runtime is preferred over LLVM's. With `exhaustive`
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
        if usable and chosen is None:
            chosen = min(usable, key=lambda c: FLAVOR_RANK.get(c.flavor, 2))
            if not exhaustive:
                break
    if chosen is not None:
        winner = chosen
        chosen = Candidate(
            kind, winner.path, winner.origin, "chosen", "first usable", winner.flavor
        )
        candidates = [chosen if c is winner else c for c in candidates]
    return Search(kind, chosen, tuple(candidates), tuple(searched))

"""Whether a file the launcher relies on may be used: one trust rule, and the checks before
any read. A library is read for its ELF headers only, never loaded. As root, what the
launcher injects or runs may come only from a place that no user but root and the owner of
the vLLM started can change, its settings only from one that root alone can
(insecure_reason; docs/design.md, "Safety").
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

from vllm_cpu_launch.handoff import Kind, Library
from vllm_cpu_launch.runtimes import FAMILIES, GNU, by_name, by_soname
from vllm_cpu_launch.runtimes.family import Family

if TYPE_CHECKING:
    from collections.abc import Iterator

MAX_BYTES = 1 << 20  # a config file is a few lines; a larger one was named by mistake
KINDS = dict(d="a directory", p="a FIFO", c="a character device", b="a block device", s="a socket")


class FileProblem(OSError):
    """Why a file input is not read: one phrase, said after the file's name."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class Untrusted(FileProblem):
    """The trust rule's refusal of a file input, told apart from other problems by its type."""


def read_trusted(
    path: str, limit: int = MAX_BYTES, *, data: bool = False, what: str = "a config file"
) -> bytes:
    """The bytes of `path`, the one way every file input is read (docs/design.md, "Safety"):
    opened without blocking, a regular file of at most `limit` bytes (a FIFO would block, a
    device read forever; /dev/null is empty), else FileProblem; one the trust rule accepts,
    else Untrusted. `data`: a file vLLM reads wherever its command names it (a model's
    config.json) only chooses among outcomes built of trusted files: the rule does not apply.
    `what` the file is, as a message about its size says it."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        found = isinstance(error, FileNotFoundError)
        raise FileProblem("not found" if found else f"cannot be read ({error.strerror})") from None
    status = os.fstat(descriptor)
    if stat.S_ISREG(status.st_mode) and status.st_size <= limit:
        with os.fdopen(descriptor, "rb") as stream:
            refusal = None if data else untrusted(path)
            if refusal is not None:
                raise Untrusted(refusal)
            try:
                return stream.read(limit + 1)[:limit]
            except OSError as error:
                raise FileProblem(f"cannot be read ({error.strerror})") from None
    os.close(descriptor)
    if is_null_device(status):  # /dev/null, the usual "no file": empty, at once
        return b""
    if stat.S_ISREG(status.st_mode):
        raise FileProblem(f"is {status.st_size} bytes, over the {limit}-byte limit of {what}")
    kind = KINDS.get(stat.filemode(status.st_mode)[0], "no regular file")
    raise FileProblem(f"is {kind}, not a regular file")


def untrusted(path: str) -> str | None:
    """Why the trust rule refuses a settings file (with owner, mode and fix), or None: another
    user who could change what runs and is preloaded would choose for root (or for anyone)."""
    found = insecure_reason(os.path.abspath(path), os.geteuid())
    if found is None:
        return None
    why, fix = found
    reader = "as root, only settings no other user can change are read"
    if os.geteuid() != 0:
        reader = "settings everyone can change are not read"
    fixed = f"Fix: {fix}" if fix else "move it where only its owner can write"
    return f"not read: {why}; {reader}; {fixed}"


def is_null_device(status: os.stat_result) -> bool:
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(status.st_mode) and status.st_rdev == null.st_rdev


# What a library file is: its ELF headers

# The banner that follows it: `performance` (the runtime), `profile`, or `stub` (serial).
LIBRARY_TYPE = b" OMP library type: "
FLAVOR_SCAN_LIMIT = 64 << 20
# ELF e_machine for each `uname -m`; in a big-endian file the same numbers name others.
ELF_MACHINES = dict(x86_64=62, aarch64=183, ppc64le=21, s390x=22, riscv64=243, i686=3, i386=3)
ELF_MACHINE_NAMES = {number: name for name, number in ELF_MACHINES.items()}
BIG_ENDIAN_NAMES = {21: "ppc64", 183: "aarch64_be", 22: "s390x"}


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
    elf_type, elf_machine = elf_int(header, 16, 2, header), elf_int(header, 18, 2, header)
    names = BIG_ENDIAN_NAMES if order == "big" else ELF_MACHINE_NAMES
    built_for = names.get(elf_machine, f"ELF machine {elf_machine}")
    host_order = "big" if machine == "s390x" else "little"
    if order != host_order:
        return (
            f"a {order}-endian ELF file built for {built_for}; this {machine} host runs "
            f"{host_order}-endian ones"
        )
    if elf_type != 3:  # ET_DYN
        return f"an ELF file of type {elf_type}, not a shared object"
    wanted_machine = ELF_MACHINES.get(machine)
    if wanted_machine is not None and elf_machine != wanted_machine:
        return f"built for {built_for}; this host is {machine}"
    return None


def elf_int(data: bytes, offset: int, width: int, header: bytes) -> int:
    """An integer field of an ELF structure, in the file's byte order (the header's EI_DATA)."""
    order = "little" if header[5] == 1 else "big"
    return int.from_bytes(data[offset : offset + width], order)  # type: ignore[arg-type]


def elf_tables(header: bytes) -> list[int]:
    """e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize, e_shnum and e_shstrndx."""
    at, width = (32, 8) if header[4] == 2 else (28, 4)
    offsets = [elf_int(header, at + i * width, width, header) for i in (0, 1)]
    # The five 2-byte fields follow e_flags (4 bytes) and e_ehsize (2).
    return offsets + [elf_int(header, at + 2 * width + 6 + 2 * i, 2, header) for i in range(5)]


def elf_truncation(header: bytes, descriptor: int, size: int) -> str | None:
    """Why a fitting ELF file is cut short (an interrupted download or copy), or None. Its
    header tables and loadable segments must lie within it: the loader refuses it or dies
    of SIGBUS when the missing pages are touched."""
    wide = header[4] == 2
    if len(header) < (64 if wide else 52):
        return f"a truncated ELF file ({size} bytes, shorter than its own header)"
    phoff, shoff, phentsize, phnum, shentsize, shnum, _ = elf_tables(header)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    # p_offset and p_filesz at 8 and 32 (64-bit), 4 and 16 (32-bit).
    (at, length_at), width = ((8, 32), 8) if wide else ((4, 16), 4)
    if end <= size and phentsize:
        table = os.pread(descriptor, phentsize * phnum, phoff)
        for start in range(0, len(table) - phentsize + 1, phentsize):
            entry = table[start : start + phentsize]
            if elf_int(entry, 0, 4, header) == 1:  # PT_LOAD
                length = elf_int(entry, length_at, width, header)
                end = max(end, elf_int(entry, at, width, header) + length)
    if end > size:
        return f"a truncated ELF file ({size} bytes; its headers and segments need {end})"
    return None


def section_range(header: bytes, descriptor: int, name: bytes) -> tuple[int, int] | None:
    """(offset, end) of section `name` of an ELF file elf_truncation passed, or None."""
    wide = header[4] == 2
    _, shoff, _, _, shentsize, shnum, shstrndx = elf_tables(header)
    if not shoff or not shnum or shstrndx >= shnum or shentsize < (64 if wide else 40):
        return None
    table = os.pread(descriptor, shentsize * shnum, shoff)
    # sh_name at 0; sh_offset and sh_size at 24 and 32 (64-bit), 16 and 20 (32-bit).
    at, width = (24, 8) if wide else (16, 4)
    placed = []
    for index in range(shnum):
        entry = table[index * shentsize : (index + 1) * shentsize]
        start = elf_int(entry, at, width, header)
        end = start + elf_int(entry, at + width, width, header)
        placed.append((elf_int(entry, 0, 4, header), start, end))
    _, names_start, names_end = placed[shstrndx]
    names = os.pread(descriptor, min(names_end - names_start, 1 << 20), names_start)
    wanted = name + b"\0"
    found = [(start, end) for name_at, start, end in placed if names.startswith(wanted, name_at)]
    return found[0] if found else None


def openmp_runtime(descriptor: int, header: bytes) -> tuple[Family | None, str | None]:
    """(family, library type) of an OpenMP runtime, from the banners it embeds; (None,
    None): no runtime. Searched in a read-only mapping, first in `.rodata`, where the
    banners are constants (0.1 ms instead of 0.6 for libiomp5.so, whose banner lies 2 MB
    in), then the file up to FLAVOR_SCAN_LIMIT (the runtimes are 1-3 MB)."""
    import mmap  # lazy: 0.4 ms, only once a candidate has passed the cheaper checks

    rodata = section_range(header, descriptor, b".rodata")
    with mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ) as mapped:
        for start, end in ([rodata] if rodata else []) + [(0, FLAVOR_SCAN_LIMIT)]:
            banners = [f for f in FAMILIES if f.banner]
            found = [(mapped.find(f.banner, start, end), rank) for rank, f in enumerate(banners)]
            found = [pair for pair in found if pair[0] >= 0]
            if not found:
                continue
            flavor = banners[min(found)[1]]  # the first banner's
            position = mapped.find(LIBRARY_TYPE, start, end)
            if position < 0:
                return flavor, None
            begin = position + len(LIBRARY_TYPE)
            return flavor, mapped[begin : begin + 32].split(b"\0", 1)[0].decode("ascii", "replace")
    return None, None


# What a library is: what its ELF file says of itself, never its file's name

DT_HASH, DT_STRTAB, DT_SYMTAB, DT_SONAME, DT_GNU_HASH = 4, 5, 6, 14, 0x6FFFFEF5
SERVES = b"GOMP_parallel"  # what every OpenMP runtime defines: the first in scope serves
MAX_CHAIN = 1 << 16  # a hash chain longer than any library's: a corrupt file's, ended


def library_of(path: str) -> Kind:
    return identify(path)[0]


def identify(path: str) -> tuple[Kind, bool]:
    """(What the library at `path` is, whether it defines GOMP_parallel), from its ELF header
    and dynamic section: its DT_SONAME (runtimes.by_soname; LLVM's copies named libiomp5.so
    or libgomp.so.1 keep libomp.so; libtcmalloc, libjemalloc, libmimalloc), else a runtime if it
    defines GOMP_parallel, Intel's or LLVM's by its banner, else GNU's. A `-fopenmp` library
    only needs libgomp: another library. By the file's name (a directory's says nothing) only
    where no library of this host can be read: a bare name (the loader's to find), a missing,
    deleted or corrupt file, one not ELF or not this machine's (examine says why)."""
    named = kind_named(os.path.basename(path))
    if "/" not in path:  # a bare name, the loader's to find: no file in the working directory
        return named, named.runtime
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except (OSError, ValueError):  # ValueError: a NUL in the text, which names no file
        return named, named.runtime
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        return named, named.runtime
    with os.fdopen(descriptor, "rb") as stream:
        if elf_problem(header := stream.read(64), os.uname().machine):  # as the caller meant
            return named, named.runtime
        try:
            tags = dynamic_tags(descriptor, header)
            soname = soname_of(descriptor, header, tags)
            serves = defines(descriptor, header, tags, SERVES)
            kind = by_soname(soname)
            if kind is not None or not serves:
                return kind or kind_named(soname, runtimes=False), serves
            flavor, _ = openmp_runtime(descriptor, header)
        except (OSError, ValueError, OverflowError):  # a corrupt file: no dynamic section read
            return named, named.runtime
    return flavor or GNU, serves


def soname_of(descriptor: int, header: bytes, tags: dict[int, int] | None = None) -> str:
    """The library's DT_SONAME ("" where it has none)."""
    tags = dynamic_tags(descriptor, header) if tags is None else tags
    if DT_SONAME not in tags or DT_STRTAB not in tags:
        return ""
    return c_string(descriptor, tags[DT_STRTAB] + tags[DT_SONAME], 256)


def kind_named(name: str, runtimes: bool = True) -> Kind:
    """A library by a name: a runtime family's (`runtimes`), an allocator's, or another's."""
    family = by_name(name) if runtimes else None
    if family is not None:
        return family
    if "libtcmalloc" in name:
        return Library.TCMALLOC
    return Library.MALLOC if "libjemalloc" in name or "libmimalloc" in name else Library.OTHER


def c_string(descriptor: int, at: int, limit: int) -> str:
    return os.pread(descriptor, limit, at).partition(b"\0")[0].decode("utf-8", "replace")


def dynamic_tags(descriptor: int, header: bytes) -> dict[int, int]:
    """The first value of each DT_* above in the dynamic section (PT_DYNAMIC), its addresses
    made file offsets through the PT_LOAD segments (DT_SONAME's is one in DT_STRTAB)."""
    wide = header[4] == 2
    width = 8 if wide else 4
    phoff, _, phentsize, phnum = elf_tables(header)[:4]
    table = os.pread(descriptor, phentsize * phnum, phoff) if phentsize else b""
    loads, dynamic = [], (0, 0)
    for start in range(0, len(table) - phentsize + 1, phentsize or 1):
        entry = table[start : start + phentsize]
        # p_offset, p_vaddr and p_filesz at 8, 16 and 32 (64-bit), 4, 8 and 16 (32-bit).
        offset, address, size = (
            elf_int(entry, at, width, header) for at in (width, 2 * width, 4 * width)
        )
        kind = elf_int(entry, 0, 4, header)
        loads += [(address, offset, size)] if kind == 1 else []  # PT_LOAD
        dynamic = (offset, size) if kind == 2 else dynamic  # PT_DYNAMIC
    data = os.pread(descriptor, min(dynamic[1], 1 << 16), dynamic[0])
    found: dict[int, int] = {}
    for start in range(0, len(data) - 2 * width + 1, 2 * width):
        tag = elf_int(data, start, width, header)
        if tag == 0:  # DT_NULL
            break
        if tag in (DT_HASH, DT_STRTAB, DT_SYMTAB, DT_SONAME, DT_GNU_HASH):
            found.setdefault(tag, elf_int(data, start + width, width, header))
    placed = {
        tag: value
        if tag == DT_SONAME
        else next((value - a + o for a, o, s in loads if a <= value < a + s), None)
        for tag, value in found.items()
    }
    return {tag: value for tag, value in placed.items() if value is not None}


def defines(descriptor: int, header: bytes, tags: dict[int, int], name: bytes) -> bool:
    """Whether the dynamic symbol table defines `name` (any version), looked up as the loader
    looks it up. A reference (SHN_UNDEF, 0) defines nothing."""
    if DT_SYMTAB not in tags or DT_STRTAB not in tags:
        return False
    size, section_at = (24, 6) if header[4] == 2 else (16, 14)  # Elf_Sym, its st_shndx
    wanted = name + b"\0"
    for index in hash_chain(descriptor, header, tags, name):
        symbol = os.pread(descriptor, size, tags[DT_SYMTAB] + index * size)
        at = tags[DT_STRTAB] + elf_int(symbol, 0, 4, header)
        if (
            elf_int(symbol, section_at, 2, header)
            and os.pread(descriptor, len(wanted), at) == wanted
        ):
            return True
    return False


def hash_chain(descriptor: int, header: bytes, tags: dict[int, int], name: bytes) -> Iterator[int]:
    """The indexes of the symbols that may be `name`: its chain in DT_GNU_HASH, else DT_HASH."""

    def word(at: int) -> int:
        return elf_int(os.pread(descriptor, 4, at), 0, 4, header)

    digest = 5381
    if DT_GNU_HASH in tags:
        table = tags[DT_GNU_HASH]
        buckets, first, blooms = (word(table + 4 * i) for i in range(3))
        for byte in name:
            digest = (digest * 33 + byte) & 0xFFFFFFFF
        start = table + 16 + blooms * (8 if header[4] == 2 else 4)
        bucket = word(start + 4 * (digest % buckets)) if buckets else 0
        for index in range(bucket, bucket + MAX_CHAIN) if bucket >= max(first, 1) else ():
            value = word(start + 4 * (buckets + index - first))
            if value | 1 == digest | 1:
                yield index
            if value & 1:
                return
    elif DT_HASH in tags:
        table, digest = tags[DT_HASH], 0
        for byte in name:
            digest = ((digest << 4) + byte) & 0xFFFFFFFF
            digest = (digest ^ (digest >> 24) & 0xF0) & 0x0FFFFFFF
        buckets, chains = word(table), word(table + 4)
        index = word(table + 8 + 4 * (digest % buckets)) if buckets else 0
        for _ in range(min(chains, MAX_CHAIN)) if index else ():
            yield index
            index = word(table + 8 + 4 * (buckets + index))
            if not index:
                return


# The trust rule

MAX_LINK_HOPS = 40  # the kernel's own limit before ELOOP
MOVE = "move"  # the fix for a file in a shared, sticky directory: moved out (moved_out)


def unsafe_owner_or_mode(
    status: os.stat_result, euid: int, is_file: bool, trusted: frozenset[int] = frozenset()
) -> tuple[str, str] | None:
    """(why, which chmod/chown) when a file or directory lets an untrusted user change what
    runs, or None. As root: owned by root or a `trusted` uid (the owner of the vLLM started,
    whose code root runs anyway), writable by neither group nor others. As another user: not
    writable by all. A sticky directory (/tmp) is fine above the file's own directory."""
    as_root = euid == 0
    if as_root and status.st_uid != 0 and status.st_uid not in trusted:
        whose = "neither root nor the owner of the vLLM being started" if trusted else "not root"
        return f"owned by uid {status.st_uid}, {whose}", "chown root"
    mask = (stat.S_IWGRP | stat.S_IWOTH) if as_root else stat.S_IWOTH
    sticky = bool(status.st_mode & stat.S_ISVTX)
    if not status.st_mode & mask or (sticky and not is_file):
        return None
    who = "others" if status.st_mode & stat.S_IWOTH else "its group"
    # A sticky directory (/tmp, /dev/shm) is meant to be shared: chmod would break it for
    # everyone, so the file moves out of it instead (insecure_reason).
    return f"writable by {who}", MOVE if sticky else "chmod go-w" if as_root else "chmod o-w"


def lookup_steps(path: str) -> tuple[list[str], list[str], str]:
    """(directories searched, links followed, file reached) on the way to `path`, resolved as
    the kernel does: a directory that only an intermediate symbolic link passes is seen too."""
    directories: dict[str, None] = {}
    links: list[str] = []
    current = "/"
    pending = [part for part in path.split("/") if part]
    while pending:
        name = pending.pop(0)
        if name in (".", ".."):
            current = os.path.dirname(current) if name == ".." else current
            continue
        directories[current] = None
        candidate = os.path.join(current, name)
        if not os.path.islink(candidate):
            current = candidate
            continue
        if len(links) >= MAX_LINK_HOPS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links")
        links.append(candidate)
        target = os.readlink(candidate)
        current = "/" if target.startswith("/") else current
        pending[:0] = [part for part in target.split("/") if part]
    return list(directories), links, current


def insecure_reason(
    path: str, euid: int, trusted: frozenset[int] = frozenset(), named: bool = False
) -> tuple[str, str] | None:
    """(why, fix) when an untrusted user could swap `path`, a link or directory on the way
    to it (unsafe_owner_or_mode). The fix removes the one problem found (several: ""); a
    file in a shared sticky directory is moved out where the user `named` it."""
    problems: list[tuple[str, str]] = []
    try:
        directories, links, real = lookup_steps(path)
        status = os.stat(real)
        problem = None if read_only(real) else unsafe_owner_or_mode(status, euid, True, trusted)
        if problem:
            why = f"{real} is {problem[0]} ({owner_and_mode(status)})"
            problems.append((why, f"{problem[1]} {quoted(real)}"))
        for link in links:  # a link's own mode means nothing; who may replace it does
            owner = os.lstat(link).st_uid
            if euid == 0 and owner != 0 and owner not in trusted and not read_only(link, False):
                why = f"symbolic link {link} is owned by uid {owner}, not root"
                problems.append((why, f"chown -h root {quoted(link)}"))
        home = os.path.dirname(real)
        for directory in directories:
            if read_only(directory):
                continue
            status = os.stat(directory)
            problem = unsafe_owner_or_mode(status, euid, directory == home, trusted)
            if problem:
                moved = moved_out(real) if named else ""
                fix = moved if problem[1] == MOVE else f"{problem[1]} {quoted(directory)}"
                why = f"directory {directory} is {problem[0]} ({owner_and_mode(status)})"
                problems.append((why, fix))
    except OSError as error:
        return f"cannot check its permissions: {error.strerror}", ""
    if len(problems) > 1:
        return f"{problems[0][0]} (and {len(problems) - 1} more)", ""
    return problems[0] if problems else None


def owner_and_mode(status: os.stat_result) -> str:
    return f"owner uid {status.st_uid}, mode {stat.filemode(status.st_mode)}"


def read_only(path: str, follow: bool = True) -> bool:
    """Whether `path` (a link: its directory) lies on a read-only mount, whose mode bits mean
    nothing: no user can change a Kubernetes ConfigMap volume, mode 0777."""
    try:
        where = path if follow else os.path.dirname(path) or "/"
        return bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def moved_out(path: str) -> str:
    """The file moved from its shared, sticky directory into a new one beside it that only
    its owner can write, and its new path. `mkdir` fails on a directory someone made first."""
    name = os.path.basename(path)
    stem = name.split(".")[0]
    directory = os.path.join(os.path.dirname(path), stem if stem not in ("", name) else f"{name}.d")
    new = os.path.join(directory, name)
    return (
        f"mkdir -m 755 {quoted(directory)} && mv {quoted(path)} {quoted(new)}  (then name it {new})"
    )


def quoted(path: str) -> str:
    import shlex  # lazy: only once a problem is found: it imports `re`, too dear for the exec path

    return shlex.quote(path)


def owners(paths: tuple[str, ...]) -> frozenset[int]:
    """The uids owning these files (after links): whoever owns the program root runs."""
    found = set()
    for path in paths:
        try:
            found.add(os.stat(path).st_uid)
        except OSError:
            continue
    return frozenset(found)

"""What a library file says of itself, read from its ELF headers, never loaded: its machine,
its DT_SONAME, whether it defines GOMP_parallel (an OpenMP runtime serves), the banner that
tells Intel's runtime from LLVM's; and so what it is (`identify`, `library_of`), by the
runtime families (runtimes/) or as an allocator or other library.
"""

from __future__ import annotations

import enum
import os
import stat
from typing import TYPE_CHECKING

from vllm_cpu_launch.runtimes import FAMILIES, GNU, by_kind, by_name, by_soname
from vllm_cpu_launch.runtimes.family import Family

if TYPE_CHECKING:
    from collections.abc import Iterator


class Library(enum.Enum):
    """What a library is that is no OpenMP runtime (those are runtimes.family.Family's); the value
    is its kind in verify's and doctor's JSON."""

    TCMALLOC = "tcmalloc"  # gperftools' tcmalloc (libtcmalloc, libtcmalloc_minimal)
    MALLOC = "malloc"  # another malloc: jemalloc, mimalloc
    OTHER = "other"

    @property
    def runtime(self) -> bool:
        return False

    kmp = runtime

    @property
    def allocator(self) -> bool:
        return self is not Library.OTHER

    @property
    def title(self) -> str:
        titles = {"tcmalloc": "tcmalloc", "malloc": "another malloc"}
        return titles.get(self.value, "another library")


Kind = Family | Library  # what a library is (elf.library_of)


def kind_of(value: str) -> Kind:
    """A library's kind from its word in the JSON (a runtime family's, or a Library's)."""
    return by_kind(value) or Library(value)


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

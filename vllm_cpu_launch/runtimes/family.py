"""What an OpenMP runtime family is (runtimes/__init__.py holds the registry): each family's
module (gnu, intel, llvm) says its facts as a subclass."""

from __future__ import annotations

from typing import ClassVar


class Family:
    """An OpenMP runtime family: a library's kind where it is one (elf.identify)."""

    value: ClassVar[str]  # the library's kind in the JSON of verify and doctor (Library's too)
    word: ClassVar[str]  # its flavour: the plan's and doctor's word, and /metrics' (inside.py)
    title: ClassVar[str]
    sonames: ClassVar[tuple[str, ...]] = ()  # DT_SONAME less `.so...` and a wheel's `-HASH`
    prefixes: ClassVar[tuple[str, ...]] = ()  # its files' names: only where no ELF is read
    banner: ClassVar[bytes] = b""  # the 'OMP version' banner it embeds (b"": none)
    kmp: ClassVar[bool] = False  # Intel's interface (KMP_* variables, KMP_BLOCKTIME planned)
    # The texts of LD_PRELOAD by which vLLM takes a runtime for this one (use_iomp, use_gomp
    # in vllm/utils/ompmultiprocessing.py): a directory's name counts, as vLLM tests.
    vllm_names: ClassVar[tuple[str, ...]] = ()
    files: ClassVar[tuple[str, ...]] = ()  # the names the plan's search looks for
    wheel: ClassVar[str] = ""  # the pip distribution that holds it: searched, and its fix
    machines: ClassVar[tuple[str, ...]] = ()  # where the plan preloads it for SD unasked
    opt_in: ClassVar[tuple[str, ...]] = ()  # where only `--iomp always` preloads it
    stand_in: ClassVar[bool] = False  # taken only where no other is found, by a rule
    runtime: ClassVar[bool] = True
    allocator: ClassVar[bool] = False

    def named(self, name: str) -> bool:
        """Whether a file's name is this family's, where no ELF file of it can be read."""
        return name.startswith(self.prefixes)

    def __repr__(self) -> str:
        return f"<runtime family {self.value}>"

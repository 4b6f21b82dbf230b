"""GNU's OpenMP runtime, libgomp: torch's (renamed libgomp-HASH.so.1), the system's."""

from __future__ import annotations

from vllm_cpu_launch.runtimes.family import Family


class GNU(Family):
    value, word, title = "gomp", "gnu", "GNU libgomp"
    sonames = prefixes = ("libgomp",)
    vllm_names = ("libgomp",)


FAMILY: Family = GNU()

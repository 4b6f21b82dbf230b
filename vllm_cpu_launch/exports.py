"""Placeholder until its issue lands."""

from __future__ import annotations

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError


def main(values: dict[str, object], args: list[str]) -> int:
    raise LaunchError(EXIT_USAGE, "exports is not available yet")

#!/usr/bin/env python3
"""The shapes map's headline (issue 46): each host shape's settings against plain vLLM.

Reads the runs `scripts/bench_vllm.py --shape SHAPE --json` kept under a directory
(docs/bench_vllm_shapes/: `screen-SHAPE.json`, one round of every setting, and
`confirm-SHAPE.json`, 4 rounds of plain vLLM, the plan's setting and the screen's best) and
prints one Markdown table: per shape and setting, the TPOT of plain vLLM over the
setting's, paired by round, at each concurrency (`median (min-max)`, `gain`/`loss` where
4 or more rounds agree), from the confirmation where one ran, else the screen.
`--markdown FILE` puts it between `<!-- bench_vllm shapes: begin/end -->` in FILE.

    python scripts/bench_vllm_shapes.py docs/bench_vllm_shapes --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench_vllm_records import Run, runs_from_json
from bench_vllm_report import speedup, update_markdown

MARKERS = "bench_vllm shapes"
PLAIN = "libgomp"  # plain vLLM as installed: its worker bound by vLLM
KINDS = ("confirm", "screen")  # a confirmation's rounds stand for its settings


def by_setting(path: Path) -> tuple[dict[str, list[Run]], list[int], str]:
    data = json.loads(path.read_text(encoding="utf-8"))
    runs: dict[str, list[Run]] = {}
    for run in runs_from_json(data):
        runs.setdefault(run.config.setting, []).append(run)
    return runs, data["meta"]["concurrency"], data["meta"]["shape"]


def rows(directory: Path) -> list[str]:
    """The table's rows: each shape (in the order below, where kept), each setting."""
    lines: list[str] = []
    for shape in ("tenants-1", "tenants-2", "quota-1.0", "quota-1.5", "cpuset-1"):
        kept = {kind: directory / f"{kind}-{shape}.json" for kind in KINDS}
        found = {kind: by_setting(path) for kind, path in kept.items() if path.is_file()}
        if not found:
            continue
        settings: dict[str, tuple[str, list[Run], list[Run], list[int]]] = {}
        for kind in reversed(KINDS):  # the screen first, the confirmation over it
            if kind in found:
                runs, levels, said = found[kind]
                for key, group in runs.items():
                    settings[key] = (kind, group, runs[PLAIN], levels)
        first = True
        for key, (kind, group, plain, levels) in settings.items():
            if key == PLAIN:
                continue
            cells = [str(speedup(group, plain, level, "tpot")) for level in levels]
            where = f"**{shape}**: {said.split(': ', 1)[1]}" if first else ""
            lines.append(f"| {where} | `{key}` | {kind}, {len(group)} | {' | '.join(cells)} |")
            first = False
    return lines


def table(directory: Path) -> str:
    return "\n".join(
        [
            "| shape | setting | run, rounds | TPOT plain/this at 1 request | at 4 requests |",
            "|---|---|---|---|---|",
            *rows(directory),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("directory", type=Path, help="where the shaped runs are kept")
    parser.add_argument("--markdown", type=Path, help="also write the table into this file")
    args = parser.parse_args(argv)
    text = table(args.directory)
    print(text)
    if args.markdown is not None:
        update_markdown(args.markdown, text + "\n", MARKERS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

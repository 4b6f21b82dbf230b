#!/usr/bin/env python3
"""The shapes map's headline (issue 46): each host shape's settings against plain vLLM.

Reads the runs `scripts/bench_vllm.py --shape SHAPE --json` kept under a directory
(docs/bench_vllm_shapes/: `screen-SHAPE.json`, one round of every setting, and
`confirm-SHAPE.json`, 4 rounds of plain vLLM, the plan's setting and the screen's best;
`confirm2-SHAPE.json`, 4 more of plain vLLM and vLLM's binding with the launcher's block
time at 5 and 0 ms, which reaches only the API server and engine core; `confirm3-SHAPE.json`,
those again beside plain vLLM paired with itself, `libgomp-again`) and prints one
Markdown table: per shape, run and setting, the TPOT of plain vLLM over the setting's,
paired by round, at each concurrency (`median (min-max)`, `gain`/`loss` where 4 or more
rounds agree): every confirmation's settings, then the screen's that none confirmed.
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
CONFIRMATIONS = ("confirm", "confirm2", "confirm3")  # their rounds stand for their settings
SCREEN = "screen"


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
        kept = {kind: directory / f"{kind}-{shape}.json" for kind in (*CONFIRMATIONS, SCREEN)}
        found = {kind: by_setting(path) for kind, path in kept.items() if path.is_file()}
        if not found:
            continue
        confirmed = {key for kind in CONFIRMATIONS if kind in found for key in found[kind][0]}
        shown = [
            (kind, key, group, runs[PLAIN], levels)
            for kind, (runs, levels, said) in found.items()
            for key, group in runs.items()
            if key != PLAIN and (kind != SCREEN or key not in confirmed)
        ]
        said = next(iter(found.values()))[2]
        first = True
        for kind, key, group, plain, levels in shown:
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

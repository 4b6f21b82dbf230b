"""Smoke tests of the benchmark scripts: each runs in a tiny mode and prints its ratio lines.

Timings depend on the host and on whatever else runs there, so no speed is asserted:
only that the scripts complete, compare their configurations and report the ratios.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


def run_script(name: str, *arguments: str, limit_s: float = 600) -> str:
    """Run scripts/NAME with this interpreter; its stdout, after checking it succeeded."""
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *arguments],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=limit_s,
        cwd=REPO,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed.stdout


def load_script(name: str) -> ModuleType:
    """Import a script as a module, for its pure helpers."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))  # where a script finds its sibling modules when run
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


@pytest.mark.bench
def test_bench_overhead_prints_its_ratios() -> None:
    if not (Path(sys.prefix) / "bin" / "vllm-cpu-launch").exists():
        pytest.skip(f"no vllm-cpu-launch console script in {sys.prefix}")
    output = run_script(
        "bench_overhead.py", "--rounds", "1", "--venv", sys.prefix, "--torch-python", "none"
    )
    assert "ratio a/b (launcher / bare python exec):" in output
    assert "target a/b <= 1.25:" in output
    assert "ratio c/a (torch run_cpu / launcher): skipped:" in output
    assert "ratio a_c/b" in output and "ratio a_dot/b" in output
    assert "imported on the exec path: psutil " in output
    assert "rerun: " in output


@pytest.mark.bench
def test_bench_discovery_prints_its_ratios() -> None:
    output = run_script(
        "bench_discovery.py",
        "--rounds",
        "1",
        "--dirs",
        "5",
        "--files",
        "300",
        "--find-timeout",
        "60",
    )
    for key in ("wide", "bigpath", "biglib", "usual", "find"):
        line = f"ratio {key}/base"
        assert line in output
    assert "strace" in output  # the syscall table, or the reason it was skipped


@pytest.mark.real_vllm
def test_bench_vllm_maps_and_redraws(tmp_path: Path, debian_root: Path) -> None:
    # Starts three real vLLM servers (minutes): it belongs with the real-vLLM e2e tests.
    report, kept, picture = tmp_path / "report.md", tmp_path / "map.json", tmp_path / "map.png"
    report.write_text("# Benchmarks\n\nkept\n", encoding="utf-8")
    tcmalloc = debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    arguments = ["--rounds", "1", "--models", "tiny", "--threads", "default"]
    settings = "libgomp,libiomp5+tcmalloc,libiomp5-nobind-bt200+tcmalloc"
    arguments += ["--settings", settings, "--tcmalloc-path", str(tcmalloc)]
    arguments += ["--concurrency", "1,2", "--phase-seconds", "1", "--max-tokens", "4"]
    output = run_script(
        "bench_vllm.py",
        *arguments,
        *("--markdown", str(report), "--json", str(kept), "--plot", str(picture)),
        limit_s=2400,
    )
    # The tiny model gets ngram alone; the worker really mapped what each setting preloads,
    # and the ratio rows compare them with plain vLLM and with the Docker image's recipe.
    assert "### Model `tiny`, method `ngram3`" in output
    assert "| default ([0]) | libgomp | libgomp |" in output
    assert "| default ([0]) | libiomp5+tcmalloc | libiomp5 + tcmalloc |" in output
    assert "| nobind (unbound) | libiomp5-nobind-bt200+tcmalloc | libiomp5 + tcmalloc |" in output
    assert "| default | libiomp5+tcmalloc | default/libgomp | " in output
    assert "| nobind | libiomp5-nobind-bt200+tcmalloc | default/libiomp5+tcmalloc | " in output
    written = report.read_text(encoding="utf-8")
    assert written.startswith("# Benchmarks\n\nkept\n")
    body = output.split("rerun:")[0]
    assert body.strip() in written
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # The kept measurements redraw the same report without starting vLLM, but for the INFO
    # lines: those were the launcher's of that run, and a redraw does not pass them as today's.
    ran, infos = output.split("The launcher's INFO lines:\n")
    assert "- `vllm-cpu-launch: --iomp always; " in infos
    redrawn = run_script("bench_vllm.py", "--from-json", str(kept), "--plot", str(picture))
    again, today = redrawn.split("The launcher's INFO lines are listed by a run, not by a redraw")
    assert again == ran and "vllm-cpu-launch: --iomp" not in today


def test_markdown_section_is_replaced_in_place(tmp_path: Path) -> None:
    report = load_script("bench_vllm_report.py")
    path = tmp_path / "benchmarks.md"
    path.write_text("# Title\n\nbefore\n", encoding="utf-8")
    report.update_markdown(path, "first\n")
    report.update_markdown(path, "other map\n", "bench_vllm methods")
    report.update_markdown(path, "second\n")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# Title\n\nbefore\n")
    assert "second" in text and "first" not in text and "other map" in text
    assert text.count("<!-- bench_vllm: begin -->") == 1


def test_methods_ask_vllm_for_what_they_name() -> None:
    records = load_script("bench_vllm_records.py")
    server = load_script("vllm_server.py")
    # The map's runs before methods were a dimension: the same request, so they stay comparable.
    assert records.METHODS[records.FIRST_METHOD].speculative_config("") == server.SPECULATIVE_CONFIG
    config = json.loads(records.METHODS["draft7"].speculative_config("/models/tiny"))
    assert config == {"method": "draft_model", "model": "/models/tiny", "num_speculative_tokens": 7}


def test_draft_methods_draft_only_for_a_larger_model() -> None:
    records = load_script("bench_vllm_records.py")
    methods = ["ngram3", "draft3", "eagle-3"]
    configs = records.grid(["tiny", "100m"], methods, ["default"], ["libgomp"])
    assert [(c.model, c.method) for c in configs] == [
        ("tiny", "ngram3"),
        ("100m", "ngram3"),
        ("100m", "draft3"),
        ("100m", "eagle-3"),
    ]
    assert records.baseline_of(configs[-1]).method == "eagle-3"  # paired within a method
    # The draft model is the tiny one; an EAGLE head is made for its target.
    assert records.METHODS["draft3"].draft_for("100m").options() == ["--size", "tiny"]
    eagle = records.METHODS["eagle-3"].draft_for("100m")
    assert eagle.options() == ["--size", "100m", "--eagle-head"] and eagle.key == "100m-eagle-head"


def test_runs_kept_without_a_method_read_as_ngram3() -> None:
    records = load_script("bench_vllm_records.py")
    kept = json.loads((REPO / "docs" / "bench_vllm_map.json").read_text(encoding="utf-8"))
    run = kept["runs"][0]
    run["config"].pop("method", None)  # as the runs of 2026-12-01 were kept
    (read,) = records.runs_from_json({"runs": [run]})
    assert read.config.method == "ngram3"


def test_a_comparison_with_nothing_measured_is_left_out() -> None:
    records, report = load_script("bench_vllm_records.py"), load_script("bench_vllm_report.py")
    kept = json.loads((REPO / "docs" / "bench_vllm_map.json").read_text(encoding="utf-8"))
    runs = records.runs_from_json(kept)
    by_config = {run.config: [r for r in runs if r.config == run.config] for run in runs}
    measured = next(iter(by_config))
    missing = records.Config("100m", "draft7", "default", "libgomp")
    assert report.comparison("title", [(measured, missing)], by_config, [1]) == []
    table = report.comparison("title", [(measured, measured)], by_config, [1])
    assert table[:3] == ["", "title", ""] and table[-1].startswith(f"| {measured.threads} |")


def test_a_verdict_needs_four_rounds_that_agree() -> None:
    report = load_script("bench_vllm_report.py")
    assert report.Ratio(1.2, 1.1, 1.3, 4).verdict == "gain"
    assert report.Ratio(0.8, 0.7, 0.9, 4).verdict == "loss"
    assert report.Ratio(1.2, 0.9, 1.3, 4).verdict == "="
    assert report.Ratio(1.2, 1.2, 1.2, 1).verdict == "="  # one round agrees with itself


def test_importtime_lines_are_parsed() -> None:
    bench_overhead = load_script("bench_overhead.py")
    stderr = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:       100 |        100 |   enum\n"
        "import time:       300 |        400 | re\n"
        "unrelated line\n"
    )
    assert bench_overhead.parse_importtime(stderr) == [("enum", 100, 100, 1), ("re", 300, 400, 0)]


@pytest.mark.real_vllm
def test_bench_plugin_times_each_kind_of_vllm_process(tmp_path: Path) -> None:
    # Imports the real vLLM twice (a minute): it belongs with the real-vLLM e2e tests.
    kept = tmp_path / "samples.json"
    output = run_script("bench_plugin.py", "--rounds", "1", "--json", str(kept), limit_s=1200)
    samples = json.loads(kept.read_text(encoding="utf-8"))
    assert set(samples) == {"front-end", "engine-or-worker"}
    assert set(samples["front-end"][0]) == {"vllm", "load", "register", "hook", "LD_PRELOAD"}
    assert "libiomp5" in samples["front-end"][0]["LD_PRELOAD"]  # the hook planned, for real
    for role in samples:
        assert f"ratio plugin-{role} (plugin / import vllm, {role}, median of 1" in output
    assert "rerun: cd " in output and "bench_plugin.py --rounds 1" in output

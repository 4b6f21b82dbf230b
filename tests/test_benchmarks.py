"""Smoke tests of the benchmark scripts: each runs in a tiny mode and prints its ratio lines.

Timings depend on the host and on whatever else runs there, so no speed is asserted:
only that the scripts complete, compare their configurations and report the ratios.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import clean_environ, read_record, run_launcher

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
        "bench_overhead.py",
        *("--rounds", "1", "--venv", sys.prefix, "--torch-python", "none"),
        *("--baseline", str(REPO)),
    )
    assert "ratio a/b (launcher / bare python exec):" in output
    assert "target a/w_pip <= 2.0:" in output
    assert "ratio a/a_base (this launcher / --baseline's (both behind pip)):" in output
    assert "ratio c/a (torch run_cpu / launcher): skipped:" in output
    assert "ratio a_c/b" in output and "ratio a_dot/b" in output
    assert "ratio a_watch/a (an SD start that watches its CPUs / one told own):" in output
    assert "the watch at start adds " in output
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


def test_the_discovery_benchmarks_find_reads_any_file_name(tmp_path: Path) -> None:
    """find prints whatever names a host holds: one with the byte 0xff (any user may make
    one under /) is read back as os.fsdecode reads it, never a UnicodeDecodeError (the bench
    tier's run above failed so on such a host). Here find searches only what the test made."""
    discovery = load_script("bench_discovery.py")
    odd = os.fsencode(tmp_path / "lib") + b"\xff"
    os.mkdir(odd)
    os.close(os.open(odd + b"/libiomp5.so", os.O_CREAT | os.O_WRONLY, 0o644))
    command = discovery.find_command(str(tmp_path))
    code, out, err, _wall, killed = discovery.run_watched(command, 60, None, tmp_path)
    assert (code, err, killed) == (0, "", False)
    assert [os.fsencode(line) for line in out.splitlines()] == [odd + b"/libiomp5.so"]
    # The step the benchmark times: it finished (60, the bound, is what a killed find reads).
    assert discovery.run_find(str(tmp_path), 60, tmp_path) < 60


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
    arguments += ["--no-warm-up"]  # the first of the three starts compiles: one start fewer
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


def test_real_drafts_draft_only_for_the_real_model() -> None:
    """The self-draft is the target's own directory, the shallow draft --real-draft's; the
    made drafts never draft for the real model (another tokenizer), nor the real ones for a
    made model."""
    records = load_script("bench_vllm_records.py")
    methods = ["ngram3", "draft7", "self7", "shallow3"]
    configs = records.grid(["100m", records.REAL], methods, ["default"], ["libgomp"])
    assert [(c.model, c.method) for c in configs] == [
        ("100m", "ngram3"),
        ("100m", "draft7"),
        (records.REAL, "ngram3"),
        (records.REAL, "self7"),
        (records.REAL, "shallow3"),
    ]
    assert records.METHODS["self7"].draft_key(records.REAL) == records.REAL
    assert records.METHODS["shallow3"].draft_key(records.REAL) == records.SHALLOW_DRAFT
    assert records.METHODS["draft7"].draft_key("100m") == "tiny"
    assert records.METHODS["ngram3"].draft_key(records.REAL) is None
    config = json.loads(records.METHODS["self3"].speculative_config("/models/smollm2"))
    assert config == {
        "method": "draft_model",
        "model": "/models/smollm2",
        "num_speculative_tokens": 3,
    }


def test_the_real_map_pairs_each_rule_with_plain_vllm(tmp_path: Path) -> None:
    """--map real: every configuration on the real model, a nobind setting unbound, the rest
    at vLLM's default reservation, each method with plain vLLM to pair with; without the
    model's directories it stops in one line naming the option and how to make them."""
    bench = load_script("bench_vllm.py")
    model, draft = tmp_path / "model", tmp_path / "draft"
    for made in (model, draft):
        made.mkdir()
        (made / "config.json").write_text("{}", encoding="utf-8")
    chosen = ["--map", "real", "--libomp-path", sys.executable, "--tcmalloc-path", sys.executable]
    args = bench.parse_args([*chosen, "--real-model", str(model), "--real-draft", str(draft)])
    records = load_script("bench_vllm_records.py")
    assert {c.model for c in args.configs} == {records.REAL}
    assert {c.method for c in args.configs} == set(records.MAPS["real"])
    for config in args.configs:
        nobind = records.SETTINGS[config.setting].nobind
        assert config.threads == (records.NOBIND if nobind else "default")
        assert bench.Config(records.REAL, config.method, "default", "libgomp") in args.configs
    command = [sys.executable, str(SCRIPTS / "bench_vllm.py"), *chosen]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--real-model None is not a model directory (no config.json); Fix: " in refused.stderr


def test_acceptance_and_accepted_tokens_per_step_are_read_from_the_counters() -> None:
    """A run keeps vLLM's three SD counters; the report shows accepted of drafted tokens and
    accepted tokens per verifying step, and leaves both out for runs kept before."""
    records, report = load_script("bench_vllm_records.py"), load_script("bench_vllm_report.py")
    kept = json.loads((REPO / "docs" / "bench_vllm_map.json").read_text(encoding="utf-8"))
    old = records.runs_from_json(kept)[:2]
    assert report.drafting(old) == []
    counts = {"drafts": 40.0, "draft_tokens": 120.0, "accepted_tokens": 90.0}
    new = [replace(run, sd_counts=counts, acceptance=0.75) for run in old]
    assert new[0].accepted_per_step == 90 / 40
    assert report.drafting(new) == ["0.75 (0.75-0.75)", "2.25 (2.25-2.25)"]


def test_the_gains_plot_is_drawn_from_a_kept_run(tmp_path: Path) -> None:
    picture = tmp_path / "gains.png"
    kept = REPO / "docs" / "bench_vllm_methods.json"
    run_script("bench_vllm.py", "--from-json", str(kept), "--gains-plot", str(picture))
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


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


def test_each_setting_preloads_its_runtime_through_the_launcher(
    tmp_path: Path, vllm_env: Path, debian_root: Path, record_file: Path
) -> None:
    """The map's launcher settings, run as bench_vllm runs them (its options, its variables)
    into a recording vLLM: each process maps the runtime its setting names (the real
    libiomp5 of the intel-openmp wheel, Debian's LLVM libomp), tcmalloc where it says so,
    and the block time it asks for."""
    records = load_script("bench_vllm_records.py")
    # LLVM's runtime under its libiomp5.so alias (libomp-14-dev): the launcher preloads
    # only a name holding "libiomp", which vLLM's SD check looks for.
    libomp = debian_root / "usr/lib/llvm-14/lib/libiomp5.so"
    tcmalloc = debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    # What /proc/PID/maps names: the files themselves, past any link (libtcmalloc's .so.4.5.x).
    runtime_prefix = {records.IOMP: "libiomp5", records.LLVM_OMP: "libomp"}  # libomp.so.5
    launched = [s for s in records.SETTINGS.values() if not s.plain]
    assert {s.runtime for s in launched} == {records.GOMP, records.IOMP, records.LLVM_OMP}
    for setting in launched:
        record_file.unlink(missing_ok=True)
        options = setting.launcher_options(tcmalloc, libomp)
        environ = clean_environ(tmp_path, RECORD_TO=str(record_file), **dict(setting.variables))
        serve = ["serve", "m", "--speculative-config", '{"method":"ngram"}']
        result = run_launcher([*options, "--vllm", str(vllm_env / "bin" / "vllm"), *serve], environ)
        assert result.returncode == 0, (setting.key, result.stderr)
        record = read_record(record_file)
        names = [Path(path).name for path in record["mapped"]]  # type: ignore[attr-defined]
        runtimes = [name for name in names if name.startswith(("libiomp5", "libomp"))]
        expected = runtime_prefix.get(setting.runtime)
        assert len(runtimes) == (expected is not None), (setting.key, runtimes)
        assert all(name.startswith(f"{expected}.") for name in runtimes), (setting.key, runtimes)
        tcmalloc_mapped = any(name.startswith("libtcmalloc") for name in names)
        assert tcmalloc_mapped == setting.tcmalloc, (setting.key, names)
        if setting.blocktime is not None:
            assert record["KMP_BLOCKTIME"] == setting.blocktime, setting.key


def test_the_libomp_settings_ask_for_the_library(debian_root: Path) -> None:
    """Without --libomp-path a libomp setting is refused before any vLLM starts, in one line
    naming the option; with the libiomp5.so alias the line names, the map takes it."""
    command = [sys.executable, str(SCRIPTS / "bench_vllm.py"), "--settings", "libomp-nobind-bt200"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "the libomp settings need --libomp-path FILE (given: None)" in refused.stderr
    bench = load_script("bench_vllm.py")
    alias = debian_root / "usr/lib/llvm-14/lib/libiomp5.so"
    chosen = ["--models", "tiny", "--methods", "ngram3", "--settings", "libomp-nobind-bt200"]
    args = bench.parse_args([*chosen, "--libomp-path", str(alias)])
    assert args.configs == [bench.Config("tiny", "ngram3", "nobind", "libomp-nobind-bt200")]


def test_the_worker_runtime_is_named_by_its_banner(debian_root: Path, real_iomp: Path) -> None:
    """LLVM's runtime under a libiomp5.so name (Debian's alias; cmeel-libomp ships a copy so
    named) is reported as libomp, Intel's as libiomp5: the map's `worker maps` column."""
    run = load_script("bench_vllm_run.py")
    assert run.runtime_flavor(str(debian_root / "usr/lib/llvm-14/lib/libiomp5.so")) == "llvm"
    assert run.runtime_flavor(str(real_iomp)) == "intel"
    assert run.runtime_flavor(str(debian_root / "usr/share/doc/libomp5-14/copyright")) is None


def test_a_settings_variables_replace_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records, run = load_script("bench_vllm_records.py"), load_script("bench_vllm_run.py")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.setenv("KMP_PLAIN_BARRIER_PATTERN", "hyper,hyper")
    cache = tmp_path / "cache"
    for key, setting in records.SETTINGS.items():
        env = run.server_environment(
            records.Config("tiny", "ngram3", "default", key), tmp_path, cache
        )
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == ("nobind" if setting.nobind else "auto")
        given = dict(setting.variables)
        for name in ("OMP_WAIT_POLICY", "KMP_PLAIN_BARRIER_PATTERN", "GOMP_SPINCOUNT"):
            assert env.get(name) == given.get(name), (key, name)  # the caller's never reaches it
    assert dict(records.SETTINGS["libgomp-active"].variables) == {"OMP_WAIT_POLICY": "active"}
    assert records.SETTINGS[records.ONE_THREAD].variables == (("OMP_NUM_THREADS", "1"),)


def test_the_limit_divides_the_one_thread_tpot_by_the_threads(tmp_path: Path) -> None:
    """Kept runs of the map, the same figures read again as the one-thread reference: a
    bound one-thread worker with that TPOT is at the limit, a two-thread one is twice it.
    Runs kept before the idle window say so."""
    records, report = load_script("bench_vllm_records.py"), load_script("bench_vllm_report.py")
    kept = json.loads((REPO / "docs" / "bench_vllm_map.json").read_text(encoding="utf-8"))
    runs = records.runs_from_json(kept)
    bound = next(r for r in runs if r.core_ids == "[0]" and r.config.setting == "libgomp")
    group = [r for r in runs if r.config == bound.config]
    one = [
        replace(r, config=replace(r.config, threads="nobind", setting=records.ONE_THREAD))
        for r in group
    ]
    two = [
        replace(r, config=replace(r.config, setting="libgomp-nobind"), core_ids="unbound")
        for r in group
    ]
    by_config = {bound.config: group, one[0].config: one, two[0].config: two}
    meta = {**kept["meta"], "concurrency": [1], "machine": {**kept["meta"]["machine"], "cpus": "2"}}
    rows = report.limit_rows(list(by_config), by_config, meta)
    tpot = statistics.median(r.phase(1).tpot_ms for r in group)
    assert f"| default | libgomp | 1 | not read | {tpot:.2f} (1.00) |" in rows
    assert f"| nobind | {records.ONE_THREAD} | 1 | not read | {tpot:.2f} (1.00) |" in rows
    assert f"| default | libgomp-nobind | 2 | not read | {tpot / 2:.2f} (0.50) |" in rows


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
    assert set(samples["front-end"][0]) == {
        "vllm",
        "load",
        "register",
        "hook",
        "read",
        "LD_PRELOAD",
    }
    assert set(samples["engine-or-worker"][0]) == {"vllm", "load", "register", "read"}
    assert "libiomp5" in samples["front-end"][0]["LD_PRELOAD"]  # the hook planned, for real
    for role in samples:
        assert f"ratio plugin-{role} (plugin / import vllm, {role}, median of 1" in output
    assert "rerun: cd " in output and "bench_plugin.py --rounds 1" in output


# The evidence's front page holds the headline, the rules' evidence and the kept records
# within 3,000 words (issue 47); the rest is in pages it links to, every figure reachable.
DOCS = REPO / "docs"
FRONT_PAGE_WORDS = 3_000
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def benchmark_pages() -> list[Path]:
    return sorted(DOCS.glob("benchmarks*.md"))


def test_the_benchmarks_front_page_is_at_most_3000_words() -> None:
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert len(text.split()) <= FRONT_PAGE_WORDS, "move details to docs/benchmarks-details.md"


def test_every_link_of_the_benchmark_pages_reaches_its_page_and_heading() -> None:
    for page in benchmark_pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            name, _, anchor = target.partition("#")
            linked = (page.parent / name) if name else page
            assert linked.is_file(), (page.name, target)
            if anchor:
                assert anchor in anchors_of(linked), (page.name, target)


def test_every_kept_record_and_plot_is_reachable_from_the_front_page() -> None:
    """Each record under docs/ is named on the front page or on a page it links to, and
    each plot is drawn or named there, or is its record's (the kept records' table: "Each has its
    plot beside it")."""
    front = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    linked = {DOCS / name.partition("#")[0] for name in LINK.findall(front) if "://" not in name}
    pages = [DOCS / "benchmarks.md", *(page for page in benchmark_pages() if page in linked)]
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    records = sorted(DOCS.glob("bench_vllm_*.json"))
    plots = sorted(DOCS.glob("bench_vllm_*.png"))
    assert records and plots
    for record in records:
        assert record.name in text, record.name
    for plot in plots:
        assert plot.name in text or plot.with_suffix(".json").name in text, plot.name


def test_the_shapes_table_is_the_one_its_script_prints_from_the_kept_runs() -> None:
    """docs/benchmarks-details.md's shapes table, as `scripts/bench_vllm_shapes.py
    docs/bench_vllm_shapes` prints it (a fresh process) from the records kept there."""
    text = (REPO / "docs" / "benchmarks-details.md").read_text(encoding="utf-8")
    begin, end = "<!-- bench_vllm shapes: begin -->\n", "<!-- bench_vllm shapes: end -->"
    shown = text.split(begin, 1)[1].split(end, 1)[0]
    script = [sys.executable, str(SCRIPTS / "bench_vllm_shapes.py"), "docs/bench_vllm_shapes"]
    printed = subprocess.run(script, cwd=REPO, capture_output=True, text=True, check=True)
    assert shown == printed.stdout
    rows = [line for line in shown.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 16 and all(line.count(" | ") == 4 for line in rows)


def test_the_servers_bench_pairs_its_layouts_by_round(tmp_path: Path) -> None:
    """scripts/bench_servers.py --from-json (a fresh process): per concurrency, the servers'
    total tokens/s over one server's and one server's TPOT over theirs, paired by round,
    a `gain` only where all 4 rounds agree; without a kept run it needs what it measures."""
    runs = []
    for number in range(4):
        one = {"4": {"tokens_per_s": 100.0, "tpot_ms": 30.0}}
        many = {"4": {"tokens_per_s": 150.0 + number, "tpot_ms": 25.0 + number}}
        runs += [
            {"layout": "one", "round": number, "startup_s": 40.0, "phases": one},
            {"layout": "servers", "round": number, "startup_s": 60.0, "phases": many},
        ]
    meta = {"command": "python scripts/bench_servers.py", "servers": 2, "concurrency": [4]}
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps({"meta": meta, "runs": runs}), encoding="utf-8")
    script = [sys.executable, str(SCRIPTS / "bench_servers.py")]
    done = subprocess.run([*script, "--from-json", str(kept)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 4 |"))
    assert row == (
        "| 4 | 100.0 | 151.5 | 1.52 (1.50-1.53) gain | 30.00 | 26.50 | 1.13 (1.07-1.20) gain |"
    )
    refused = subprocess.run(script, capture_output=True, text=True)
    assert refused.returncode == 2 and "needs --real-model" in refused.stderr

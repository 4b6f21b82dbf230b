"""`tune` without vLLM: the argv it measures, the noise rule, the config it writes, the
reason later plans give, and the whole verb run against a stand-in `vllm` that serves and
writes `vllm bench serve`'s JSON (the real benchmark runs in tests/e2e/test_tune.py)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import LaunchError
from vllm_cpu_launch.inside import DIRECTORY_PREFIX
from vllm_cpu_launch.plan import why
from vllm_cpu_launch.settings import (
    Given,
    Mode,
    Scope,
    Settings,
    Tuned,
    choose,
    load_settings,
    read_config_file,
    record_scope,
)
from vllm_cpu_launch.verbs.tune import contest
from vllm_cpu_launch.verbs.tune.command import check_serve, server_arguments
from vllm_cpu_launch.verbs.tune.contest import (
    CONTENDERS,
)

from .conftest import LAUNCHER, SystemHost, clean_environ, make_environment, run_launcher

NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
GOMP, IOMP = CONTENDERS
# A stand-in `vllm`: records its argv and preload, then serves (`vllm serve`) or answers
# like `vllm bench serve`. FAKE_BENCH picks the story: which runtime is faster, both alike,
# each faster at one concurrency, a failure or a hang.
FAKE_BENCH = """\
import http.server, json, os, subprocess, sys, time, urllib.request

def serve_story(args, story, iomp):
    # `vllm serve`: /health, and /iomp saying what this server preloaded.
    if story == "serve-dies":
        print("RuntimeError: the engine core died")
        sys.exit(3)
    if story == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.path.join(os.environ["FAKE_RECORD"], "child.pid"), "w").write(str(child.pid))
        time.sleep(600)
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"iomp": iomp}).encode())
        def log_message(self, *_):
            pass
    port = int(args[args.index("--port") + 1])
    http.server.HTTPServer((args[args.index("--host") + 1], port), Answer).serve_forever()

def client_story(args, story, count):
    # `vllm bench serve`: asks the server what it preloaded; its TPOT follows the story.
    if story == "fail":
        print("ValueError: the client failed")
        sys.exit(1)
    if story == "no-result":  # exits 0 and writes no result (a vLLM that changed it)
        for line in range(20):
            print(f"INFO bench line {line}")
        sys.exit(0)
    value = lambda name: args[args.index(name) + 1]
    url, concurrency = value("--base-url"), int(value("--max-concurrency"))
    with open(value("--dataset-path")) as dataset, open(os.path.join(
            os.environ["FAKE_RECORD"], "asked.jsonl"), "a") as asked:
        turns = [entry["conversations"][0]["value"] for entry in json.load(dataset)]
        asked.write(json.dumps(turns) + "\\n")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as aiohttp: no proxy
    iomp = json.load(direct.open(url + "/iomp"))["iomp"]
    # iomp-faster, gomp-faster: at every concurrency; any other: iomp at 1, libgomp above.
    faster = iomp if story == "iomp-faster" else not iomp if story == "gomp-faster" else (
        iomp if concurrency == 1 else not iomp)
    tpot = 10.0 if faster else 20.0
    if story == "alike":  # each run differs from the last by more than the candidates do
        tpot = 10.0 + count % 4
    result = os.path.join(value("--result-dir"), value("--result-filename"))
    # A model without a chat template: vLLM's client exits 0 when every request failed.
    no_chat = story == "no-chat" and value("--endpoint") == "/v1/chat/completions"
    if no_chat:
        tpot = 0.0
    json.dump({"mean_tpot_ms": tpot, "output_throughput": tpot and 1000 / tpot * concurrency,
               "completed": 0 if no_chat else 8, "spec_decode_draft_tokens": 30,
               "spec_decode_accepted_tokens": 20 if iomp else 19}, open(result, "w"))
    sys.exit(0)

args = sys.argv[1:]
story = os.environ["FAKE_BENCH"]
runs = os.path.join(os.environ["FAKE_RECORD"], "runs.jsonl")
iomp = "libiomp" in os.environ.get("LD_PRELOAD", "")
with open(runs, "a") as stream:
    stream.write(json.dumps({"argv": args, "iomp": iomp,
                             "blocktime": os.environ.get("KMP_BLOCKTIME")}) + "\\n")
count = sum(1 for _ in open(runs))
if args[:1] == ["serve"]:
    serve_story(args, story, iomp)
if args[:2] == ["bench", "serve"]:
    client_story(args, story, count)
"""


# ---------------------------------------------------------------- the command measured


def test_the_serve_command_runs_on_tunes_port_without_its_connection_options() -> None:
    serve = [
        "serve",
        "/models/m",
        "--host",
        "0.0.0.0",
        "--port=8000",
        "--api_key",
        "k1",
        "k2",
        "--enable-log-requests",
        "--served-model-name",
        "m",
        "--speculative-config",
        NGRAM,
        "--ssl-keyfile=/k.pem",
        "--chat-template",
        "--not-an-option-but-a-value",
        "-tp",
        "1",
    ]
    arguments, dropped = server_arguments(serve, 9000)
    assert dropped == [
        "--host",
        "0.0.0.0",
        "--port=8000",
        "--api_key",
        "k1",
        "k2",
        "--ssl-keyfile=/k.pem",
    ]
    assert arguments == [
        "serve",
        "/models/m",
        "--enable-log-requests",
        "--served-model-name",
        "m",
        "--speculative-config",
        NGRAM,
        "--chat-template",
        "--not-an-option-but-a-value",
        "-tp",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
    ]


def test_model_given_as_option_is_kept_and_a_missing_one_is_a_usage_error() -> None:
    check_serve(["serve", "--model=/m", "-sc", NGRAM])
    for serve in (["serve"], ["serve", "-sc", NGRAM], ["chat", "m"], []):
        with pytest.raises(LaunchError) as raised:
            check_serve(serve)
        assert raised.value.code == 2


# ---------------------------------------------------------------- the config


TUNED = {
    "when": "2026-12-01T10:02Z",
    "iomp": "never",
    "result": "libgomp 1.12x faster than libiomp5, spread 0.03 s",
    "rounds": 3,
    "command": "vllm bench latency --model m",
}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("record", "parts"),
    [
        ({**TUNED, "colour": "blue"}, ("key 'tuned': unknown key 'colour'", "when, iomp")),
        ({k: v for k, v in TUNED.items() if k != "result"}, ("key 'tuned'", "lacks result")),
        ({**TUNED, "iomp": "sometimes"}, ("tuned'.iomp", "'sometimes'")),
        ({**TUNED, "rounds": 0}, ("tuned'.rounds", "positive")),
        ({**TUNED, "result": ""}, ("tuned'.result", "non-empty")),
        ("yesterday", ("key 'tuned'", "must be a mapping")),
    ],
)
def test_a_bad_tune_record_names_file_and_key(
    tmp_path: Path, record: object, parts: tuple[str, ...]
) -> None:
    config = write(tmp_path / "c.yaml", yaml.safe_dump({"iomp": "never", "tuned": record}))
    with pytest.raises(LaunchError) as raised:
        read_config_file(str(config))
    assert raised.value.code == 2 and str(config) in raised.value.message
    for part in parts:
        assert part in raised.value.message


def test_a_record_from_before_scoping_is_scoped_to_its_command(tmp_path: Path) -> None:
    """A config a tune wrote before records were scoped (a global iomp: and one record)
    keeps working: the iomp is the record's, applied to the command it records alone."""
    config = write(tmp_path / "c.yaml", yaml.safe_dump({"iomp": "never", "tuned": TUNED}))
    settings = load_settings({"config": str(config)}, {})
    assert settings.iomp == "auto" and settings.iomp_from == "default"  # the record's value
    assert settings.tuned == (Tuned(**TUNED, origin=str(config)),)  # type: ignore[arg-type]
    assert record_scope(settings.tuned[0]) == Scope(model="m")
    edited = write(tmp_path / "e.yaml", yaml.safe_dump({"iomp": "always", "tuned": TUNED}))
    edited_settings = load_settings({"config": str(edited)}, {})
    assert edited_settings.tuned == () and edited_settings.iomp == "always"  # the user's own
    # YAML reads an unquoted time as a timestamp: it is taken as text.
    unquoted = write(
        tmp_path / "u.yaml", yaml.safe_dump({"iomp": "never", "tuned": TUNED}).replace("'", "")
    )
    assert load_settings({"config": str(unquoted)}, {}).tuned != ()


SCOPE = {"model": "/models/m", "method": "ngram", "tokens": 3, "vllm": "0.32.0", "cpus": 2}


@pytest.mark.parametrize(
    ("launch", "applied", "why_not"),
    [
        (Scope("/models/m", "ngram", 3, "0.32.0", 2), True, None),
        (Scope("/models/other", "ngram", 3, "0.32.0", 2), False, "model /models/other, not"),
        (Scope("/models/m", "draft_model", 3, "0.32.0", 2), False, "SD method draft_model"),
        (Scope("/models/m", "ngram", 7, "0.32.0", 2), False, "draft tokens 7, not 3"),
        (Scope("/models/m", "ngram", 3, "0.31.1", 2), False, "vLLM 0.31.1, not 0.32.0"),
        (Scope("/models/m", "ngram", 3, "0.32.0", 16), False, "CPUs 16, not 2"),
        (Scope(None, "ngram", 3, "0.32.0", 2), False, "model unknown, not /models/m"),
    ],
)
def test_a_record_applies_only_where_it_was_measured(
    launch: Scope, applied: bool, why_not: str | None
) -> None:
    record = Tuned(**TUNED, scope=Scope(**SCOPE), origin="c.yaml")  # type: ignore[arg-type]
    chosen, notes = choose(Settings(tuned=(record,)), launch)
    assert (chosen is record) is applied
    (note,) = notes
    assert note.startswith("tune of 2026-12-01T10:02Z (model /models/m, SD method ngram, ")
    assert note.endswith("; c.yaml) applied") if applied else str(why_not) in note
    # An option or a variable wins over a matching record, and says so.
    given, notes = choose(
        Settings(iomp=Mode.ALWAYS, iomp_from=Given.OPTION, tuned=(record,)), launch
    )
    assert given is None and len(notes) == 1


def test_of_several_matching_records_the_one_that_recorded_more_wins() -> None:
    loose = Tuned(**{**TUNED, "iomp": "always"}, scope=Scope(model="/models/m"))  # type: ignore[arg-type]
    exact = Tuned(**TUNED, scope=Scope(**SCOPE))  # type: ignore[arg-type]
    chosen, notes = choose(Settings(tuned=(loose, exact)), Scope(**SCOPE))  # type: ignore[arg-type]
    assert chosen is exact and len(notes) == 2 and "matches too" in notes[1]


def test_the_reason_says_it_came_from_a_tune() -> None:
    sd = read_command(["serve", "m", "-sc", NGRAM]).speculative
    tuned = Tuned(**TUNED)  # type: ignore[arg-type]
    assert why(Mode.NEVER, sd, True, tuned) == (
        "--iomp never (from tune 2026-12-01T10:02Z: libgomp 1.12x faster than libiomp5, "
        "spread 0.03 s)"
    )
    kept = Tuned(**{**TUNED, "iomp": "auto", "result": "within the noise, default kept: x"})  # type: ignore[arg-type]
    assert why(Mode.AUTO, sd, True, kept).startswith(
        "speculative decoding requested by -sc (from tune 2026-12-01T10:02Z: within the noise"
    )


# ---------------------------------------------------------------- the verb, end to end


@pytest.fixture
def bench_env(tmp_path: Path, real_iomp: Path) -> Path:
    """A vLLM-like environment with the real libiomp5.so and a stand-in `vllm bench`."""
    environment = make_environment(tmp_path / "vllm-env", real_iomp)
    script = environment / "bin" / "vllm"
    script.write_text(f"#!{environment / 'bin' / 'python'}\n{FAKE_BENCH}")
    script.chmod(0o755)
    return environment


def tune(
    tmp_path: Path,
    bench_env: Path,
    story: str,
    *args: str,
    **variables: str,
) -> subprocess.CompletedProcess[str]:
    """tune against the stand-in, with `variables` in its environment."""
    record = tmp_path / "record"
    record.mkdir(exist_ok=True)
    environ = clean_environ(
        tmp_path, FAKE_BENCH=story, FAKE_RECORD=str(record), TMPDIR=str(tmp_path), **variables
    )  # a failed run's logs are kept: under tmp_path, not /tmp
    vllm = ["--vllm", str(bench_env / "bin" / "vllm")]
    return run_launcher([*vllm, "tune", *args], environ)


def runs(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "record" / "runs.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def argvs(tmp_path: Path, first: str) -> list[dict[str, Any]]:
    """The stand-in's recorded runs whose argv starts with `first` (serve, or bench)."""
    return [run for run in runs(tmp_path) if run["argv"][0] == first]


SERVE = ["serve", "/models/m", "--port", "8000", "-sc", NGRAM]


def preloaded(dry_run: str) -> list[str]:
    """The kinds of library in --dry-run's `preload:` lines (the first, then the indented)."""
    _, found, rest = dry_run.partition("\npreload:")
    lines = rest.splitlines() if found else []
    block = lines[:1] + list(itertools.takewhile(lambda line: line.startswith(" "), lines[1:]))
    return [line.split()[0] for line in block]


USER_CONFIG = ("no-user-config", "vllm-cpu-launch", "config.yaml")


def test_tune_writes_the_winner_and_the_next_plan_follows_it(
    tmp_path: Path, bench_env: Path
) -> None:
    user_config = tmp_path.joinpath(*USER_CONFIG)
    write(user_config, "# my settings\ntcmalloc: never\n")
    result = tune(tmp_path, bench_env, "gomp-faster", "--write", "--rounds", "2", "--", *SERVE)
    assert result.returncode == 0, result.stderr
    said = result.stderr.splitlines()
    progress = [line for line in said if ": start " in line and "(round " in line]
    assert [line.split(":")[1].split()[-1] for line in progress] == [
        "libgomp",
        "libiomp5",
        "libiomp5",
        "libgomp",
    ]
    # How long it will take, said before the first run and again, measured, after it.
    first = said.index(progress[0])
    assert said[first - 1].endswith(
        "4 starts in all, at most 30 min (--time-limit); the first "
        "one's time gives the estimate for the rest"
    ), said
    assert re.search(r"expect about \d+ s more: 3 starts at the first's pace$", said[first + 1])
    assert "replaced by tune's loopback port: --port 8000" in result.stderr
    measured = argvs(tmp_path, "serve")
    assert [run["iomp"] for run in measured] == [False, True, True, False]
    assert {run["blocktime"] for run in measured if run["iomp"]} == {"5"}
    assert all(run["argv"][:2] == ["serve", "/models/m"] for run in measured)
    assert "result at 1: libgomp 2.00x faster than libiomp5" in result.stdout
    assert "best is --iomp never" in result.stdout
    config = read_config_file(str(user_config))
    assert "iomp" not in config and config["tcmalloc"] == "never"  # no global choice
    records = config["tuned"]
    assert isinstance(records, tuple) and len(records) == 1
    record: Tuned = records[0]
    assert record.rounds == 2 and record.iomp == "never"
    assert record.command.startswith("vllm serve /models/m -sc")
    assert record.scope == Scope("/models/m", "ngram", 3, None, len(os.sched_getaffinity(0)))
    assert user_config.read_text().startswith("# my settings\n")

    plan = run_launcher(
        ["--vllm", str(bench_env / "bin" / "vllm"), "--dry-run", *SERVE], clean_environ(tmp_path)
    )
    assert plan.returncode == 0, plan.stderr
    # A record of libgomp no longer keeps libgomp for SD: the note says why.
    assert "preload:     iomp" in plan.stdout
    assert f"note:        tune of {record.when} not applied after all: it kept libgomp" in (
        plan.stdout
    )


def test_without_a_clear_winner_the_default_is_kept_and_said(
    tmp_path: Path, bench_env: Path, system_host: SystemHost
) -> None:
    config = tmp_path / "chosen.yaml"  # --launcher-config: made by --write
    result = tune(
        tmp_path,
        bench_env,
        "alike",
        "--write",
        "--launcher-config",
        str(config),
        "--rounds",
        "3",
        "--concurrency",
        "1",
        *SERVE,
    )
    assert result.returncode == 0, result.stderr
    assert "result at 1: no clear winner: libiomp5 won 2 of 3 rounds; median" in result.stdout
    # The plan adds the host's tcmalloc to libiomp5 only (with libgomp it adds nothing).
    compared = "compared:  the OpenMP runtime only (and its KMP_BLOCKTIME)"
    if system_host.tcmalloc:
        compared = (
            "compared:  the OpenMP runtime and more: libgomp adds nothing else; "
            f"libiomp5 preloads {system_host.tcmalloc}"
        )
    assert compared in result.stdout.splitlines()
    assert "keeping the default (libiomp5)" in result.stdout
    written = read_config_file(str(config))
    assert "iomp" not in written
    assert [record.iomp for record in written["tuned"]] == ["auto"]  # type: ignore[attr-defined]
    plan = run_launcher(
        [
            "--vllm",
            str(bench_env / "bin" / "vllm"),
            "--launcher-config",
            str(config),
            "--dry-run",
            *SERVE,
        ],
        clean_environ(tmp_path),
    )
    assert preloaded(plan.stdout) == system_host.kinds("iomp")
    assert "(from tune " in plan.stdout and "no clear winner" in plan.stdout


def test_a_tune_applies_to_its_scope_and_a_later_one_of_the_same_scope_replaces_it(
    tmp_path: Path, bench_env: Path, system_host: SystemHost
) -> None:
    vllm = ["--vllm", str(bench_env / "bin" / "vllm")]
    user_config = tmp_path.joinpath(*USER_CONFIG)
    other = ["serve", "/models/other", "-sc", NGRAM]
    assert (
        tune(tmp_path, bench_env, "gomp-faster", "--write", "--rounds", "2", *SERVE).returncode == 0
    )
    assert (
        tune(tmp_path, bench_env, "iomp-faster", "--write", "--rounds", "2", *other).returncode == 0
    )
    models = [r.scope.model for r in read_config_file(str(user_config))["tuned"]]  # type: ignore[attr-defined]
    assert models == ["/models/other", "/models/m"]  # the newest first, the other kept
    # Each command gets its own tune's choice; -v says which record was considered and why.
    first = run_launcher([*vllm, "-v", "--dry-run", *SERVE], clean_environ(tmp_path))
    assert preloaded(first.stdout) == system_host.kinds("iomp")
    assert "not applied after all" in first.stdout
    assert "not applied: model /models/m, not /models/other" in first.stdout
    second = run_launcher([*vllm, "--dry-run", *other], clean_environ(tmp_path))
    assert preloaded(second.stdout) == system_host.kinds("iomp")
    untuned = ["serve", "/models/third", "-sc", NGRAM]
    third = run_launcher([*vllm, "--dry-run", *untuned], clean_environ(tmp_path))
    assert "(from tune " not in third.stdout
    assert preloaded(third.stdout) == system_host.kinds("iomp")
    # Tuned again, the first command's record is replaced, the other kept.
    assert (
        tune(tmp_path, bench_env, "iomp-faster", "--write", "--rounds", "2", *SERVE).returncode == 0
    )
    records = read_config_file(str(user_config))["tuned"]
    assert [(r.scope.model, r.iomp) for r in records] == [  # type: ignore[attr-defined]
        ("/models/m", "auto"),
        ("/models/other", "auto"),
    ]


def test_a_config_from_before_scoping_is_kept_scoped_when_a_tune_writes(
    tmp_path: Path, bench_env: Path
) -> None:
    """The old single record and its global iomp: become one scoped record beside the new."""
    user_config = tmp_path.joinpath(*USER_CONFIG)
    old = {**TUNED, "command": 'vllm bench latency --model /models/old -sc \'{"method":"ngram"}\''}
    write(user_config, "# mine\nstrict: true\n" + yaml.safe_dump({"iomp": "never", "tuned": old}))
    assert tune(tmp_path, bench_env, "alike", "--write", "--rounds", "2", *SERVE).returncode == 0
    text = user_config.read_text()
    assert text.startswith("# mine\nstrict: true\n") and "\niomp:" not in text
    records = read_config_file(str(user_config))["tuned"]
    assert [(r.scope.model, r.scope.method, r.iomp) for r in records] == [  # type: ignore[attr-defined]
        ("/models/m", "ngram", "auto"),
        ("/models/old", "ngram", "never"),
    ]


def test_without_write_nothing_is_written(tmp_path: Path, bench_env: Path) -> None:
    result = tune(tmp_path, bench_env, "iomp-faster", "--rounds", "2", *SERVE)
    assert result.returncode == 0, result.stderr
    assert "the default (libiomp5) is best" in result.stdout
    assert "not written" in result.stdout
    assert not tmp_path.joinpath(*USER_CONFIG).exists()


def test_sigterm_stops_the_run_and_its_children(tmp_path: Path, bench_env: Path) -> None:
    record = tmp_path / "record"
    record.mkdir()
    environ = clean_environ(tmp_path, FAKE_BENCH="hang", FAKE_RECORD=str(record))
    vllm = ["--vllm", str(bench_env / "bin" / "vllm")]
    command = [*LAUNCHER, *vllm, "tune", *SERVE]
    with subprocess.Popen(command, env=environ, stderr=subprocess.PIPE, text=True) as process:
        pid_file = record / "child.pid"
        for _ in range(600):  # bounded wait for the run to be under way (not a timing check)
            if (pid_file.exists() and pid_file.read_text()) or process.poll() is not None:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
        stderr = process.stderr.read() if process.stderr else ""
    assert process_state(int(pid_file.read_text())) in (None, "Z")
    assert "Traceback" not in stderr
    logs = stderr.partition("(logs in ")[2].partition(")")[0]
    assert logs and not Path(logs).exists()  # the scratch directory went with it


def test_a_run_that_exits_0_without_its_result_is_one_error_naming_file_and_log(
    tmp_path: Path, bench_env: Path
) -> None:
    """Once exit 1, documented only as the time limit's, and the log's tail as 15
    `error:` lines: now one line naming the result file it did not write and the log, and
    exit 1 is documented for it too (tune --help)."""
    result = tune(tmp_path, bench_env, "no-result", *SERVE)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "INFO bench line" not in result.stderr, result.stderr
    (line,) = errors
    prefix = "vllm-cpu-launch: error: vllm bench serve exited 0 but its result "
    assert line.startswith(prefix) and " lacks its figures; log: " in line, line
    output = line.removeprefix(prefix).partition(" ")[0]
    log = Path(line.rpartition("; log: ")[2])
    assert output.endswith(".json") and not Path(output).exists()
    assert "INFO bench line 19" in log.read_text()
    help_text = run_launcher(["tune", "--help"], clean_environ(tmp_path)).stdout
    assert "or a run exited 0 without writing its result" in " ".join(help_text.split())


def process_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rpartition(")")[2].split()[0]


# A server for `started`: the plugin's front end (its readings directory, removed at exit)
# and a child in its session, as vLLM's engine core; on SIGTERM it exits as vLLM's API
# server does, or (ignores) it ignores SIGTERM, and so does the child it execs.
SERVER = """\
import os, signal, subprocess, sys, time
from vllm_cpu_launch import inside
inside.start(False)
if sys.argv[1] == "ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(os.environ["VLLMCPULAUNCH_READINGS"], child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("server", "code"), [("exits", 0), ("ignores", -signal.SIGKILL)])
def test_a_stopped_server_gets_sigterm_then_sigkill_and_leaves_no_readings_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: str, code: int
) -> None:
    """tune killed each server with SIGKILL, so every start left a readings directory
    behind (issue 45): SIGTERM first, which vLLM's API server ends on, removing it; one
    that ignores SIGTERM is killed after the grace period, with its whole session, and
    the directory its front end made is removed. Another's stays."""
    monkeypatch.setattr(contest, "STOP_GRACE_S", 2.0)  # the wait the ignoring one gets
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setenv("PYTHONPATH", clean_environ(tmp_path)["PYTHONPATH"])
    another = tmp_path / f"{DIRECTORY_PREFIX}1-kept"
    another.mkdir(mode=0o700)
    log = tmp_path / "server.log"
    with contest.started([sys.executable, "-c", SERVER, server], str(log)) as process:
        for _ in range(600):  # bounded wait for it to be under way (not a timing check)
            if log.read_text().endswith("\n") or process.poll() is not None:
                break
            time.sleep(0.1)
        directory, child = log.read_text().split()
        assert Path(directory).is_dir()
    assert process.returncode == code
    assert process_state(int(child)) in (None, "Z")  # gone, or dead and not yet reaped
    assert not Path(directory).exists() and another.is_dir()


def test_a_failed_run_shows_why_and_keeps_its_log(tmp_path: Path, bench_env: Path) -> None:
    result = tune(tmp_path, bench_env, "fail", *SERVE)
    assert result.returncode == 1
    last = result.stderr.splitlines()[-1]
    assert "vllm bench serve at concurrency 1 failed (exit code 1)" in last
    assert "ValueError: the client failed" in result.stderr
    log = Path(last.rpartition("log: ")[2])
    assert "ValueError: the client failed" in log.read_text()
    assert not tmp_path.joinpath(*USER_CONFIG).exists()


@pytest.mark.parametrize(
    ("args", "part"),
    [
        (["--rounds", "0", *SERVE], "--rounds '0': needs a positive whole number"),
        (["--time-limit", "soon", *SERVE], "--time-limit 'soon': needs a positive number"),
        (["--output-len", "2.5", *SERVE], "--output-len '2.5': needs a positive whole number"),
        (["--iomp", "never", *SERVE], "tune does not take --iomp"),
        (["--dry-run", *SERVE], "tune does not take --dry-run"),
        (["--write"], "tune measures a `serve` command"),
        (["serve", "--port", "1"], "tune needs the model"),
    ],
)
def test_usage_errors_are_one_line_exit_2(
    tmp_path: Path, bench_env: Path, args: list[str], part: str
) -> None:
    result = tune(tmp_path, bench_env, "iomp-faster", *args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"vllm-cpu-launch: error: {result.stderr[24:].strip()}"]
    assert part in result.stderr
    assert not (tmp_path / "record" / "runs.jsonl").exists()


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ("/proc/x/config.yaml", "creating a file in /proc fails (No such file or directory)"),
        ("{tmp}/file/x/config.yaml", "{tmp}/file is not a directory"),
    ],
)
def test_an_unwritable_launcher_config_names_the_directory_it_needs_and_why(
    tmp_path: Path, bench_env: Path, config: str, why: str
) -> None:
    """Once "(/proc: No such file or directory)": /proc exists. The directory the file
    goes in is missing, and making anything where it would go fails."""
    (tmp_path / "file").write_text("")
    config, why = config.format(tmp=tmp_path), why.format(tmp=tmp_path)
    result = tune(
        tmp_path, bench_env, "iomp-faster", "--write", "--launcher-config", config, *SERVE
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    directory = os.path.dirname(config)
    assert line == (
        f"vllm-cpu-launch: error: --write: the launcher config {config} cannot be written: "
        f"its directory {directory} does not exist and cannot be made: {why}; give "
        "--launcher-config FILE in a directory you can write"
    )
    assert not (tmp_path / "record" / "runs.jsonl").exists()


def test_a_broken_config_is_reported_not_overwritten(tmp_path: Path, bench_env: Path) -> None:
    config = write(tmp_path / "c.yaml", "colour: blue\n")
    result = tune(
        tmp_path, bench_env, "gomp-faster", "--write", "--launcher-config", str(config), *SERVE
    )
    assert result.returncode == 2 and "unknown key 'colour'" in result.stderr
    assert config.read_text() == "colour: blue\n"


@pytest.mark.parametrize("where", ["parent-is-a-file", "read-only"])
def test_write_proves_the_config_can_be_written_before_measuring(
    tmp_path: Path, bench_env: Path, where: str
) -> None:
    if where == "parent-is-a-file":
        config = write(tmp_path / "a-file", "") / "config.yaml"
    else:
        directory = tmp_path / "read-only"
        directory.mkdir()
        config = directory / "config.yaml"
    args = ["--write", "--launcher-config", str(config), *SERVE]
    if where == "read-only" and os.geteuid() == 0:  # root writes anywhere but on a ro mount
        (tmp_path / "record").mkdir()
        remount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
        result = run_launcher(
            [*LAUNCHER[1:], "--vllm", str(bench_env / "bin" / "vllm"), "tune", *args],
            clean_environ(tmp_path, FAKE_BENCH="iomp-faster", FAKE_RECORD=str(tmp_path / "record")),
            ["unshare", "--mount", "sh", "-c", remount, str(config.parent), LAUNCHER[0]],
        )
    else:
        if where == "read-only":
            config.parent.chmod(0o555)
        result = tune(tmp_path, bench_env, "iomp-faster", *args)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"vllm-cpu-launch: error: --write: the launcher config {config}")
    assert "give --launcher-config FILE in a directory you can write" in line
    assert not (tmp_path / "record" / "runs.jsonl").exists()  # nothing was measured
    assert not config.exists()


# ---------------------------------------------------------------- the serving benchmark

SHIPPED = str(Path(contest.__file__).parents[2] / "serving_prompts.jsonl")  # the package's


def only_record(tmp_path: Path) -> Tuned:
    """The one tune record of the user config."""
    records = read_config_file(str(tmp_path.joinpath(*USER_CONFIG)))["tuned"]
    assert isinstance(records, tuple) and len(records) == 1
    record: Tuned = records[0]
    return record


def asked(tmp_path: Path) -> list[list[str]]:
    """The prompts each client run of the stand-in was given, as vLLM's reader reads them."""
    lines = (tmp_path / "record" / "asked.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_serving_tune_judges_each_concurrency_and_records_what_won_at_each(
    tmp_path: Path, bench_env: Path
) -> None:
    """libiomp5 faster at 1 request at a time, libgomp at 2: no winner at every
    concurrency, so the default is kept, and the record says what each one pointed to.
    A proxy in the environment is not asked for the loopback server."""
    vllm = ["--vllm", str(bench_env / "bin" / "vllm")]
    args = ["--write", "--rounds", "3", "--concurrency", "2,1", "--output-len", "16"]
    proxy = "http://127.0.0.1:9"  # nothing listens there
    result = tune(tmp_path, bench_env, "split", *args, *SERVE, http_proxy=proxy)
    assert result.returncode == 0, result.stderr
    assert "replaced by tune's loopback port: --port 8000" in result.stderr
    servers = argvs(tmp_path, "serve")
    assert [run["iomp"] for run in servers] == [False, True, True, False, False, True]
    for run in servers:  # the user's command, on a loopback port of tune's own
        assert run["argv"][:2] == ["serve", "/models/m"] and "8000" not in run["argv"]
        assert run["argv"][-4:-1] == ["--host", "127.0.0.1", "--port"]
    clients = [run["argv"] for run in argvs(tmp_path, "bench")]
    assert [option(argv, "--max-concurrency") for argv in clients] == ["1", "2"] * 6
    for argv in clients:  # chat requests through vLLM's sharegpt reader (custom needs pandas)
        assert option(argv, "--backend") == "openai-chat"
        assert option(argv, "--dataset-name") == "sharegpt"
        assert option(argv, "--sharegpt-output-len") == "16"
        assert option(argv, "--model") == "/models/m" and "--ignore-eos" in argv
        assert option(argv, "--num-prompts") == "8"  # 4 a stream, at least 8
    shipped = [json.loads(line)["prompt"] for line in Path(SHIPPED).read_text().splitlines()]
    assert asked(tmp_path) == [shipped] * 12
    out = result.stdout
    assert "concurrency 1 (8 requests of 16 tokens a start)" in out
    assert "result at 1: libiomp5 2.00x faster than libgomp: libiomp5 won 3 of 3 rounds" in out
    assert "result at 2: libgomp 2.00x faster than libiomp5: libgomp won 3 of 3 rounds" in out
    assert "no candidate won at every concurrency (at 1: libiomp5; at 2: libgomp)" in out
    assert "keeping the default (libiomp5)" in out
    assert "60/90" in out and "57/90" in out  # drafts accepted, summed over the rounds
    record = only_record(tmp_path)
    assert record.iomp == "auto" and record.concurrency == ((1, "auto"), (2, "never"))
    assert record.command.startswith("vllm serve /models/m -sc ")
    plan = run_launcher([*vllm, "-v", "--dry-run", *SERVE], clean_environ(tmp_path))
    assert "not applied: its iomp: auto did not hold at every concurrency (never at 2)" in (
        plan.stdout
    )


def test_a_serving_tune_won_at_every_concurrency_is_a_winner_the_plan_follows(
    tmp_path: Path, bench_env: Path
) -> None:
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Repeat: a b c"}\n\n{"prompt": "Why?", "kind": "open"}\n')
    args = ["--write", "--rounds", "3", "--concurrency", "1,4", "--prompts", str(prompts)]
    result = tune(tmp_path, bench_env, "gomp-faster", *args, "--num-prompts", "5", *SERVE)
    assert result.returncode == 0, result.stderr
    assert "libgomp won at every concurrency (1, 4): best is --iomp never" in result.stdout
    clients = [run["argv"] for run in argvs(tmp_path, "bench")]
    assert asked(tmp_path) == [["Repeat: a b c", "Why?"]] * 12
    assert {option(argv, "--num-prompts") for argv in clients} == {"5"}
    record = only_record(tmp_path)
    assert record.iomp == "never" and record.concurrency == ((1, "never"), (4, "never"))
    plan = run_launcher(
        ["--vllm", str(bench_env / "bin" / "vllm"), "-v", "--dry-run", *SERVE],
        clean_environ(tmp_path),
    )
    assert "did not hold" not in plan.stdout and f"tune of {record.when}" in plan.stdout


def test_a_tune_beside_another_tenants_work_says_the_host_was_busy(
    tmp_path: Path, bench_env: Path
) -> None:
    """Busy loops of another process on every CPU tune may use, for the whole run: its report
    says the host was busy, by the CPU time that was neither tune's, its clients' nor the
    server's (real /proc/stat and /proc/PID/stat; the server and client are the stand-in)."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in os.sched_getaffinity(0)
    ]
    try:
        result = tune(tmp_path, bench_env, "gomp-faster", "--rounds", "1", *SERVE)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("host:"))
    assert line.startswith("host:     busy: other work used "), line
    low = float(line.split("used ")[1].split("-")[0])
    assert low >= 0.5, line  # a loop on each CPU, however the scheduler shares them
    assert "; other work " in result.stderr  # each start's progress line says its own


def test_a_server_that_dies_before_it_is_ready_ends_the_tune_with_its_code_and_log(
    tmp_path: Path, bench_env: Path
) -> None:
    result = tune(tmp_path, bench_env, "serve-dies", *SERVE)
    assert result.returncode == 3, result.stderr
    assert "RuntimeError: the engine core died" in result.stderr
    last = result.stderr.splitlines()[-1]
    assert "error: vllm serve exited before it was ready (exit code 3); log: " in last
    assert Path(last.rpartition("; log: ")[2]).is_file()


def test_a_client_run_that_completed_no_request_is_one_error_with_the_way_out(
    tmp_path: Path, bench_env: Path
) -> None:
    """A model without a chat template: vLLM refuses every chat request, and its client
    still exits 0 with zero figures; tune ends with one line, not a division by zero, and
    names --completions, which sends the prompts as text to the completions endpoint."""
    result = tune(tmp_path, bench_env, "no-chat", *SERVE)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    (error,) = errors
    assert "vllm bench serve at concurrency 1: no request completed" in error
    assert "add --completions); log: " in error and "Traceback" not in result.stderr
    plain = tune(tmp_path, bench_env, "no-chat", "--completions", "--rounds", "1", *SERVE)
    assert plain.returncode == 0, plain.stderr
    clients = [run["argv"] for run in argvs(tmp_path, "bench")][-4:]
    assert all(option(argv, "--backend") == "openai" for argv in clients)
    assert all(option(argv, "--endpoint") == "/v1/completions" for argv in clients)
    assert "tokens a request, sent as text to /v1/completions" in plain.stdout
    assert "tokens a request, sent as chat requests" not in plain.stdout


def test_the_time_limit_kills_a_server_that_never_gets_ready(
    tmp_path: Path, bench_env: Path
) -> None:
    result = tune(tmp_path, bench_env, "hang", "--time-limit", "3", *SERVE)
    assert result.returncode == 1, result.stderr
    assert "time limit of 3 s reached during start 1/6 (killed)" in result.stderr
    assert "not every candidate started once" in result.stderr
    child = int((tmp_path / "record" / "child.pid").read_text())
    assert process_state(child) in (None, "Z")  # gone, or dead and not yet reaped by init


@pytest.mark.parametrize(
    ("args", "part"),
    [
        (["--benchmark", "latency"], "unknown option '--benchmark' for tune"),
        (["--concurrency", "0,2"], "--concurrency '0,2': needs positive whole numbers"),
        (["--concurrency", "x"], "needs positive whole numbers, comma-separated"),
        (["--num-prompts", "0"], "--num-prompts '0': needs a positive whole number"),
        (["--prompts", "/nonexistent.jsonl"], "/nonexistent.jsonl: cannot be read"),
        (["--prompts", "{tmp}/plain.txt"], 'line 1 is not a JSON object with a "prompt" text'),
        (["--prompts", "{tmp}"], "cannot be read"),
        (["--prompts", "{tmp}/bad.jsonl"], 'line 2 is not a JSON object with a "prompt" text'),
        (["--prompts", "{tmp}/empty.jsonl"], "holds no prompts"),
        # vLLM's reader skips each: nothing was sent (issue 45).
        (["--prompts", "{tmp}/blank.jsonl"], "{tmp}/blank.jsonl: no prompt has 4 words"),
        (["--prompts", "{tmp}/short.jsonl"], "{tmp}/short.jsonl: no prompt has 4 words"),
        # The limit said as the prompts file's, not "a config file's" (issue 45).
        (["--prompts", "{tmp}/huge.jsonl"], "over the 1048576-byte limit of a prompts file"),
        ([*SERVE, "--headless"], "needs an API server, which --headless leaves out"),
    ],
)
def test_serving_usage_errors_are_one_line_exit_2(
    tmp_path: Path, bench_env: Path, args: list[str], part: str
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n["not", "an", "object"]\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "plain.txt").write_text("Why is the sky blue?\n")
    (tmp_path / "blank.jsonl").write_text('{"prompt": ""}\n{"prompt": "  "}\n')
    (tmp_path / "short.jsonl").write_text('{"prompt": "Why?"}\n{"prompt": "Say hi"}\n')
    with open(tmp_path / "huge.jsonl", "wb") as huge:
        huge.truncate(100 << 20)  # 100 MB, sparse
    given = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    part = part.replace("{tmp}", str(tmp_path))
    command = given if given[:1] == ["serve"] else [*given, *SERVE]
    result = tune(tmp_path, bench_env, "iomp-faster", *command)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and part in result.stderr, result.stderr
    assert not (tmp_path / "record" / "runs.jsonl").exists()


def test_the_shipped_prompts_hold_both_kinds_of_request() -> None:
    """Half quote or edit their own text (ngram drafts from it), half are open-ended."""
    rows = [json.loads(line) for line in Path(SHIPPED).read_text().splitlines()]
    kinds = [row["kind"] for row in rows]
    assert kinds.count("quote") == kinds.count("open") >= 8
    assert all(isinstance(row["prompt"], str) and row["prompt"] for row in rows)

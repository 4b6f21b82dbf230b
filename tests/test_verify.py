"""`verify PID`: real process trees with real OpenMP runtimes mapped.

A script named `vllm` (run by Python, so its command line looks like a vLLM console
script's) starts children as described by the test, each with its own LD_PRELOAD
and, optionally, a runtime loaded late with ctypes; every process says "ready" only
after its runtimes are mapped. Intel OpenMP is the real libiomp5.so of the
intel-openmp wheel, GNU OpenMP the system's libgomp.so.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AS_NOBODY, LAUNCHER, clean_environ, launcher_opens, run_launcher

GOMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
SD = '{"method": "ngram", "num_speculative_tokens": 3}'
TREE = """\
import ctypes, json, os, subprocess, sys, time
if "LISTEN_FD" in os.environ or "LISTEN_UDS" in os.environ:
    exec(os.environ["LISTEN"])
CHILD = '''
import ctypes, os, sys, time
if os.environ.get("LOAD_LATE"):
    ctypes.CDLL(os.environ["LOAD_LATE"])
if os.environ.get("RENAME"):  # as vLLM renames its processes, over argv and environ
    import setproctitle
    setproctitle.setproctitle(os.environ["RENAME"])
print("ready", flush=True)
time.sleep(600)
'''
children = []
for spec in json.loads(os.environ.get("CHILDREN", "[]")):
    env = dict(os.environ)
    for key, value in spec.get("env", {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.pop("CHILDREN", None)
    if spec.get("rename"):
        env["RENAME"] = spec["rename"]
    # A title takes argv[0]'s place in /proc/PID/cmdline, as vLLM's setproctitle does.
    command = [spec.get("title", sys.executable), "-c", CHILD, *spec.get("args", [])]
    child = subprocess.Popen(
        command, executable=sys.executable, env=env, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "ready\\n"
    children.append(child.pid)
print("ready", *children, flush=True)
time.sleep(600)
"""


# The root as vLLM's API server: it listens on the socket the test bound (LISTEN_FD) or
# on a unix socket (LISTEN_UDS) and answers GET /metrics with the file METRICS, read at
# each request; with DRIP, a byte a second for ever.
LISTEN = """\
import http.server, socket, threading
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        try:
            if os.environ.get("DRIP"):
                self.wfile.write(b"HTTP/1.0 200 OK\\r\\n\\r\\n")
                while True:
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(1)
            with open(os.environ["METRICS"], "rb") as stream:
                body = stream.read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass
    def log_message(self, *args):
        pass
if "LISTEN_FD" in os.environ:
    listener = socket.socket(fileno=int(os.environ.pop("LISTEN_FD")))
else:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.environ.pop("LISTEN_UDS"))
listener.listen()
server = http.server.ThreadingHTTPServer(("", 0), Metrics, bind_and_activate=False)
server.socket.close()
server.socket = listener
threading.Thread(target=server.serve_forever, daemon=True).start()
"""


@pytest.fixture
def gomp() -> str:
    if not os.path.exists(GOMP):
        pytest.fail(f"{GOMP} missing: apt-get install libgomp1")
    return GOMP


@pytest.fixture
def start_tree(tmp_path: Path) -> Iterator[Callable[..., list[int]]]:
    """Start `vllm ARGS` with children; returns [root pid, child pids...]; kills them after."""
    started: list[subprocess.Popen[str]] = []
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(TREE)

    def start(
        args: list[str],
        children: list[dict[str, Any]],
        cwd: Path | None = None,
        listen: socket.socket | None = None,
        **environ: str | None,
    ) -> list[int]:
        """`listen`: a bound socket the root listens on, as vLLM's API server."""
        env = clean_environ(tmp_path, CHILDREN=json.dumps(children), LISTEN=LISTEN)
        if listen is not None:
            env["LISTEN_FD"] = str(listen.fileno())
        for key, value in environ.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        process = subprocess.Popen(
            [sys.executable, str(script), *args],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=cwd,
            pass_fds=() if listen is None else (listen.fileno(),),
        )
        started.append(process)
        assert process.stdout is not None
        words = process.stdout.readline().split()
        assert words[:1] == ["ready"], words
        return [process.pid, *map(int, words[1:])]

    yield start
    for process in started:
        os.killpg(process.pid, signal.SIGKILL)  # the tree this test started, by its id
        process.wait()


def verify(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_launcher(["verify", *args], clean_environ(tmp_path))


def verify_json(tmp_path: Path, pid: int) -> tuple[int, dict[str, Any]]:
    result = verify(tmp_path, "--json", str(pid))
    assert result.returncode in (0, 1), result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, report


def by_pid(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["pid"]: p for p in report["processes"]}


SERVE_SD = ["serve", "m", "--speculative-config", SD]


def test_sd_tree_with_intel_openmp_everywhere_is_ok(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    pids = start_tree(SERVE_SD, [{}, {}], LD_PRELOAD=str(real_iomp), KMP_BLOCKTIME="5")
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0 and report["ok"] is True
    assert report["speculative"] == {"requested": True, "source": "--speculative-config"}
    processes = by_pid(report)
    assert sorted(processes) == sorted(pids)
    for pid in pids:
        process = processes[pid]
        assert process["verdict"] == "ok", process
        assert process["speculative"] is True  # children inherit the root's verdict
        assert {"kind": "iomp", "path": str(real_iomp)} in process["runtimes"]
        assert process["env"]["LD_PRELOAD"] == str(real_iomp)
        assert process["env"]["KMP_BLOCKTIME"] == "5"
    assert processes[pids[1]]["ppid"] == pids[0]
    text = verify(tmp_path, str(pids[0]))
    assert text.returncode == 0
    assert "speculative decoding: requested (--speculative-config)" in text.stdout
    assert "ok: 3 processes judged, 3 checked" in text.stdout


def test_child_with_only_libgomp_fails(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path, gomp: str
) -> None:
    children = [{}, {"env": {"LD_PRELOAD": gomp}}]
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=str(real_iomp))
    code, report = verify_json(tmp_path, pids[0])
    assert code == 1 and report["ok"] is False
    processes = by_pid(report)
    assert processes[pids[0]]["verdict"] == "ok"
    assert processes[pids[1]]["verdict"] == "ok"
    bad = processes[pids[2]]
    assert bad["verdict"] == "problem"
    assert bad["runtimes"] == [{"kind": "gomp", "path": os.path.realpath(gomp)}]
    assert "GNU libgomp only" in bad["reason"]
    text = verify(tmp_path, str(pids[0]))
    assert text.returncode == 1
    assert "PROBLEM: 1 of 3 judged processes lack Intel OpenMP" in text.stdout


def test_intel_openmp_loaded_late_beside_libgomp_fails(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path, gomp: str
) -> None:
    """Mapped but not preloaded: libgomp was bound first and serves the process."""
    children = [{"env": {"LD_PRELOAD": gomp, "LOAD_LATE": str(real_iomp)}}]
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=str(real_iomp))
    code, report = verify_json(tmp_path, pids[0])
    assert code == 1
    child = by_pid(report)[pids[1]]
    assert {r["kind"] for r in child["runtimes"]} == {"iomp", "gomp"}
    assert "not preloaded" in child["reason"]


def test_sd_root_started_without_openmp_fails(
    tmp_path: Path, start_tree: Callable[..., list[int]]
) -> None:
    pids = start_tree(SERVE_SD, [], LD_PRELOAD=None)
    code, report = verify_json(tmp_path, pids[0])
    assert code == 1
    root = by_pid(report)[pids[0]]
    assert root["runtimes"] == [] and root["verdict"] == "problem"
    assert "without Intel OpenMP in LD_PRELOAD" in root["reason"]


def test_children_without_openmp_are_skipped(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    children = [{"env": {"LD_PRELOAD": None}}]
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=str(real_iomp))
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0
    assert by_pid(report)[pids[1]]["verdict"] == "skipped"


def test_libgomp_is_fine_without_speculative_decoding(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    pids = start_tree(["serve", "m"], [{}], LD_PRELOAD=gomp)
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0 and report["speculative"]["requested"] is False
    assert all(p["verdict"] == "ok" for p in report["processes"])


def test_vllm_config_file_is_read_from_the_process_directory(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    """`--config FILE` is relative to the vLLM process's working directory, not verify's."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "serve.yaml").write_text("max_model_len: 512\nspeculative_config: null\n")
    pids = start_tree(["serve", "m", "--config", "serve.yaml"], [], cwd=workdir, LD_PRELOAD=gomp)
    code, report = verify_json(tmp_path, pids[0])  # run from the test's directory
    assert report["speculative"]["requested"] is False, report["speculative"]
    assert code == 0


def test_each_vllm_config_file_of_a_tree_is_opened_once(
    tmp_path: Path, start_tree: Callable[..., list[int]]
) -> None:
    """Processes that share a --config file share its one reading (issue 47: verify read it
    again for each process); a child with a file of its own gets that file read once."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    shared, own = workdir / "serve.yaml", workdir / "other.yaml"
    shared.write_text("max_model_len: 512\nport: 8123\n")
    own.write_text(f"speculative_config: {SD}\n")
    command = ["serve", "m", "--config", shared.name]
    children = [
        {"args": command},
        {"args": command},
        {"args": ["serve", "m", "--config", own.name]},
    ]
    pids = start_tree(command, children, cwd=workdir)
    result, opens = launcher_opens(
        [shared, own], ["verify", "--json", str(pids[0])], clean_environ(tmp_path)
    )
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    assert report["speculative"]["requested"] is False
    assert [by_pid(report)[pid]["speculative"] for pid in pids] == [False, False, False, True]
    assert report["inside"]["url"] == "http://127.0.0.1:8123/metrics"  # the shared file's port
    assert opens == {str(shared): 1, str(own): 1}


# ---------------------------------------------------------------- errors


def unused_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as stream:
        return int(stream.read()) + 1  # above pid_max: no process can have it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["abc"], "verify: 'abc' is not a process ID"),
        (["-5"], "unknown option '-5' for verify"),
        (
            ["0"],
            "verify: '0' is not a process ID: 0 is what `systemctl show -p MainPID --value "
            "UNIT` prints for a unit that is not running; start the unit",
        ),
        ([str(unused_pid())], f"verify: no process with PID {unused_pid()}"),
        ([], "verify needs one PID"),
        (["1", "2"], "verify needs one PID"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = verify(tmp_path, *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_unprivileged_user_cannot_read_a_root_process(
    start_tree: Callable[..., list[int]], real_iomp: Path, nobody_launcher: list[str]
) -> None:
    pids = start_tree(SERVE_SD, [], LD_PRELOAD=str(real_iomp))
    result = subprocess.run(
        [*AS_NOBODY, *nobody_launcher, "verify", str(pids[0])],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert f"cannot read /proc/{pids[0]}" in result.stderr and "permission denied" in result.stderr
    assert "run verify as the user vLLM runs as (uid 0), or as root" in result.stderr


# Docker's default capabilities for a container's root: none of sys_ptrace, sys_admin or
# perfmon, each of which opens another user's /proc/PID/maps.
DOCKER_CAPABILITIES = (
    "+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,+net_bind_service,"
    "+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap"
)


def verify_nobodys_process(prefix: list[str]) -> subprocess.CompletedProcess[str]:
    """`PREFIX... verify PID` of a process running as uid 65534, killed afterwards."""
    vllm = subprocess.Popen([*AS_NOBODY, "sleep", "600"], start_new_session=True)
    try:
        return subprocess.run(
            [*prefix, "verify", str(vllm.pid)],
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.killpg(vllm.pid, signal.SIGKILL)  # the process this test started, by its id
        vllm.wait()


def test_root_without_the_capability_is_not_told_to_run_as_root(
    nobody_launcher: list[str],
) -> None:
    """A container's root has no CAP_SYS_PTRACE by default: another user's /proc/PID/maps
    is closed to it. vLLM runs as uid 65534 here; verify as root without the capability."""
    drop = ["setpriv", f"--bounding-set=-all,{DOCKER_CAPABILITIES}", "--inh-caps=-all"]
    result = verify_nobodys_process([*drop, *nobody_launcher])
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1
    assert "permission denied although verify runs as root" in result.stderr
    assert "CAP_SYS_PTRACE" in result.stderr
    assert "run verify as the user vLLM runs as (uid 65534)" in result.stderr
    assert "or as root" not in result.stderr
    # What the message says works: the same verify as vLLM's user reads it.
    fixed = verify_nobodys_process([*AS_NOBODY, *nobody_launcher])
    assert fixed.returncode == 0, fixed.stderr


# A tree as uid 65534 whose child (forked: the interpreter may be closed to a second exec
# as that user) closes itself: PR_SET_DUMPABLE (4) 0, as a setuid program's process is,
# hands its /proc files to root.
UNDUMPABLE_TREE = """\
import ctypes, os, time
read, write = os.pipe()
child = os.fork()
if child == 0:
    assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0
    os.write(write, b"x")
    time.sleep(600)
    os._exit(0)
assert os.read(read, 1) == b"x"
print("ready", child, flush=True)
time.sleep(600)
"""


def test_a_descendant_closed_to_verify_is_said_unreadable_and_the_rest_is_read(
    tmp_path: Path, nobody_launcher: list[str]
) -> None:
    """verify, as the user vLLM runs as, reads PID and says why the undumpable child is
    closed to it, not "run verify as the user vLLM runs as" (it does) with exit 2; PID
    itself undumpable is still exit 2, with those words."""
    tree = subprocess.Popen(
        [*AS_NOBODY, nobody_launcher[0], "-c", UNDUMPABLE_TREE],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd="/",
    )
    try:
        assert tree.stdout is not None
        words = tree.stdout.readline().split()
        assert words[:1] == ["ready"], words
        child = int(words[1])
        as_nobody = [*AS_NOBODY, *nobody_launcher]
        result = run_launcher(["verify", "--json", str(tree.pid)], NOBODY_ENVIRON, as_nobody)
        assert result.returncode == 0, result.stderr
        processes = by_pid(json.loads(result.stdout))
        assert processes[tree.pid]["reason"] == "no OpenMP runtime loaded yet"  # read
        closed = processes[child]
        assert closed["verdict"] == "unreadable" and closed["ppid"] == tree.pid
        undumpable = (
            f"cannot read /proc/{child} (maps, environ): permission denied: process {child} "
            "(uid 65534) made itself undumpable (PR_SET_DUMPABLE 0"
        )
        assert closed["reason"].startswith(undumpable), closed["reason"]
        assert closed["reason"].endswith("root with CAP_SYS_PTRACE; run verify as root")
        text = run_launcher(["verify", str(tree.pid)], NOBODY_ENVIRON, as_nobody).stdout
        assert text.endswith("ok: 1 process judged, 1 checked, 1 unreadable\n"), text
        direct = run_launcher(["verify", str(child)], NOBODY_ENVIRON, as_nobody)
        assert direct.returncode == 2 and direct.stderr.count("\n") == 1
        assert undumpable in direct.stderr and "runs as (uid" not in direct.stderr
    finally:
        os.killpg(tree.pid, signal.SIGKILL)  # the tree this test started, by its id
        tree.wait()


NOBODY_ENVIRON = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def test_root_is_not_told_a_root_process_is_another_users(nobody_launcher: list[str]) -> None:
    """Root without CAP_SYS_PTRACE (Docker's capabilities) and a root process holding more:
    the kernel refuses, and the words say why, not "another user's process ... (uid 0)"."""
    with open("/proc/self/status") as stream:
        effective = next(line for line in stream if line.startswith("CapEff:")).split()[1]
    if not int(effective, 16) >> 21 & 1:  # CAP_SYS_ADMIN: one the dropped verify lacks
        pytest.skip("this root holds no capability beyond Docker's default set")
    drop = ["setpriv", f"--bounding-set=-all,{DOCKER_CAPABILITIES}", "--inh-caps=-all"]
    vllm = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        result = run_launcher(["verify", str(vllm.pid)], NOBODY_ENVIRON, [*drop, *nobody_launcher])
    finally:
        os.killpg(vllm.pid, signal.SIGKILL)  # the process this test started, by its id
        vllm.wait()
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result
    assert (
        f"permission denied although verify runs as root, as process {vllm.pid} does: either "
        "it holds capabilities verify lacks or it made itself undumpable"
    ) in result.stderr
    assert result.stderr.rstrip().endswith("; run verify with CAP_SYS_PTRACE")
    assert "another user's" not in result.stderr


def test_a_kernel_thread_is_said_to_be_one_not_to_have_exited(tmp_path: Path) -> None:
    """A kernel thread (kthreadd is PID 2 on a host) has no memory to read: no program."""
    for entry in sorted(os.listdir("/proc"), key=lambda name: (len(name), name)):
        if not entry.isdigit():
            continue
        try:
            stat = (Path("/proc") / entry / "stat").read_bytes()
        except OSError:
            continue
        if int(stat.rpartition(b")")[2].split()[6]) & 0x00200000:  # PF_KTHREAD
            break
    else:
        pytest.skip("no kernel thread visible in this PID namespace (a container's)")
    result = verify(tmp_path, entry)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result
    assert f"verify: process {entry} (" in result.stderr
    assert ") is a kernel thread, which runs no program: give vLLM's PID" in result.stderr


def test_help(tmp_path: Path) -> None:
    result = verify(tmp_path, "--help")
    assert result.returncode == 0 and "usage: vllm-cpu-launch verify" in result.stdout


def test_a_long_command_is_cut_with_a_marker_and_whole_in_json(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """The SD JSON's closing quote must not silently vanish at column 100."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    args = ["serve", "/srv/models/" + "m" * 60, "--speculative-config", spec]
    pids = start_tree(args, [], LD_PRELOAD=str(real_iomp))
    _, report = verify_json(tmp_path, pids[0])
    assert by_pid(report)[pids[0]]["cmdline"][-len(args) :] == args
    text = verify(tmp_path, str(pids[0])).stdout
    (line,) = (line for line in text.splitlines() if line.lstrip().startswith(str(pids[0])))
    assert "... [" in line and "more characters; --json shows them all]" in line
    head = f"{pids[0]:>7}  ok       api-server (parent {os.getpid()}): "
    assert len(line.partition("... [")[0]) <= 100 + len(head)


def test_where_vllm_runs_engine_and_workers_only_they_are_judged(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path, gomp: str
) -> None:
    """As with vLLM's plugin: the API server keeps libgomp, the processes titled
    VLLM::EngineCore and VLLM::Worker_TP0 started with Intel OpenMP preloaded."""
    iomp = {"LD_PRELOAD": str(real_iomp)}
    children = [
        {"title": "VLLM::EngineCore", "env": iomp},
        {"title": "VLLM::Worker_TP0", "env": iomp},
        {"title": "VLLM::DPCoordinator", "env": {"LD_PRELOAD": gomp}},
    ]
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=gomp)
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0, report
    processes = by_pid(report)
    roles = [(processes[pid]["role"], processes[pid]["verdict"]) for pid in pids]
    assert roles == [
        ("api-server", "reported"),
        ("engine-core", "ok"),
        ("worker", "ok"),
        ("other", "reported"),
    ]
    assert processes[pids[0]]["reason"] == (
        f"GNU libgomp {os.path.realpath(gomp)}; runs no model code, so not judged"
    )
    text = verify(tmp_path, str(pids[0]))
    assert "ok: 2 processes judged, 4 checked" in text.stdout
    assert (
        f"{pids[1]:>7}  ok       engine-core (parent {pids[0]}): VLLM::EngineCore -c" in text.stdout
    )
    # A worker on libgomp is a problem, whatever the API server has.
    children[1]["env"] = {"LD_PRELOAD": gomp}
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=str(real_iomp))
    code, report = verify_json(tmp_path, pids[0])
    assert code == 1
    assert [p["verdict"] for p in report["processes"]] == ["reported", "ok", "problem", "reported"]


def test_libgomp_the_plan_kept_on_purpose_is_fine(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    """The launcher marks a plan that keeps libgomp for SD by the user's word (--iomp never):
    the judged processes on libgomp are then as planned, not a problem."""
    children = [{"title": "VLLM::EngineCore"}, {"title": "VLLM::Worker_TP0"}]
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=gomp, VLLMCPULAUNCH_PLANNED="launcher")
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0, report
    worker = by_pid(report)[pids[2]]
    assert worker["verdict"] == "ok"
    assert worker["reason"].startswith("libgomp kept by the plan (VLLMCPULAUNCH_PLANNED=")


@pytest.mark.parametrize("mark", ["launcher:not-found", "launcher:started"])
def test_libgomp_under_a_mark_that_chose_none_is_a_problem(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str, mark: str
) -> None:
    """Where no usable libiomp5 was found the plan's mark says so, and where the launcher
    handed over an OpenMP runtime its mark says it started the process: the plugin leaves
    those processes alone, but a libgomp there is nobody's choice, and the liveness probe
    must say. (The bare mark, `iomp: never`, is a choice: the test above.)"""
    children = [{"title": "VLLM::EngineCore"}, {"title": "VLLM::Worker_TP0"}]
    pids = start_tree(SERVE_SD, children, LD_PRELOAD=gomp, VLLMCPULAUNCH_PLANNED=mark)
    code, report = verify_json(tmp_path, pids[0])
    assert code == 1, report
    assert by_pid(report)[pids[2]]["verdict"] == "problem"


def test_speculative_judges_a_command_line_that_does_not_say_it(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path, gomp: str
) -> None:
    """vLLM's offline API and `vllm bench` take SD in Python or a config file."""
    children = [{"title": "VLLM::EngineCore"}, {"title": "VLLM::Worker_TP0"}]
    pids = start_tree(["serve", "m"], children, LD_PRELOAD=gomp)
    assert verify(tmp_path, str(pids[0])).returncode == 0  # SD not requested: fine
    judged = verify(tmp_path, "--speculative", "--json", str(pids[0]))
    assert judged.returncode == 1, judged.stdout
    report = json.loads(judged.stdout)
    assert report["speculative"] == {"requested": True, "source": "--speculative, given to verify"}
    pids = start_tree(["serve", "m"], children, LD_PRELOAD=str(real_iomp))
    assert verify(tmp_path, "--speculative", str(pids[0])).returncode == 0


def test_a_plain_process_is_the_main_one_and_counted_right(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    """No `vllm serve`: PID is no API server, and one process is one process."""
    pids = start_tree(["run-batch"], [], LD_PRELOAD=gomp)
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0 and by_pid(report)[pids[0]]["role"] == "main"
    text = verify(tmp_path, str(pids[0])).stdout
    assert f"{pids[0]:>7}  ok       main (parent " in text
    assert text.endswith("ok: 1 process judged, 1 checked\n")


MODEL_CHILDREN = [{"title": "VLLM::EngineCore"}, {"title": "VLLM::Worker_TP0"}]


def test_the_plugins_mark_counts_where_only_vllms_children_show_it(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    """The plugin sets its mark in the front end after start-up: PID does not show it, the
    processes vLLM spawned afterwards do (in the tail of their environment, seen on vLLM
    0.32: tests/e2e/test_verify_plugin.py)."""
    marked = [{**child, "env": {"VLLMCPULAUNCH_PLANNED": "plugin"}} for child in MODEL_CHILDREN]
    pids = start_tree(SERVE_SD, marked, LD_PRELOAD=gomp)
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0, report
    assert by_pid(report)[pids[2]]["reason"].startswith(
        "libgomp kept by the plan (VLLMCPULAUNCH_PLANNED=plugin): GNU libgomp "
    )


def test_the_users_iomp_never_counts_where_no_mark_shows(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    """Where no process shows the mark (vLLM's titles can cover all of an environment),
    the user's own `iomp: never` in PID's start-up environment is the evidence."""
    pids = start_tree(SERVE_SD, MODEL_CHILDREN, LD_PRELOAD=gomp, VLLMCPULAUNCH_IOMP="never")
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0, report
    assert by_pid(report)[pids[1]]["reason"] == (
        "libgomp chosen by the user (VLLMCPULAUNCH_IOMP=never): "
        f"GNU libgomp {os.path.realpath(gomp)}"
    )
    # Any other setting leaves libgomp a problem.
    pids = start_tree(SERVE_SD, MODEL_CHILDREN, LD_PRELOAD=gomp, VLLMCPULAUNCH_IOMP="auto")
    assert verify_json(tmp_path, pids[0])[0] == 1


def test_iomp_never_in_the_config_file_pid_names_counts(
    tmp_path: Path, start_tree: Callable[..., list[int]], gomp: str
) -> None:
    """The config file as the plan read it: VLLMCPULAUNCH_CONFIG relative to vLLM's working
    directory (not verify's), and the user config under vLLM's XDG_CONFIG_HOME."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "launcher.yaml").write_text("iomp: never\n")
    pids = start_tree(
        SERVE_SD, MODEL_CHILDREN, cwd=workdir, LD_PRELOAD=gomp, VLLMCPULAUNCH_CONFIG="launcher.yaml"
    )
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0, report
    where = workdir / "launcher.yaml"
    assert f"(iomp: never in {where})" in by_pid(report)[pids[1]]["reason"]
    config = tmp_path / "vllm-user" / "vllm-cpu-launch" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("iomp: never\n")
    pids = start_tree(
        SERVE_SD, MODEL_CHILDREN, LD_PRELOAD=gomp, XDG_CONFIG_HOME=str(config.parents[1])
    )
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0 and f"(iomp: never in {config})" in by_pid(report)[pids[1]]["reason"]


def test_a_process_vllm_renamed_shows_what_it_inherited_not_not_set(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """vLLM's title (setproctitle, as vLLM calls it) overwrites /proc/PID/environ: verify
    says so, shows the start-up environment of the parent that spawned the process, and
    what vLLM writes over it in a worker (vllm/utils/ompmultiprocessing.py)."""
    children = [{"rename": "VLLM::EngineCore"}, {"rename": "VLLM::Worker_TP0"}]
    start = {"LD_PRELOAD": str(real_iomp), "KMP_BLOCKTIME": "200"}
    pids = start_tree(SERVE_SD, children, **start)
    environ = (Path("/proc") / str(pids[2]) / "environ").read_bytes()
    assert b"LD_PRELOAD=" not in environ, environ  # the title really took the environment
    code, report = verify_json(tmp_path, pids[0])
    assert code == 0, report
    worker = by_pid(report)[pids[2]]
    assert worker["role"] == "worker" and "LD_PRELOAD" not in worker["env"]
    assert worker["environment"]["readable"] is False
    assert worker["environment"]["why"].startswith("vLLM renamed the process (VLLM::Worker_TP0)")
    assert worker["environment"]["inherited"] == {"from_pid": pids[0], "env": start}
    assert "KMP_BLOCKTIME=5, KMP_TPAUSE=0" in worker["environment"]["vllm_sets"]
    assert "vllm_sets" not in by_pid(report)[pids[1]]["environment"]  # the engine core
    text = verify(tmp_path, str(pids[0])).stdout
    worker_text = text.partition(f"{pids[2]:>7}  ")[2].partition("\nok: ")[0]
    assert "no LD_PRELOAD, KMP_* or OMP_NUM_THREADS set" not in worker_text, worker_text
    assert "environment unreadable: vLLM renamed the process (VLLM::Worker_TP0)" in worker_text
    inherited = f"inherited at spawn from PID {pids[0]}'s start-up environment"
    assert f"{inherited} (changes it made after start-up" in worker_text
    assert f"LD_PRELOAD={real_iomp} KMP_BLOCKTIME=200" in worker_text
    # Under nobind vLLM writes nothing: what the worker inherited is what it runs with.
    pids = start_tree(SERVE_SD, children, VLLM_CPU_OMP_THREADS_BIND="nobind", **start)
    _, report = verify_json(tmp_path, pids[0])
    vllm_sets = by_pid(report)[pids[2]]["environment"]["vllm_sets"]
    assert vllm_sets.startswith("nothing (VLLM_CPU_OMP_THREADS_BIND=nobind)")


def wait_for_exec(pid: int, program: str) -> None:
    """Until PID runs PROGRAM: the launcher says its line just before its execve."""
    while os.readlink(f"/proc/{pid}/exe") != program:
        time.sleep(0.01)


def test_a_program_the_launcher_started_as_iomp_never_says_is_ok(tmp_path: Path) -> None:
    """`--iomp never exec -- PROGRAM`: the plan preloads nothing and marks the process; a
    tree started as its plan says exits 0, and the reason says what is true (no OpenMP
    runtime loaded, none preloaded by the plan's choice), not "libgomp"."""
    started = subprocess.Popen(
        [*LAUNCHER, "--iomp", "never", "exec", "--", "/bin/sleep", "600"],
        env=clean_environ(tmp_path),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert started.stderr is not None
        assert "--iomp never; starting /bin/sleep unchanged" in started.stderr.readline()
        wait_for_exec(started.pid, os.path.realpath("/bin/sleep"))
        result = verify(tmp_path, "--speculative", "--json", str(started.pid))
        assert result.returncode == 0, result.stdout
        (process,) = json.loads(result.stdout)["processes"]
        assert process["env"] == {"VLLMCPULAUNCH_PLANNED": "launcher"}  # the exec'd sleep
        assert process["reason"] == (
            "no OpenMP runtime loaded yet; none preloaded, as the plan chose "
            "(VLLMCPULAUNCH_PLANNED=launcher)"
        )
        text = verify(tmp_path, "--speculative", str(started.pid)).stdout
        assert text.endswith("ok: 1 process judged, 1 checked\n") and "libgomp" not in text
    finally:
        os.killpg(started.pid, signal.SIGKILL)  # the process this test started, by its id
        started.wait()


# ---------------------------------------------------------------- read from inside


@pytest.fixture
def metrics_server() -> Iterator[Callable[[list[str]], int]]:
    """A real HTTP server on 127.0.0.1 answering GET /metrics with the text it is given
    (the list's last, read at each request), as vLLM's front end answers with the
    plugin's series; returns its port."""
    served: list[ThreadingHTTPServer] = []

    def serve(text: list[str]) -> int:
        class Metrics(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = text[-1].encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        served.append(server)
        return server.server_address[1]

    yield serve
    for server in served:
        server.shutdown()
        server.server_close()


def series(**labels: str) -> str:
    pairs = ",".join(f'{name}="{value}"' for name, value in labels.items())
    return f"vllm_cpu_launch_openmp_info{{{pairs}}} 1.0"


def bound_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, for the tree's root to listen on."""
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    return bound


def test_the_plugins_reading_from_inside_is_read_from_metrics_and_shown_per_process(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """verify finds the port on the API server's command line (`--port=N`, `--port N`),
    reads /metrics from the socket the server holds, and puts each series beside the
    process whose pid it names."""
    metrics = tmp_path / "metrics"
    metrics.write_text("")  # a server without the series first
    with bound_port() as bound:
        port = bound.getsockname()[1]
        iomp = {"LD_PRELOAD": str(real_iomp), "METRICS": str(metrics)}
        pids = start_tree([*SERVE_SD, f"--port={port}"], MODEL_CHILDREN, listen=bound, **iomp)
    _, report = verify_json(tmp_path, pids[0])
    assert report["inside"] == {
        "url": f"http://127.0.0.1:{port}/metrics",
        "read": False,
        "why": "no vllm_cpu_launch_openmp_info in it: the plugin is not installed",
    }
    text = verify(tmp_path, str(pids[0])).stdout
    note = f"no inside reading from http://127.0.0.1:{port}/metrics (no vllm_cpu_launch_openmp"
    assert text.count(note) == 1, text
    with bound_port() as bound:
        port = bound.getsockname()[1]
        command = [*SERVE_SD, "--host", "127.0.0.1", "--port", str(port)]
        pids = start_tree(command, MODEL_CHILDREN, listen=bound, **iomp)
    library = "/v/lib/lib iomp5.so"  # a space, and an escaped quote below
    worker = {"role": "worker", "pid": str(pids[2]), "runtime": "intel", "library": library}
    worker |= {"blocktime_ms": "200", "threads": "1", "bind": "nobind"}
    engine = {"role": "engine-core", "pid": str(pids[1]), "runtime": "gnu"}
    engine |= {"library": '/x/\\"q\\"/libgomp.so.1', "blocktime_ms": "", "threads": "4"}
    lines = [
        "# HELP vllm_cpu_launch_openmp_info The OpenMP runtime serving each vLLM process",
        "# TYPE vllm_cpu_launch_openmp_info gauge",
        series(**worker),
        series(**engine, bind=""),
        'vllm_other_metric{pid="1"} 2.0',
    ]
    metrics.write_text("\n".join(lines) + "\n")
    _, report = verify_json(tmp_path, pids[0])
    assert report["inside"]["read"] is True and report["inside"]["why"] is None
    processes = by_pid(report)
    assert processes[pids[2]]["inside"] == worker
    assert processes[pids[1]]["inside"]["library"] == '/x/"q"/libgomp.so.1'
    assert processes[pids[0]]["inside"] is None  # the front end published none here
    text = verify(tmp_path, str(pids[0])).stdout
    assert (
        f"read from inside (worker, /metrics): intel serves ({library}), block time 200 ms, "
        "1 thread, bind nobind"
    ) in text
    assert "no inside reading" not in text


def test_a_listener_not_of_the_tree_is_not_read(
    tmp_path: Path,
    start_tree: Callable[..., list[int]],
    real_iomp: Path,
    metrics_server: Callable[[list[str]], int],
) -> None:
    """Whoever else listens on vLLM's port supplies no "read from inside" lines: the
    socket must be one a process of the tree holds."""
    forged = [""]
    port = metrics_server(forged)
    pids = start_tree([*SERVE_SD, "--port", str(port)], [], LD_PRELOAD=str(real_iomp))
    forged.append(series(pid=str(pids[0]), runtime="intel", blocktime_ms="200", threads="2"))
    _, report = verify_json(tmp_path, pids[0])
    assert report["inside"]["read"] is False and by_pid(report)[pids[0]]["inside"] is None
    assert report["inside"]["why"] == (
        f"no process of this tree listens on port {port}; verify reads /metrics only from "
        "a socket vLLM holds"
    )
    text = verify(tmp_path, str(pids[0])).stdout
    assert "read from inside" not in text
    assert text.count(f"no inside reading from http://127.0.0.1:{port}/metrics (no process") == 1


def test_the_port_in_the_vllm_config_file_is_the_one_read(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """`--config FILE` (from vLLM's working directory) gives the port as the plan reads it."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    metrics = tmp_path / "metrics"
    metrics.write_text("")
    with bound_port() as bound:
        port = bound.getsockname()[1]
        (workdir / "serve.yaml").write_text(f"host: 127.0.0.1\nport: {port}\n")
        command = [*SERVE_SD, "--config", "serve.yaml"]
        pids = start_tree(
            command, [], cwd=workdir, listen=bound, LD_PRELOAD=str(real_iomp), METRICS=str(metrics)
        )
    metrics.write_text(series(role="api-server", pid=str(pids[0]), runtime="intel") + "\n")
    _, report = verify_json(tmp_path, pids[0])
    assert report["inside"] == {
        "url": f"http://127.0.0.1:{port}/metrics",
        "read": True,
        "why": None,
    }
    assert by_pid(report)[pids[0]]["inside"]["runtime"] == "intel"


def test_uds_is_read_only_where_the_tree_listens_on_it(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """`--uds PATH` (relative to vLLM's working directory): the socket there, if the
    process that listens on it is of the tree; another's is not read."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    metrics = tmp_path / "metrics"
    path = workdir / "vllm.sock"
    environ = {"LD_PRELOAD": str(real_iomp), "METRICS": str(metrics), "LISTEN_UDS": str(path)}
    pids = start_tree([*SERVE_SD, "--uds", "vllm.sock"], [], cwd=workdir, **environ)
    metrics.write_text(series(role="api-server", pid=str(pids[0]), runtime="intel") + "\n")
    _, report = verify_json(tmp_path, pids[0])
    url = f"http://localhost/metrics on unix socket {path}"
    assert report["inside"] == {"url": url, "read": True, "why": None}
    text = verify(tmp_path, str(pids[0])).stdout
    assert f"read from inside: the plugin's series on {url}" in text
    with socket.socket(socket.AF_UNIX) as foreign:
        foreign.bind(str(workdir / "other.sock"))
        foreign.listen()
        pids = start_tree([*SERVE_SD, "--uds", "other.sock"], [], cwd=workdir)
        _, report = verify_json(tmp_path, pids[0])
    why = f"process {os.getpid()}, not one of this tree, listens on {workdir / 'other.sock'}"
    assert report["inside"]["read"] is False and report["inside"]["why"] == why


def test_a_server_that_drips_its_answer_is_left_at_the_deadline(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """A byte a second, for ever: verify's one deadline covers the whole request (each
    read's own timeout never ran out). The subprocess timeout only bounds a hang."""
    with bound_port() as bound:
        port = bound.getsockname()[1]
        pids = start_tree(
            [*SERVE_SD, "--port", str(port)], [], listen=bound, LD_PRELOAD=str(real_iomp), DRIP="1"
        )
    result = subprocess.run(
        [*LAUNCHER, "verify", str(pids[0])],
        env=clean_environ(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    note = f"no inside reading from http://127.0.0.1:{port}/metrics (no whole answer within 5 s)"
    assert result.stdout.count("no inside reading") == 1 and note in result.stdout


def test_without_a_server_there_is_one_note_not_an_error(
    tmp_path: Path, start_tree: Callable[..., list[int]], real_iomp: Path
) -> None:
    """vLLM's default port, nothing of the tree listening there."""
    pids = start_tree(SERVE_SD, MODEL_CHILDREN, LD_PRELOAD=str(real_iomp))
    result = verify(tmp_path, str(pids[0]))
    assert result.returncode == 0 and result.stderr == ""
    note = "no inside reading from http://127.0.0.1:8000/metrics (no process of this tree "
    assert result.stdout.count(note + "listens on port 8000;") == 1

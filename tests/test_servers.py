"""`servers N` (issue 46, item 5): N servers of one model on disjoint CPUs, planned from the
shape, rendered as text, json, env's formats and a systemd template with drop-ins that
systemd itself reads. The launcher runs as a fresh process on this host; a two-node host
with SMT siblings, which this one cannot be, is a tree laid out like /sys and /proc read
under a `root`, as tests/test_shape.py reads one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from vllm_cpu_launch import launch
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.records import replace
from vllm_cpu_launch.shape import SERVER_CPUS, id_list, id_words, read_shape
from vllm_cpu_launch.verbs.servers import KV_VARIABLE, PORT_VARIABLE, plan_servers

from .conftest import clean_environ, run_launcher
from .test_shape import numa_host, tree
from .test_systemd_unit import effective, systemd_dump, verify_unit
from .test_verify import MODEL_CHILDREN, start_tree, verify, verify_json  # noqa: F401 (a fixture)

BIND = "VLLM_CPU_OMP_THREADS_BIND"
# Two nodes of two cores each, SMT siblings numbered as Intel's are (cpuK and cpuK+4).
NODES = {0: "0-1,4-5", 1: "2-3,6-7"}
SIBLINGS = {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)}


def two_node_host(root: Path, mems: str = "0-1", gib: int = 16) -> Path:
    files = {
        f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list": siblings
        for cpu, siblings in SIBLINGS.items()
    }
    for node in NODES:
        kb = gib * 2**20
        files[f"sys/devices/system/node/node{node}/meminfo"] = f"Node {node} MemTotal: {kb} kB\n"
    return tree(numa_host(root, {n: c for n, c in NODES.items()}, mems), files)


def faked(tmp_path: Path, vllm_env: Path, count: int, **environ: str) -> list[dict[str, object]]:
    root = two_node_host(tmp_path / "host")
    host = replace(
        launch.current_host(),
        environ=clean_environ(tmp_path, **environ),
        cpus=8,
        shape=read_shape(range(8), str(root)),
    )
    values: dict[str, object] = {"vllm": str(vllm_env / "bin" / "vllm")}
    servers = plan_servers(values, count, ["serve", "m"], host, str(root))
    return [
        {
            "cpus": s.cpus,
            "memory": s.memory_nodes,
            "env": {k: v for k, v in s.env if k != SERVER_CPUS or v != id_words(s.cpus)},
            "port": s.port,
            "plan cpus": s.plan.shape and s.plan.shape.cpus,
            "command": s.plan.command[1:],
        }
        for s in servers
    ]


def test_two_servers_on_a_two_node_host_get_a_node_each(tmp_path: Path, vllm_env: Path) -> None:
    """One node each; the binding is vLLM's auto choice inside it (a core's last sibling,
    the last core's left to the engine core); alone on its node, vLLM sizes its KV cache."""
    first, second = faked(tmp_path, vllm_env, 2)
    assert (first["cpus"], first["memory"], first["env"]) == ((0, 1, 4, 5), (0,), {BIND: "4"})
    assert (second["cpus"], second["memory"], second["env"]) == ((2, 3, 6, 7), (1,), {BIND: "6"})
    assert [first["plan cpus"], second["plan cpus"]] == [first["cpus"], second["cpus"]]
    assert [first["port"], second["port"]] == [8000, 8001]
    assert second["command"] == ("serve", "m", "--port", "8001")


def test_four_servers_split_each_node_by_cores_siblings_together(
    tmp_path: Path, vllm_env: Path
) -> None:
    servers = faked(tmp_path, vllm_env, 4, **{"VLLM_CPU_KVCACHE_SPACE": ""})
    assert [s["cpus"] for s in servers] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [s["memory"] for s in servers] == [(0,), (0,), (1,), (1,)]
    # Two servers a node of 16 GiB: half of each one's 8 GiB, not vLLM's 92% of the node.
    assert [s["env"] for s in servers] == [{BIND: str(c), KV_VARIABLE: "4"} for c in (4, 5, 6, 7)]


def test_three_servers_give_the_first_node_two(tmp_path: Path, vllm_env: Path) -> None:
    servers = faked(tmp_path, vllm_env, 3)
    assert [s["cpus"] for s in servers] == [(0, 4), (1, 5), (2, 3, 6, 7)]
    assert [s["env"].get(KV_VARIABLE) for s in servers] == ["4", "4", None]  # type: ignore[attr-defined]


def test_more_servers_than_cores_is_one_line(tmp_path: Path, vllm_env: Path) -> None:
    with pytest.raises(LaunchError) as raised:
        faked(tmp_path, vllm_env, 5)
    assert raised.value.code == EXIT_USAGE
    assert "8 CPUs (0-7), 4 cores with their SMT siblings" in raised.value.message
    assert raised.value.message.endswith("plan at most 4")


def test_a_visible_node_list_of_yours_missing_a_server_is_refused(
    tmp_path: Path, vllm_env: Path
) -> None:
    with pytest.raises(LaunchError) as raised:
        faked(tmp_path, vllm_env, 2, CPU_VISIBLE_MEMORY_NODES="0")
    assert raised.value.code == EXIT_USAGE
    assert "CPU_VISIBLE_MEMORY_NODES=0 (yours, kept) holds no node of server 1" in str(raised.value)
    assert len(faked(tmp_path, vllm_env, 2, CPU_VISIBLE_MEMORY_NODES="0,1")) == 2


# This host, as a fresh process.
def cores_here() -> int:
    cpus = os.sched_getaffinity(0)
    path = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    read = [
        Path(path.format(c)).read_text() if Path(path.format(c)).exists() else str(c) for c in cpus
    ]
    return len({tuple(c for c in id_list(t.strip(), "-") if c in cpus) for t in read})


@pytest.fixture
def two_here() -> None:
    if cores_here() < 2:
        pytest.skip("this process may run on fewer than 2 cores: no 2 disjoint servers here")


def servers_here(
    tmp_path: Path, vllm_env: Path, *args: str, **environ: str
) -> tuple[int, str, str]:
    vllm = ["--vllm", str(vllm_env / "bin" / "vllm")]
    result = run_launcher(
        ["servers", *args[:1], *vllm, *args[1:]], clean_environ(tmp_path, **environ)
    )
    return result.returncode, result.stdout, result.stderr


def test_two_servers_here_json(tmp_path: Path, vllm_env: Path, two_here: None) -> None:
    code, out, err = servers_here(tmp_path, vllm_env, "2", "--format", "json", "serve", "m")
    assert code == 0, err
    said = json.loads(out)
    allowed = sorted(os.sched_getaffinity(0))
    assert said["shape"]["cpus"] == allowed
    first, second = said["servers"]
    assert not set(first["cpus"]) & set(second["cpus"])
    assert sorted(first["cpus"] + second["cpus"]) == allowed
    for server, port in zip((first, second), (8000, 8001), strict=True):
        assert server["port"] == port
        assert server["plan"]["shape"]["cpus"] == server["cpus"]  # planned on its own CPUs
        assert server["plan"]["command"][-2:] == ["--port", str(port)]
        bound = id_list(server["env"][BIND], BIND)
        assert bound and set(bound) <= set(server["cpus"])
        if first["nodes"] == second["nodes"]:  # sharing a memory node: an explicit KV share
            assert int(server["env"][KV_VARIABLE]) >= 1


def test_text_and_env_formats_here(tmp_path: Path, vllm_env: Path, two_here: None) -> None:
    code, text, err = servers_here(tmp_path, vllm_env, "2", "serve", "m", "--port", "9000")
    assert code == 0, err
    assert "server 1: port 9001" in text.splitlines()
    code, shell, err = servers_here(tmp_path, vllm_env, "2", "--format", "shell", "serve", "m")
    assert code == 0, err
    blocks = shell.split("\n\n")
    assert len(blocks) == 2
    for index, block in enumerate(blocks):
        comment, *exports = block.splitlines()
        assert comment.startswith(f"# server {index}: port {8000 + index}, CPUs ")
        assert f"--port {8000 + index}" in comment and "taskset -c" in comment
        assert any(line.startswith(f"export {BIND}=") for line in exports)
    code, kube, err = servers_here(tmp_path, vllm_env, "2", "--format", "kubernetes", "serve", "m")
    assert code == 0, err
    documents = list(yaml.safe_load_all(kube))
    assert len(documents) == 2
    assert all(BIND in [e["name"] for e in d["env"]] for d in documents)


@pytest.mark.parametrize(
    ("args", "environ", "said"),
    [
        (["x", "serve", "m"], {}, "servers needs how many, a whole number from 1, not 'x'"),
        (["0", "serve", "m"], {}, "not '0'"),
        (["2", "serve", "m"], {BIND: "0-1"}, f"{BIND}=0-1 (yours, kept) would bind all 2"),
        (["2", "serve", "m", "--uds", "/run/v.sock"], {}, "--uds puts all 2 servers on one"),
        (["2", "serve", "m", "--port", "65535"], {}, "--port 65535: give the first of 2 ports"),
        (["2", "serve", "m", "-tp", "2"], {}, "servers plans one worker each"),
        (["2", "--format", "systemd", "serve", "m"], {}, "--format systemd writes its units"),
        (["2", "--format", "yaml", "serve", "m"], {}, "--format 'yaml': use one of"),
        (["2", "bench", "m"], {}, "servers needs vLLM's serve command"),
        (["2", "serve", "m"], {KV_VARIABLE: "100000"}, f"{KV_VARIABLE}=100000 (yours, kept)"),
        (["2", "serve", "m"], {KV_VARIABLE: "4.5"}, "vLLM reads whole GiB"),
        (["2", "serve", "m"], {"CPU_VISIBLE_MEMORY_NODES": "7"}, "holds no node of server 0"),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path,
    vllm_env: Path,
    two_here: None,
    args: list[str],
    environ: dict[str, str],
    said: str,
) -> None:
    code, out, err = servers_here(tmp_path, vllm_env, *args, **environ)
    assert code == EXIT_USAGE and out == ""
    (line,) = err.splitlines()
    assert line.startswith("vllm-cpu-launch: error: ") and said in line, line


def test_help_and_a_typo(tmp_path: Path, vllm_env: Path) -> None:
    code, out, _ = servers_here(tmp_path, vllm_env, "--help")
    assert code == 0 and out.startswith("usage: vllm-cpu-launch servers N [--format")
    code, _, err = servers_here(tmp_path, vllm_env, "2", "--formt", "json", "serve", "m")
    assert code == EXIT_USAGE and "did you mean --format?" in err


def test_more_servers_than_cpus_here(tmp_path: Path, vllm_env: Path) -> None:
    count = str(len(os.sched_getaffinity(0)) + 1)
    code, _, err = servers_here(tmp_path, vllm_env, count, "serve", "m")
    assert code == EXIT_USAGE
    assert f"servers {count}: this process may run on" in err and err.count("\n") == 1


def test_your_kv_cache_size_is_kept(tmp_path: Path, vllm_env: Path, two_here: None) -> None:
    code, out, err = servers_here(
        tmp_path, vllm_env, "2", "--format", "json", "serve", "m", **{KV_VARIABLE: "1"}
    )
    assert code == 0, err
    for server in json.loads(out)["servers"]:
        assert KV_VARIABLE not in server["env"]
        assert server["kv_cache"] == f"{KV_VARIABLE}=1 GiB (yours, kept)"
        assert server["plan"]["relies_on"].get(KV_VARIABLE, "1") == "1"


def test_systemd_template_and_drop_ins_pass_verify(
    tmp_path: Path, vllm_env: Path, unit_dir: Path, two_here: None
) -> None:
    """systemd reads the template with each drop-in: the instance's CPUs, memory nodes,
    port and binding, as the json plan has them."""
    args = ["--name", "vq", "--user", "root", "serve", "/models/m"]
    code, out, err = servers_here(
        tmp_path, vllm_env, "2", "--format", "systemd", "--directory", str(unit_dir), *args
    )
    assert code == 0, err
    assert out.splitlines() == [
        str(unit_dir / name)
        for name in ("vq@.service", "vq@0.service.d/server.conf", "vq@1.service.d/server.conf")
    ]
    code, planned, err = servers_here(tmp_path, vllm_env, "2", "--format", "json", *args)
    assert code == 0, err
    for server in json.loads(planned)["servers"]:
        unit = unit_dir / f"vq@{server['index']}.service"
        checked = verify_unit(unit)
        assert (checked.returncode, checked.stderr) == (0, ""), checked.stderr
        dump = systemd_dump(unit)
        # systemd prints a CPU or node set as its ranges, a space between them.
        assert effective(dump, "CPUAffinity") == id_words(server["cpus"]).replace(",", " ")
        assert effective(dump, "NUMAPolicy") == "bind"
        assert effective(dump, "NUMAMask") == id_words(server["memory_nodes"]).replace(",", " ")
        environment = dict(
            line.split(": ", 1)[1].split("=", 1)
            for line in dump.splitlines()
            if line.strip().startswith("Environment: ")
        )
        assert environment[PORT_VARIABLE] == str(server["port"])
        assert environment[BIND] == server["env"][BIND]
        assert environment["HOME"] == f"/var/lib/vq@{server['index']}"
    execstart = (unit_dir / "vq@.service").read_text()
    assert f"-- serve /models/m --port ${{{PORT_VARIABLE}}}\n" in execstart


def test_verify_checks_each_process_keeps_to_its_servers_cpus(
    tmp_path: Path, request: pytest.FixtureRequest, two_here: None
) -> None:
    """A tree whose environment names the CPUs `servers` gave it: verify reads each
    process's Cpus_allowed_list, and one that may run elsewhere is a problem (exit 1)."""
    start: Callable[..., list[int]] = request.getfixturevalue("start_tree")
    cpu, everywhere = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    pids = start(["serve", "m"], MODEL_CHILDREN, **{SERVER_CPUS: str(cpu)})
    for pid in pids:
        os.sched_setaffinity(pid, {cpu})
    code, report = verify_json(tmp_path, pids[0])
    assert (code, report["cpus"]) == (0, {"planned": str(cpu), "outside": {}, "why": None})
    assert "CPUs: every process within" in verify(tmp_path, str(pids[0])).stdout
    os.sched_setaffinity(pids[-1], everywhere)  # the worker, let loose
    code, report = verify_json(tmp_path, pids[0])
    assert (code, report["cpus"]["outside"]) == (1, {str(pids[-1]): id_words(everywhere)})
    result = verify(tmp_path, str(pids[0]))
    assert result.returncode == 1
    assert (
        f"PROBLEM: PID {pids[-1]} may run on CPUs {id_words(everywhere)}, outside the CPUs {cpu}"
        in result.stdout
    )

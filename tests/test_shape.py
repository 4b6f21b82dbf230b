"""The CPUs a launch gets (vllm_cpu_launch/shape.py, issue 46): the readers over trees laid
out like /proc and /sys, the plan's CPU_VISIBLE_MEMORY_NODES (vLLM #43240), and the launcher
as a fresh process in a real cgroup with a real CPU quota and cpuset."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_cpu_launch.plan import plan_as_json, plan_as_text, plan_of
from vllm_cpu_launch.records import replace
from vllm_cpu_launch.shape import (
    STAT,
    VISIBLE_NODES,
    HostCpus,
    HostUse,
    Others,
    Shape,
    Use,
    cgroup_mounts,
    host_use,
    id_list,
    id_words,
    others_line,
    read_others,
    read_shape,
    shape_line,
)

from . import test_plan as contract
from .conftest import LAUNCHER, clean_environ, run_launcher
from .test_plan import PINNED, facts

V1 = "32 23 0:29 {within} /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
V2 = "41 23 0:38 / /sys/fs/cgroup{at} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
OTHER = "30 23 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
STATUS = "Name:\tpython\nCpus_allowed_list:\t0-3\nMems_allowed_list:\t{}\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    """A directory laid out like / with `files` (path under root: text)."""
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def v1_host(root: Path, path: str, quotas: dict[str, str], within: str = "/") -> Path:
    """cgroup v1's cpu controller at /sys/fs/cgroup/cpu,cpuacct, `quotas` by cgroup."""
    files = {
        "proc/self/mountinfo": OTHER + V1.format(within=within),
        "proc/self/cgroup": f"4:memory:/elsewhere\n2:cpu,cpuacct:{path}\n0::/\n",
    }
    for cgroup, quota in quotas.items():
        directory = f"sys/fs/cgroup/cpu,cpuacct/{cgroup.strip('/')}/".replace("//", "/")
        files[directory + "cpu.cfs_quota_us"] = quota
        files[directory + "cpu.cfs_period_us"] = "100000"
    return tree(root, files)


def v2_host(root: Path, path: str, limits: dict[str, str], at: str = "") -> Path:
    files = {"proc/self/mountinfo": V2.format(at=at), "proc/self/cgroup": f"0::{path}\n"}
    for cgroup, limit in limits.items():
        files[f"sys/fs/cgroup{at}/{cgroup.strip('/')}/cpu.max".replace("//", "/")] = limit
    return tree(root, files)


def test_v1_quota_is_the_tightest_along_the_path(tmp_path: Path) -> None:
    """A pod's limit above a container without one (-1) limits the container."""
    quotas = {"/": "-1", "/kube": "300000", "/kube/pod": "150000", "/kube/pod/ctr": "-1"}
    root = v1_host(tmp_path, "/kube/pod/ctr", quotas)
    shape = read_shape({0, 1}, str(root))
    assert (shape.quota, shape.quota_unknown) == (1.5, None)
    assert "limited to 1.5 by the cgroup quota" in shape_line(shape)


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"/a": "max 100000", "/a/b": "50000 100000"}, 0.5),
        ({"/a": "250000 100000", "/a/b": "max 100000"}, 2.5),
        ({"/a": "max 100000", "/a/b": "max 100000"}, None),
        ({}, None),  # a cgroup without the cpu controller has no cpu.max
    ],
)
def test_v2_quota(tmp_path: Path, limits: dict[str, str], expected: float | None) -> None:
    shape = read_shape({0, 1}, str(v2_host(tmp_path, "/a/b", limits)))
    assert (shape.quota, shape.quota_unknown) == (expected, None)
    if expected is None:
        assert "no cgroup quota" in shape_line(shape)


def test_hybrid_host_reads_both_hierarchies_where_mounted(tmp_path: Path) -> None:
    """v2 at /sys/fs/cgroup/unified beside v1's cpu: the tighter of the two, each read
    under the mount point mountinfo names (not /sys/fs/cgroup, where vLLM looks)."""
    v1_host(tmp_path, "/job", {"/job": "150000"})
    v2_host(tmp_path, "/job", {"/job": "120000 100000"}, at="/unified")
    (tmp_path / "proc/self/mountinfo").write_text(
        OTHER + V1.format(within="/") + V2.format(at="/unified")
    )
    (tmp_path / "proc/self/cgroup").write_text("2:cpu,cpuacct:/job\n0::/job\n")
    assert read_shape({0, 1}, str(tmp_path)).quota == 1.2


def test_container_mount_root(tmp_path: Path) -> None:
    """A container's /sys/fs/cgroup/cpu is its own cgroup (mountinfo's root field): the
    path /proc/self/cgroup names lies at the mount point, not below it."""
    root = v1_host(tmp_path, "/docker/abc", {"/": "100000"}, within="/docker/abc")
    assert read_shape({0}, str(root)).quota == 1.0


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ({"sys/fs/cgroup/a/cpu.max": "abc"}, "cpu.max: quota 'abc' over period ''"),
        ({"sys/fs/cgroup/a/cpu.max": "50000 0"}, "cpu.max: quota '50000' over period '0'"),
        ({"sys/fs/cgroup/a/cpu.max": "x 100000"}, "quota 'x' over period '100000'"),
        ({"sys/fs/cgroup/a/cpu.max/x": ""}, "cpu.max: Is a directory"),
        ({"proc/self/mountinfo": ""}, "no cgroup file system with the cpu controller"),
        ({"proc/self/mountinfo": OTHER}, "no cgroup file system with the cpu controller"),
    ],
)
def test_odd_cgroup_files_leave_the_quota_unknown(
    tmp_path: Path, files: dict[str, str], said: str
) -> None:
    """Never "no quota" where it could not be read, never a traceback: one line, why."""
    v2_host(tmp_path, "/a", {})
    if "proc/self/mountinfo" in files:
        (tmp_path / "proc/self/mountinfo").unlink()
    shape = read_shape({0}, str(tree(tmp_path, files)))
    assert shape.quota is None and said in (shape.quota_unknown or "")
    line = shape_line(shape)
    assert f"quota unknown ({shape.quota_unknown})" in line and "\n" not in line


def test_unreadable_proc_files_leave_the_quota_unknown(tmp_path: Path) -> None:
    shape = read_shape({0}, str(tmp_path))
    assert "proc/self/mountinfo: missing" in (shape.quota_unknown or "")
    assert "proc/self/status: missing" in (shape.nodes_unknown or "")


def test_v1_odd_period(tmp_path: Path) -> None:
    root = v1_host(tmp_path, "/j", {"/j": "50000"})
    (root / "sys/fs/cgroup/cpu,cpuacct/j/cpu.cfs_period_us").write_text("often")
    assert "over period 'often'" in (read_shape({0}, str(root)).quota_unknown or "")


def numa_host(root: Path, nodes: dict[int, str], mems: str) -> Path:
    files = {f"sys/devices/system/node/node{n}/cpulist": cpus for n, cpus in nodes.items()}
    files["sys/devices/system/node/possible"] = "0-1"  # not a node: no nodeN directory
    return tree(v2_host(root, "/", {}), {**files, "proc/self/status": STATUS.format(mems)})


def test_nodes_of_the_allowed_cpus_and_the_memory_nodes(tmp_path: Path) -> None:
    """vLLM #43240's host: a cpuset of node 1's CPUs, memory nodes 0-1 allowed."""
    root = numa_host(tmp_path, {0: "0-1", 1: "2-3"}, "0-1")
    shape = read_shape({2, 3}, str(root))
    assert (shape.nodes, shape.memory_nodes, shape.nodes_unknown) == ((1,), (0, 1), None)
    expected = "2 CPUs (2-3), no cgroup quota, NUMA node 1, memory nodes 0-1 allowed"
    assert shape_line(shape) == expected
    both = read_shape({1, 2}, str(root))
    assert shape_line(both) == "2 CPUs (1-2), no cgroup quota, NUMA nodes 0-1"


@pytest.mark.parametrize(
    ("nodes", "mems", "said"),
    [
        ({0: "0-x"}, "0", "node0/cpulist: '0-x' is no list of numbers"),
        ({0: "0-1"}, "all", "Mems_allowed_list: 'all' is no list of numbers"),
    ],
)
def test_odd_node_files(tmp_path: Path, nodes: dict[int, str], mems: str, said: str) -> None:
    shape = read_shape({0}, str(numa_host(tmp_path, nodes, mems)))
    assert said in (shape.nodes_unknown or "")
    assert f"NUMA nodes unknown ({shape.nodes_unknown})" in shape_line(shape)


def test_no_nodes_listed(tmp_path: Path) -> None:
    """A kernel without NUMA lists no node directory: said, nothing guessed."""
    root = tree(v2_host(tmp_path, "/", {}), {"proc/self/status": STATUS.format("0")})
    assert shape_line(read_shape({0}, str(root))).endswith("no NUMA nodes listed")


@given(st.sets(st.integers(0, 300)))
def test_id_lists_round_trip(ids: set[int]) -> None:
    words = id_words(ids)
    assert id_list(words, "-") == tuple(sorted(ids))
    assert words.count("-") <= len(ids) // 2


def test_mountinfo_with_optional_fields() -> None:
    """mountinfo's optional fields (shared:N) sit before the `-` separator."""
    line = "35 24 0:30 / /sys/fs/cgroup/cpu rw shared:9 master:2 - cgroup cgroup rw,cpu\n"
    assert cgroup_mounts(line) == {"1": ("/", "/sys/fs/cgroup/cpu")}


# vLLM #43240: the plan's CPU_VISIBLE_MEMORY_NODES.
SPLIT = Shape((2, 3), None, None, (1,), (0, 1))


def planned(shape: Shape, release: str | None = "0.32.0", **environ: str) -> dict[str, object]:
    given = facts(dict(environ), release=release)
    return plan_as_json(plan_of(replace(given, host=replace(given.host, shape=shape))))


@pytest.mark.parametrize(
    ("shape", "nodes"),
    [
        (SPLIT, "1"),
        (Shape((0,), None, None, (0,), (0, 1)), "0"),  # vLLM's first node holds, a second not
        (Shape((1, 3), None, None, (1, 3), (0, 1, 2, 3)), "1,3"),  # vLLM reads no "1-3"
    ],
)
def test_the_plan_names_the_nodes_of_the_allowed_cpus(shape: Shape, nodes: str) -> None:
    plan = planned(shape)
    assert plan["env"][VISIBLE_NODES] == nodes  # type: ignore[index]
    notes = [n for n in plan["notes"] if VISIBLE_NODES in n]  # type: ignore[attr-defined]
    assert notes and "vLLM #43240" in notes[0]
    assert plan["shape"]["line"] == shape_line(shape)  # type: ignore[index]


@pytest.mark.parametrize(
    ("shape", "release"),
    [
        (SPLIT, "0.26.0"),  # before the release read that has get_visible_memory_node
        (SPLIT, None),  # no release found
        (Shape((0, 1), None, None, (0,), (0,)), "0.32.0"),  # the nodes agree
        (Shape((0,), None, None, (), (0,)), "0.32.0"),  # no node listed
        (Shape((2,), None, None, (1,), (0,)), "0.32.0"),  # node 1 not allowed for memory
        (replace(SPLIT, nodes_unknown="why"), "0.32.0"),
    ],
)
def test_no_visible_nodes_where_none_is_due(shape: Shape, release: str | None) -> None:
    assert VISIBLE_NODES not in planned(shape, release)["env"]  # type: ignore[operator]


def test_a_callers_visible_nodes_are_kept() -> None:
    good, bad, odd = (
        planned(SPLIT, **{VISIBLE_NODES: "1"}),
        planned(SPLIT, **{VISIBLE_NODES: "0"}),
        planned(SPLIT, **{VISIBLE_NODES: "0-1"}),
    )
    for plan in good, bad, odd:
        assert VISIBLE_NODES not in plan["env"]  # type: ignore[operator]
    assert not [w for w in good["warnings"] if VISIBLE_NODES in w]  # type: ignore[attr-defined]
    (warning,) = [w for w in bad["warnings"] if VISIBLE_NODES in w]  # type: ignore[attr-defined]
    assert warning.startswith(f"{VISIBLE_NODES}=0 (yours, kept): node 0 holds none of")
    assert warning.endswith("set it to 1 or unset it")
    (warning,) = [w for w in odd["warnings"] if VISIBLE_NODES in w]  # type: ignore[attr-defined]
    assert "comma list of node numbers" in warning


def test_dry_run_text_says_the_shape() -> None:
    given = facts({})
    text = plan_as_text(plan_of(replace(given, host=replace(given.host, shape=SPLIT))))
    assert f"shape:       {shape_line(SPLIT)}" in text.splitlines()


# The launcher as a fresh process: doctor, --dry-run and rules serve say this host's shape.
def test_every_door_says_the_shape(tmp_path: Path, vllm_env: Path) -> None:
    here = shape_line(read_shape(os.sched_getaffinity(0)))
    environ = clean_environ(tmp_path)
    vllm = ["--vllm", str(vllm_env / "bin" / "vllm")]
    said = {
        "dry-run": run_launcher([*vllm, "--dry-run", "serve", "m"], environ),
        "dry-run json": run_launcher([*vllm, "--dry-run", "--json", "serve", "m"], environ),
        "rules serve": run_launcher(["rules", *vllm, "serve", "m"], environ),
        "doctor": run_launcher([*vllm, "doctor"], environ),
        "doctor json": run_launcher([*vllm, "doctor", "--json"], environ),
    }
    assert {door: r.returncode for door, r in said.items()} == dict.fromkeys(said, 0)
    assert f"shape:       {here}" in said["dry-run"].stdout.splitlines()
    assert f"shape:    {here}" in said["rules serve"].stdout.splitlines()
    assert f"shape      {here}" in said["doctor"].stdout.splitlines()
    for door in "dry-run json", "doctor json":
        assert json.loads(said[door].stdout)["shape"]["line"] == here


def v1_cgroup(controller: str) -> Path | None:
    """Where this process's cgroup v1 `controller` hierarchy is mounted, if it is."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        rest = fields[fields.index("-") + 1 :]
        if rest[0] == "cgroup" and controller in rest[2].split(","):
            return Path(fields[4])
    return None


@pytest.fixture
def limited() -> Iterator[tuple[list[Path], int]]:
    """Real cgroups (v1 cpu and cpuset, or v2 with both) giving half a CPU's time on one
    CPU of this process's: (the cgroup.procs files a child joins, that CPU)."""
    cpu = max(os.sched_getaffinity(0))
    name = f"vllm-cpu-launch-test-{os.getpid()}"
    made: list[Path] = []
    try:
        cpu_v1, cpuset_v1 = v1_cgroup("cpu"), v1_cgroup("cpuset")
        if cpu_v1 and cpuset_v1:
            made = [cpu_v1 / name, cpuset_v1 / name]
            for directory in made:
                directory.mkdir()
            (made[0] / "cpu.cfs_period_us").write_text("100000")
            (made[0] / "cpu.cfs_quota_us").write_text("50000")
            (made[1] / "cpuset.cpus").write_text(str(cpu))
            (made[1] / "cpuset.mems").write_text((cpuset_v1 / "cpuset.mems").read_text())
        else:
            unified = Path("/sys/fs/cgroup")
            (unified / "cgroup.subtree_control").write_text("+cpu +cpuset")
            made = [unified / name]
            made[0].mkdir()
            (made[0] / "cpu.max").write_text("50000 100000")
            (made[0] / "cpuset.cpus").write_text(str(cpu))
        # A process must be able to join them (a v2 host may refuse: EBUSY, EOPNOTSUPP): one
        # that does nothing joins first, so that a refusal is a skip, not the launcher's failure.
        probe = subprocess.Popen(["sleep", "60"])
        try:
            for directory in made:
                (directory / "cgroup.procs").write_text(str(probe.pid))
        finally:
            probe.kill()
            probe.wait()
    except OSError as error:
        for directory in reversed(made):
            if directory.exists():
                directory.rmdir()
        pytest.skip(f"this host gives no cgroup with a CPU quota and cpuset to make: {error}")
    yield [directory / "cgroup.procs" for directory in made], cpu
    for directory in made:
        directory.rmdir()


def test_dry_run_in_a_real_cgroup(
    tmp_path: Path, vllm_env: Path, limited: tuple[list[Path], int]
) -> None:
    """The launcher started in a cgroup with a 0.5 CPU quota and a cpuset of one CPU says
    both in its plan: read from the kernel, not from a tree laid out by the test."""
    procs, cpu = limited
    joins = " && ".join(f"echo $$ > {shlex.quote(str(p))}" for p in procs)
    wrapper = ("sh", "-c", f'{joins} && exec "$@"', "sh", *LAUNCHER)
    arguments = ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "--json", "serve", "m"]
    result = run_launcher(arguments, clean_environ(tmp_path), launcher=wrapper)
    assert result.returncode == 0, result.stderr
    shape = json.loads(result.stdout)["shape"]
    assert (shape["cpus"], shape["quota"], shape["quota_unknown"]) == ([cpu], 0.5, None)
    assert shape["line"].startswith(f"1 CPU ({cpu}), limited to 0.5 by the cgroup quota, ")
    # With SD, whose the CPUs are: the quota's share, seen without watching the host.
    sd = [*arguments[:-2], "--host-cpus", "auto", *SD_COMMAND]
    result = run_launcher(sd, clean_environ(tmp_path), launcher=wrapper)
    assert result.returncode == 0, result.stderr
    use = json.loads(result.stdout)["host_use"]
    assert use == {"kind": "quota", "why": "a cgroup quota of 0.5 of 1 CPUs"}


map_vllm = contract.map_vllm  # the fixture: vLLM 0.32's dist-info, the real libiomp5
PINNED_CPUS = PINNED[2].split(",")  # taskset -c 0,1: the map's host
SD_COMMAND = ("serve", "m", "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}')


def stat_tree(root: Path, busy: int) -> Path:
    """A /proc/stat of 2 CPUs whose counters stand still: an idle host for the watch."""
    lines = ["cpu  10 0 10 500 0 0 0 0 0 0"]
    lines += [f"cpu{n} {busy} 0 5 250 3 0 0 0 0 0" for n in (0, 1)]
    return tree(root, {STAT: "\n".join(lines) + "\nintr 1 2 3\n"})


def test_the_watch_sees_a_busy_loop_on_the_cpus(tmp_path: Path) -> None:
    """A real busy loop beside the watch, on this process's CPUs: other work, never idle."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        others = read_others(cpus)
    finally:
        loop.kill()
        loop.wait()
    assert others.cpus is not None and others.cpus >= 0.5 and not others.idle
    assert others_line(others).endswith(" at start: shared")


def test_counters_that_stand_still_are_an_idle_host(tmp_path: Path) -> None:
    """Faked: a host idle while the tests run cannot be had; the counters of one can."""
    others = read_others((0, 1), str(stat_tree(tmp_path, 7)), watch_s=0.01)
    assert others == Others(0.0, 0.01) and others.idle
    assert others_line(others) == "other work used 0.00 CPUs over 0.01 s at start: idle"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (None, "proc/stat: missing"),
        ("cpu0 1 2 x 4 5 6 7 8\n", "is no line of counters"),
        ("\n\ncpu0 1 2 3 4 5 6 7 8\n\n", None),  # blank lines: counters that stand still
    ],
)
def test_an_unreadable_proc_stat_leaves_the_use_unknown_blank_lines_do_not(
    tmp_path: Path, text: str | None, said: str | None
) -> None:
    root = tree(tmp_path, {} if text is None else {STAT: text})
    others = read_others((0,), str(root), watch_s=0.0)
    if said is None:  # odd but readable
        assert others == Others(0.0, 0.0)
        return
    assert others.cpus is None and not others.idle and said in (others.unknown or "")
    use = host_use(Shape((0,)), HostCpus.AUTO, "--host-cpus auto", 1, lambda: others)
    assert use.kind == HostUse.UNKNOWN and "other work at start unknown" in use.why


QUOTA_OF_2 = "a cgroup quota of 1.5 of 2 CPUs"


def never_watched() -> Others:
    raise AssertionError("watched where what was told or seen decides")


@pytest.mark.parametrize(
    ("shape", "said", "online", "expected"),
    [
        (Shape((0, 1), 1.0), HostCpus.SHARED, 2, Use(HostUse.SHARED, "told")),
        (
            Shape((0, 1), 1.5),
            HostCpus.AUTO,
            2,
            Use(HostUse.QUOTA, "a cgroup quota of 1.5 of 2 CPUs"),
        ),
        (
            Shape((0, 1), 1.5),
            HostCpus.OWN,
            2,
            Use(HostUse.QUOTA, "a cgroup quota of 1.5 of 2 CPUs"),
        ),
        (Shape((3,)), HostCpus.AUTO, 4, Use(HostUse.OWN, "a cpuset of 1 of the host's 4 CPUs")),
        (Shape((0, 1), 2.0), HostCpus.OWN, 2, Use(HostUse.OWN, "told")),
    ],
)
def test_what_was_told_or_seen_decides_before_the_watch(
    shape: Shape, said: HostCpus, online: int, expected: Use
) -> None:
    assert host_use(shape, said, "told", online, never_watched) == expected


def test_the_watch_decides_the_rest() -> None:
    busy, idle = Others(1.02), Others(0.03)
    assert host_use(Shape((0, 1)), HostCpus.AUTO, "", 2, lambda: busy).kind == HostUse.SHARED
    assert host_use(Shape((0, 1)), HostCpus.AUTO, "", 2, lambda: idle).kind == HostUse.OWN


def test_the_launcher_watches_a_busy_host_and_says_so(tmp_path: Path, vllm_env: Path) -> None:
    """A fresh launcher left to watch (--host-cpus auto), busy loops on every CPU it may use:
    its plan says the CPUs are shared, and no rule measured on vLLM's own CPUs applies."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in os.sched_getaffinity(0)
    ]
    try:
        arguments = ["--vllm", str(vllm_env / "bin" / "vllm"), "--host-cpus", "auto", "--dry-run"]
        result = run_launcher([*arguments, "--json", *SD_COMMAND], clean_environ(tmp_path))
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["host_use"]["kind"] == "shared", plan["host_use"]
    assert plan["host_use"]["why"].startswith("other work used ")


@pytest.mark.parametrize("said", ["own", "shared"])
def test_what_you_say_of_the_cpus_is_what_the_plan_takes(
    tmp_path: Path, map_vllm: Path, said: str
) -> None:
    """docs/operating.md's two commands (as --dry-run), on the map's host: told, the launch
    does not watch; map-1 applies on CPUs of vLLM's own, shapes-1 (vLLM's binding, the block
    time 0 in its front end) on CPUs shared with other work."""
    arguments = ["--vllm", str(map_vllm), "--host-cpus", said, "--dry-run", "--json"]
    result = run_launcher([*arguments, *SD_COMMAND], clean_environ(tmp_path), PINNED)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    # Pinned to 2 CPUs of a larger host, the cpuset says "own" before you do.
    cpuset = len(os.sched_getaffinity(0)) > len(PINNED_CPUS)
    told = f"--host-cpus {said}"
    why = "a cpuset of 2 of the host's" if cpuset and said == "own" else told
    assert plan["host_use"]["kind"] == said and plan["host_use"]["why"].startswith(why)
    rule, blocktime = {"own": ("map-1", "200"), "shared": ("shapes-1", "0")}[said]
    assert plan["rule"]["id"] == rule and plan["env"]["KMP_BLOCKTIME"] == blocktime
    assert ("VLLM_CPU_OMP_THREADS_BIND" in plan["env"]) == (said == "own"), plan["env"]

"""`vllm-cpu-launch servers N`: N servers of one model on this host, each on its own CPUs
(docs/design.md, "Several servers"): whole NUMA nodes first, then cores (a core's SMT
siblings together); each with its memory nodes, port, vLLM binding, KV-cache share and the
launcher's plan for its CPUs. Rendered as text, json, env's formats, or systemd-unit's unit
as a template with a drop-in per instance.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import TYPE_CHECKING

from vllm_cpu_launch import launch
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.messages import emit
from vllm_cpu_launch.plan import plan_as_json, summary_line
from vllm_cpu_launch.records import record, replace
from vllm_cpu_launch.rules import BIND_VARIABLE
from vllm_cpu_launch.shape import (
    SERVER_CPUS,
    VISIBLE_NODES,
    Shape,
    Unreadable,
    id_list,
    id_words,
    node_cpus,
    read_text,
    shape_json,
    shape_line,
)
from vllm_cpu_launch.systemd_syntax import environment_word
from vllm_cpu_launch.verbs import env, systemd_unit

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import TypeVar

    from vllm_cpu_launch.command import VllmCommand
    from vllm_cpu_launch.libraries import Host
    from vllm_cpu_launch.plan import Plan

    _T = TypeVar("_T")

FORMATS = ("text", "json", "shell", "docker", "kubernetes", "systemd")
KV_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"  # GiB, vLLM's CPU platform (platforms/cpu.py)
PORT_VARIABLE = "VLLMCPULAUNCH_SERVER_PORT"  # the instance's port, in its drop-in only
DEFAULT_PORT = 8000  # vLLM's --port default
SIBLINGS = "sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
MEMINFO = "sys/devices/system/node/node{}/meminfo"
GIB_KB = 2**20
OPTIONS = {"--env": "unit_env", "--format": "format", "--directory": "directory"}

USAGE = """\
usage: vllm-cpu-launch servers N [--format text|json|shell|docker|kubernetes|systemd]
                       [--directory DIR] [UNIT OPTIONS] [OPTIONS] [--] serve MODEL [ARGS...]

Plan N servers of one model on the CPUs this process may run on, each on its own:
whole NUMA nodes first (N up to the nodes), then cores, a core's SMT siblings together.
Each server gets its CPUs and their memory nodes, a port (yours from --port, else 8000;
then one more each), VLLM_CPU_OMP_THREADS_BIND (one CPU per core, the last core's left
to vLLM's engine core, as vLLM's auto binding picks them), VLLMCPULAUNCH_SERVER_CPUS
(its CPUs: `verify PID` checks its processes keep to them), a KV-cache share
(VLLM_CPU_KVCACHE_SPACE) where servers share a memory node, and the launcher's plan for
its CPUs. Your VLLM_CPU_OMP_THREADS_BIND, CPU_VISIBLE_MEMORY_NODES or --uds would put
every server on the same CPUs, nodes or socket: an error. Your KV cache size is kept.

  text        a table per server (default)
  json        the shape, and each server with its plan (as --dry-run --json has it)
  shell | docker | kubernetes
              one block per server as `env` prints one, and the command that starts
              it on its CPUs (taskset)
  systemd     --directory DIR: writes DIR/NAME@.service (systemd-unit's unit, whose
              ExecStart takes the port from the instance) and, for each server I,
              DIR/NAME@I.service.d/server.conf: CPUAffinity=, NUMAPolicy=bind, NUMAMask=,
              the port, binding and KV share. UNIT OPTIONS: --name, --user, --group,
              --env, as systemd-unit takes them.
"""


@record
class Server:
    index: int
    port: int
    cores: tuple[tuple[int, ...], ...]  # its CPUs, a core's SMT siblings together
    nodes: tuple[int, ...]  # the NUMA nodes of its CPUs
    memory_nodes: tuple[int, ...]  # where its memory comes from (NUMAMask=)
    env: tuple[tuple[str, str], ...]  # what servers sets for it: its CPUs, binding, KV share
    kv: str  # its KV cache, said
    plan: Plan  # the launcher's plan on its CPUs, with its port

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for core in self.cores for cpu in core))


def split(items: Sequence[_T], parts: int) -> list[list[_T]]:
    """`items` in `parts` runs, in order, their sizes one apart at most (larger first)."""
    size, extra = divmod(len(items), parts)
    starts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [list(items[starts[i] : starts[i + 1]]) for i in range(parts)]


def core_groups(
    shape: Shape, listed: dict[int, tuple[int, ...]], root: str
) -> list[list[tuple[int, ...]]]:
    """The allowed CPUs as cores (SMT siblings together, as the kernel lists them), grouped
    by the NUMA nodes `listed` in node order; one group where no node is listed."""
    allowed, cores = set(shape.cpus), {}
    for cpu in shape.cpus:
        path = SIBLINGS.format(cpu)
        text = read_text(root, path, None)
        siblings = id_list(text, path) if text is not None else (cpu,)
        cores[cpu] = tuple(c for c in siblings if c in allowed) or (cpu,)
    unique = list(dict.fromkeys(cores.values()))
    groups = [[c for c in unique if c[0] in listed[n]] for n in shape.nodes if n in listed]
    placed = {core for group in groups for core in group}
    rest = [core for core in unique if core not in placed]  # no node lists them
    return [group for group in [*groups, rest] if group]


def cpu_sets(groups: list[list[tuple[int, ...]]], count: int) -> list[list[tuple[int, ...]]]:
    """`count` disjoint sets of cores: runs of whole nodes where count <= nodes, else each
    node's cores split among its servers, a node's servers growing where its cores per
    server are most (every node one server at least)."""
    if count <= len(groups):
        return [[core for group in run for core in group] for run in split(groups, count)]
    shares = [1] * len(groups)
    for _ in range(count - len(groups)):
        roomy = [i for i, group in enumerate(groups) if len(group) > shares[i]]
        shares[max(roomy, key=lambda i: (len(groups[i]) / shares[i], -i))] += 1
    return [run for group, n in zip(groups, shares, strict=True) for run in split(group, n)]


def memory_kb(root: str, node: int | None) -> int:
    """MemTotal of `node` (its meminfo), or of the host where no node is listed."""
    path = "proc/meminfo" if node is None else MEMINFO.format(node)
    for line in (read_text(root, path) or "").splitlines():
        words = line.split()
        if "MemTotal:" in words and words[-1] == "kB" and words[-2].isdigit():
            return int(words[-2])
    raise Unreadable(f"/{path}: no MemTotal in kB")


def binding(cores: Sequence[tuple[int, ...]]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a server's cores: what vLLM's auto binding takes inside
    them on x86 (utils/ompmultiprocessing.py: a core's last CPU, the last core's left to the
    engine core where there are two or more), as an explicit list, which binds the worker
    there whatever the process's affinity (env's formats) and memory nodes (vLLM #43240)."""
    chosen = sorted(core[-1] for core in cores)
    return id_words(chosen[:-1] if len(chosen) > 1 else chosen)


def kv_shares(
    first: list[int | None], root: str, environ: dict[str, str]
) -> list[tuple[tuple[tuple[str, str], ...], str]]:
    """Each server's KV-cache setting and why, by its first node (None: none listed). vLLM
    sizes an unset one from its worker's memory node (v1/worker/cpu_worker.py: 92% of the
    node's total, less its own size), so servers sharing a node would each claim most of
    it: each gets half its part of the node, explicitly; yours is kept, refused only where
    the servers cannot all have it."""
    said: list[tuple[tuple[tuple[str, str], ...], str]] = []
    for node in first:
        sharing, where = first.count(node), "the host" if node is None else f"node {node}"
        if sharing == 1 and not environ.get(KV_VARIABLE):
            said.append(((), f"vLLM's own sizing: the only server on {where}"))
            continue
        total = memory_kb(root, node) // GIB_KB
        if environ.get(KV_VARIABLE):
            yours = environ[KV_VARIABLE]
            if not (yours.isascii() and yours.isdigit()):
                raise LaunchError(
                    EXIT_USAGE, f"{KV_VARIABLE}={yours} (yours): vLLM reads whole GiB (int)"
                )
            if int(yours) * sharing > total:
                raise LaunchError(
                    EXIT_USAGE,
                    f"{KV_VARIABLE}={yours} (yours, kept): {sharing} servers on {where} "
                    f"({total} GiB) would take {int(yours) * sharing} GiB; lower it or unset it",
                )
            said.append(((), f"{KV_VARIABLE}={yours} GiB (yours, kept)"))
        elif total // (2 * sharing) < 1:
            raise LaunchError(
                EXIT_USAGE,
                f"{sharing} servers on {where} ({total} GiB): under 1 GiB of KV cache each; "
                f"plan fewer servers or set {KV_VARIABLE}",
            )
        else:
            share = str(total // (2 * sharing))
            why = f"half of {where}'s {total} GiB over its {sharing} servers (not measured)"
            said.append((((KV_VARIABLE, share),), f"{KV_VARIABLE}={share} GiB: {why}"))
    return said


def check_conflicts(environ: dict[str, str], count: int, command: VllmCommand) -> None:
    """One setting of yours for every server that would put them on the same CPUs or socket,
    or a server of several workers (one binding each, which servers does not plan)."""
    if not command.one_worker:
        raise LaunchError(
            EXIT_USAGE, "servers plans one worker each: drop the parallel sizes and --headless"
        )
    if count > 1 and environ.get(BIND_VARIABLE):
        raise LaunchError(
            EXIT_USAGE,
            f"{BIND_VARIABLE}={environ[BIND_VARIABLE]} (yours, kept) would bind all {count} "
            "servers alike; unset it: servers binds each to its own CPUs",
        )
    if count > 1 and "--uds" in command.listen:
        raise LaunchError(
            EXIT_USAGE, f"--uds puts all {count} servers on one socket: give --port, or none"
        )


def check_visible_nodes(environ: dict[str, str], servers: list[list[int]]) -> None:
    """Your CPU_VISIBLE_MEMORY_NODES, kept, where it holds no node of some server's CPUs:
    vLLM puts that server's worker memory on another node (v1/worker/cpu_worker.py)."""
    value = environ.get(VISIBLE_NODES)
    if not value:
        return
    try:
        named = {int(node) for node in value.split(",")}  # as vLLM reads it
    except ValueError:
        raise LaunchError(
            EXIT_USAGE, f"{VISIBLE_NODES}={value} (yours): vLLM reads a comma list of node numbers"
        ) from None
    for index, nodes in enumerate(servers):
        if nodes and not named & set(nodes):
            raise LaunchError(
                EXIT_USAGE,
                f"{VISIBLE_NODES}={value} (yours, kept) holds no node of server {index}'s "
                f"CPUs (node {id_words(nodes)}): unset it, servers binds each to its own",
            )


def host_shape(host: Host) -> Shape:
    if host.shape is None:  # launch.current_host reads it
        raise LaunchError(EXIT_USAGE, "servers: this host's CPUs were not read")
    return host.shape


def plan_servers(
    values: dict[str, object], count: int, arguments: list[str], host: Host, root: str = "/"
) -> list[Server]:
    """N servers on `host`'s shape (its /sys under `root`), each planned as a launch on its
    CPUs would be."""
    command, shape = read_command(arguments), host_shape(host)
    environ = dict(host.environ)
    check_conflicts(environ, count, command)
    port = command.listen.get("--port", str(DEFAULT_PORT))
    if not (port.isascii() and port.isdigit() and int(port) + count - 1 <= 65535):
        raise LaunchError(
            EXIT_USAGE, f"--port {port}: give the first of {count} ports, up to {65536 - count}"
        )
    try:
        listed = {} if shape.nodes_unknown else node_cpus(root)
        groups = core_groups(shape, listed, root)
        cores = sum(len(group) for group in groups)
        if count > cores:
            raise LaunchError(
                EXIT_USAGE,
                f"servers {count}: this process may run on {len(shape.cpus)} CPUs "
                f"({id_words(shape.cpus)}), {cores} cores with their SMT siblings, one "
                f"server each at most: plan at most {cores}",
            )
        sets = cpu_sets(groups, count)
        nodes = [
            [n for n in listed if {c for core in s for c in core} & set(listed[n])] for s in sets
        ]
        kv = kv_shares([n[0] if n else None for n in nodes], root, environ)
    except Unreadable as error:
        raise LaunchError(EXIT_USAGE, f"servers: {error}") from None
    check_visible_nodes(environ, nodes)
    servers = []
    for index, (cores_of, nodes_of, (kv_env, kv_said)) in enumerate(
        zip(sets, nodes, kv, strict=True)
    ):
        cpus, at = tuple(sorted(c for core in cores_of for c in core)), int(port) + index
        # Its memory: its CPUs' nodes where allowed, else those allowed (said in the text).
        memory = tuple(n for n in nodes_of if n in shape.memory_nodes) or shape.memory_nodes
        own = ((SERVER_CPUS, id_words(cpus)), (BIND_VARIABLE, binding(cores_of)), *kv_env)
        on = replace(shape, cpus=cpus, nodes=tuple(nodes_of))
        on_host = replace(host, environ={**environ, **dict(own)}, cpus=len(cpus), shape=on)
        vllm = read_command([*arguments, "--port", str(at)])
        plan = launch.plan_from_options(values, vllm, host=on_host)
        servers.append(Server(index, at, tuple(cores_of), on.nodes, memory, own, kv_said, plan))
    return servers


def nodes_words(nodes: Sequence[int]) -> str:
    return f"node{'s' * (len(nodes) > 1)} {id_words(nodes)}" if nodes else "no node listed"


def start_line(server: Server, program: Sequence[str]) -> str:
    """The command that starts `server` on its CPUs (`program`: the launcher's or the plan's)."""
    return shlex.join(["taskset", "-c", id_words(server.cpus), *program])


def launcher_argv(values: dict[str, object], server: Server) -> list[str]:
    options = systemd_unit.baked_options(values, None)
    return ["vllm-cpu-launch", *options, "--", *server.plan.command[1:]]


def as_text(values: dict[str, object], shape: Shape, servers: list[Server]) -> str:
    lines = [f"{len(servers)} servers on {shape_line(shape)}"]
    for s in servers:
        cpus, cores = id_words(s.cpus), len(s.cores)
        away = s.nodes and not set(s.nodes) & set(s.memory_nodes)
        elsewhere = f" (its CPUs' {nodes_words(s.nodes)}: not allowed for memory)" if away else ""
        lines += [
            f"server {s.index}: port {s.port}",
            f"  CPUs          {cpus} ({cores} core{'s' * (cores > 1)}, {nodes_words(s.nodes)})",
            f"  memory        {nodes_words(s.memory_nodes)}{elsewhere}",
            f"  binding       {BIND_VARIABLE}={dict(s.env)[BIND_VARIABLE]}",
            f"  KV cache      {s.kv}",
            f"  plan          {summary_line(s.plan)}",
            f"  start         {start_line(s, launcher_argv(values, s))}",
        ]
    return "\n".join(lines)


def as_json(shape: Shape, servers: list[Server]) -> str:
    said = [
        {
            "index": s.index,
            "port": s.port,
            "cpus": list(s.cpus),
            "cores": [list(core) for core in s.cores],
            "nodes": list(s.nodes),
            "memory_nodes": list(s.memory_nodes),
            "env": dict(s.env),
            "kv_cache": s.kv,
            "plan": plan_as_json(s.plan),
        }
        for s in servers
    ]
    return json.dumps({"shape": shape_json(shape), "servers": said}, indent=2)


def as_env(servers: list[Server], output_format: str) -> str:
    """One block per server as `env` renders one (its plan's environment and its own)."""
    blocks = []
    for s in servers:
        plan = replace(s.plan, env=(*s.plan.env, *s.env))
        about = f"# server {s.index}: port {s.port}, CPUs {id_words(s.cpus)}, memory "
        about += f"{nodes_words(s.memory_nodes)}; start: {start_line(s, s.plan.command)}"
        blocks.append(f"{about}\n{env.render(plan, output_format)}")
    return ("\n---\n" if output_format == "kubernetes" else "\n\n").join(blocks)


def drop_in(server: Server, count: int) -> str:
    """NAME@I.service.d/server.conf: its CPUs, memory nodes and environment."""
    numa = ["NUMAPolicy=bind", f"NUMAMask={id_words(server.memory_nodes)}"]
    own = [(PORT_VARIABLE, str(server.port)), *server.env]
    return "\n".join(
        [
            f"# Server {server.index} of {count}, written by vllm-cpu-launch servers.",
            "[Service]",
            f"CPUAffinity={id_words(server.cpus)}",
            *(numa if server.memory_nodes else ["# No memory node listed: no NUMAPolicy="]),
            *(f"Environment={environment_word(*p)}" for p in own),
        ]
    )


def write_units(
    values: dict[str, object], arguments: list[str], servers: list[Server], directory: str
) -> str:
    """The template (systemd-unit's unit, its port the instance's) and a drop-in per server
    under `directory`; what was written, said."""
    name = str(values.get("unit_name") or systemd_unit.DEFAULT_NAME)
    # Each instance its own state, cache and HOME (two transient users must not share one).
    instance = {**values, "unit_name": f"{name}@%i"}
    body = systemd_unit.unit_text(instance, arguments, f" --port ${{{PORT_VARIABLE}}}")
    units = [f"{name}@{s.index}.service" for s in servers]
    header = (
        f"# {name}@.service, written by vllm-cpu-launch servers: {len(servers)} servers, "
        f"each NAME@I.service with its drop-in NAME@I.service.d/server.conf.\n"
        f"# Install: copy {name}@.service and {name}@*.service.d to /etc/systemd/system, then\n"
        f"#   systemctl daemon-reload && systemctl enable --now {' '.join(units)}\n"
    )
    files = {f"{name}@.service": header + body[body.index("[Unit]") :]}
    files |= {
        f"{unit}.d/server.conf": drop_in(s, len(units))
        for unit, s in zip(units, servers, strict=True)
    }
    try:
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(directory, path)), exist_ok=True)
            with open(os.path.join(directory, path), "w", encoding="utf-8") as stream:
                stream.write(text + "\n")
    except OSError as error:
        raise LaunchError(
            EXIT_USAGE, f"--directory {directory}: cannot write {path}: {error.strerror}"
        ) from None
    return "\n".join(os.path.join(directory, path) for path in files)


def read_count(word: str | None) -> int:
    if word is None or not (word.isascii() and word.isdigit() and int(word) > 0):
        raise LaunchError(
            EXIT_USAGE,
            f"servers needs how many, a whole number from 1, not {word!r}: "
            "vllm-cpu-launch servers 2 serve MODEL ...",
        )
    return int(word)


def main(values: dict[str, object], args: list[str]) -> int:
    valued = {**launch.VALUED_OPTIONS, **systemd_unit.UNIT_OPTIONS, **OPTIONS}
    more, rest = launch.parse_options(args, valued, repeatable=("unit_env",), verb="servers")
    if more.get("help"):
        launch.write_stdout(USAGE.rstrip())
        return 0
    count = read_count(rest[0] if rest else None)  # N, after any options or before them
    later, arguments = launch.parse_options(
        rest[1:], valued, repeatable=("unit_env",), verb="servers"
    )
    merged = {**values, **more, **later}
    output_format = str(merged.get("format", "json" if merged.get("json") else "text"))
    directory = merged.get("directory")
    if output_format not in FORMATS:
        raise LaunchError(
            EXIT_USAGE, f"--format {output_format!r}: use one of {', '.join(FORMATS)}"
        )
    if (output_format == "systemd") != isinstance(directory, str):
        raise LaunchError(
            EXIT_USAGE, "--format systemd writes its units to --directory DIR: give both"
        )
    for key, option in (("dry_run", "--dry-run"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"servers never starts anything; {option} does not apply")
    if not arguments or arguments[0] != "serve":
        raise LaunchError(
            EXIT_USAGE, "servers needs vLLM's serve command: servers N serve MODEL ..."
        )
    systemd_unit.check_names(merged)
    host = launch.current_host()
    servers, shape = plan_servers(merged, count, arguments, host), host_shape(host)
    if output_format != "systemd":  # else systemd-unit's warnings, for the service
        for warning in dict.fromkeys(w for s in servers for w in s.plan.warnings):
            emit("warning", warning)
    launch.provide_metadata(servers[0].plan)
    if output_format == "systemd":
        text = write_units(merged, arguments, servers, str(directory))
    elif output_format == "text":
        text = as_text(merged, shape, servers)
    elif output_format == "json":
        text = as_json(shape, servers)
    else:
        text = as_env(servers, output_format)
    launch.write_stdout(text)
    return 0

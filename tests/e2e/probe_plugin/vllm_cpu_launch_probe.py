"""A vLLM general plugin for the end-to-end tests: what each vLLM process started with.

vLLM loads general plugins in every process it starts. Where $VLLMCPULAUNCH_TEST_PROBE
names a file, each process appends one JSON line to it: its PID, its parent's, the OpenMP
variables it inherited, and the file vLLM imported vllm-cpu-launch's plugin from (vLLM
imports every plugin of the group before it calls any). vLLM's engine-core and worker
processes overwrite the start of /proc/PID/environ with their process title, so what they
inherited is read here, from inside, instead.
"""

from __future__ import annotations

import json
import os
import sys

PROBE_VARIABLE = "VLLMCPULAUNCH_TEST_PROBE"
RECORDED = ("LD_PRELOAD", "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND", "VLLMCPULAUNCH_PLANNED")


def register() -> None:
    """Append this process's record (one write, so lines of processes never mix)."""
    path = os.environ.get(PROBE_VARIABLE)
    if not path:
        return
    record: dict[str, object] = {"pid": os.getpid(), "ppid": os.getppid()}
    record.update({name: os.environ.get(name) for name in RECORDED})
    record["plugin_file"] = getattr(sys.modules.get("vllm_cpu_launch.plugin"), "__file__", None)
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record) + "\n")

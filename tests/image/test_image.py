"""The image built from the Dockerfile (`make image`), run as the cluster runs it.

The containers are started by runc, the OCI runtime containerd uses under the kubelet, through
`buildah run --runtime runc --isolation oci` on the image's own configuration (its USER, PATH, HOME,
in its own pid, mount and ipc namespaces and cgroup): what runs here is what a pod of the image runs,
without a kubelet. (Not buildah's chroot isolation, which builds the image: it shares the host's
namespaces; not buildah's default crun, which refuses this machine's hybrid cgroup layout.) Each check runs as uid/gid 65532, the chart's
runAsUser/runAsGroup. The build is `scripts/image/build` itself (a no-op when the tree is unchanged;
`make test` builds before pytest starts).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BUILDAH = str(REPO / "scripts" / "image" / "buildah")
USER = "65532:65532"

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def image() -> str:
    # Cold: the base and torch (≈ 15 min on 2 cores); unchanged tree: a hash of the context.
    build = subprocess.run([str(REPO / "scripts" / "image" / "build")], capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, f"scripts/image/build failed:\n{build.stderr[-4000:]}"
    return build.stdout.split()[-1]


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    name = f"oobleck-smoke-{os.getpid()}"  # scripts/image/build removes it once this process is gone
    subprocess.run([BUILDAH, "rm", name], capture_output=True, check=False)
    subprocess.run([BUILDAH, "from", "--pull=false", "--name", name, image], capture_output=True, check=True)
    try:
        yield name
    finally:
        subprocess.run([BUILDAH, "rm", name], capture_output=True, check=False)


def run(container: str, *argv: str, user: str | None = USER) -> subprocess.CompletedProcess[str]:
    """`argv` in a runc container of the image (no network needed: host's, to skip CNI setup)."""
    options = ["--runtime", "runc", "--isolation", "oci", "--network", "host"] + (["--user", user] if user else [])
    return subprocess.run(
        [BUILDAH, "run", *options, container, "--", *argv], capture_output=True, text=True, timeout=300
    )


def test_the_image_runs_as_65532_by_default(container: str) -> None:
    # No --user: the image's USER, which the chart's runAsNonRoot can verify (numeric, non-root).
    result = run(container, "python", "-c", "import os; print(os.getuid(), os.getgid(), os.environ['HOME'])", user=None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65532", "65532", "/home/oobleck"]


@pytest.mark.parametrize("command", ["operator", "worker"])
def test_console_commands_answer_as_65532(container: str, command: str) -> None:
    result = run(container, "oobleck", command, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"oobleck {command}" in result.stdout, result.stdout[:500]


def test_the_operators_coordinator_command_answers(container: str) -> None:
    # The command the operator renders for a job's coordinator pod (its module path is the product's).
    from oobleck.api.job import parse_spec
    from oobleck.operator import render

    spec = parse_spec(yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())["spec"])
    command = render.coordinator_pod("tiny-gpt", "ns", "uid", spec, default_image="image")["spec"]["containers"][0][
        "command"
    ]
    result = run(container, *command, "--help")
    assert result.returncode == 0, f"{command}: {result.stderr[-3000:]}"


def test_the_compiled_planner_imports_from_the_installed_wheel(container: str) -> None:
    check = (
        "import json, os, sys, oobleck.planner\n"
        "modules = {n: sys.modules['oobleck.planner.' + n].__file__ for n in oobleck.planner.COMPILED_MODULES}\n"
        "print(json.dumps({'uid': os.getuid(), 'modules': modules}))\n"
    )
    result = run(container, "python", "-c", check)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["uid"] == 65532
    assert {"_instantiate", "_templates"} <= set(report["modules"]), report
    for path in report["modules"].values():
        assert path.startswith("/opt/oobleck/lib/") and path.endswith(".so"), path


def test_no_compiler_and_a_writable_home_only(container: str) -> None:
    result = run(
        container,
        "python",
        "-c",
        "import os, shutil; print([c for c in ('gcc', 'cc', 'g++') if shutil.which(c)],"
        " os.access(os.environ['HOME'], os.W_OK), os.access('/opt/oobleck', os.W_OK), os.access('/', os.W_OK))",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] True False False", "no compiler; user 65532 writes its HOME only"


def test_a_source_edit_remakes_only_small_layers(image: str) -> None:
    """The layers above the dependencies (the project's wheel) are a few megabytes: a source edit
    rebuilds, exports and imports those, not torch."""
    inspect = subprocess.run([BUILDAH, "inspect", "--type", "image", image], capture_output=True, text=True, check=True)
    info = json.loads(inspect.stdout)
    history = [h.get("created_by", "") for h in info["Docker"]["history"] if not h.get("empty_layer")]
    sizes = [layer["size"] for layer in json.loads(info["Manifest"])["layers"]]  # uncompressed tars in the store
    assert len(history) == len(sizes), (len(history), len(sizes))
    steps = list(zip(history, sizes))
    last_dependency = max(n for n, (created_by, _) in enumerate(steps) if "dependencies.txt" in created_by)
    torch = [size for created_by, size in steps if "pip install" in created_by and "torch.txt" in created_by]
    on_top = steps[last_dependency + 1 :]
    assert torch and torch[0] > 500e6, steps  # the big layer, which a source edit leaves alone
    assert on_top and sum(size for _, size in on_top) < 50e6, [(c[-80:], size) for c, size in on_top]

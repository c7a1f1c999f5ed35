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
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from oobleck_dev.tools import cache_root

REPO = Path(__file__).resolve().parents[2]
BUILDAH = str(REPO / "scripts" / "image" / "buildah")
USER = "65532:65532"

# One xdist worker runs them in order: the last one builds an edited copy of the tree, and the store
# keeps only the latest build (and the images containers use: the real-node tests' import, run beside these by
# scripts/test, holds its image with one).
pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(3600), pytest.mark.xdist_group("image")]


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
    from oobleck.api.spec import parse_spec
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


def layers(image: str) -> list[str]:
    inspect = subprocess.run([BUILDAH, "inspect", "--type", "image", image], capture_output=True, text=True, check=True)
    return json.loads(inspect.stdout)["Docker"]["rootfs"]["diff_ids"]


def checkout_outputs(folder: str, names: list[str]) -> set[str]:
    """What the copy leaves out: the checkout's environment, build and caches (not in the context)."""
    top = {".git", ".venv", "build", ".mypy_cache", ".ruff_cache", ".pytest_cache"} if Path(folder) == REPO else set()
    return {name for name in names if name in top or name == "__pycache__"}


def test_a_source_edit_rebuilds_from_the_wheel_only(image: str, tmp_path: Path) -> None:
    """The same tree elsewhere is the same image (no build); a one-line edit rebuilds only the
    layers above the dependencies, reusing torch's and the dependencies' from the cache."""
    copy = tmp_path / "tree"
    shutil.copytree(REPO, copy, symlinks=True, ignore=checkout_outputs)
    build = [str(copy / "scripts" / "image" / "build")]
    same = subprocess.run(build, capture_output=True, text=True, timeout=3600)
    assert same.returncode == 0, same.stderr[-3000:]
    assert same.stdout.split()[-1] == image, "an unchanged tree in another folder must be the same image"
    assert "building" not in same.stderr, same.stderr
    old = layers(image)  # read now: the store keeps only the latest build's names

    with (copy / "src" / "oobleck" / "cli.py").open("a") as source:
        source.write("# a one-line edit\n")
    edited = subprocess.run(build, capture_output=True, text=True, timeout=3600)
    assert edited.returncode == 0, edited.stderr[-3000:]
    new_image = edited.stdout.split()[-1]
    assert new_image != image
    log = (cache_root() / "image" / "build.log").read_text()
    steps = [step for step in log.split("STEP ")[1:] if "pip install" in step.splitlines()[0]]
    for requirement in ("torch.txt", "dependencies.txt"):
        (step,) = [s for s in steps if requirement in s.splitlines()[0]]
        assert "--> Using cache" in step, f"the {requirement} layer was rebuilt after a source edit"
    new = layers(new_image)
    assert len(old) == len(new)
    changed = [n for n, (a, b) in enumerate(zip(old, new)) if a != b]
    assert changed and len(changed) <= 2 and changed[0] >= len(old) - 2, f"layers changed: {changed} of {len(old)}"

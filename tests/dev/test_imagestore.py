"""The real nodes' template image store against a real containerd and buildah: a rebuilt image whose lower
layers did not change is imported as its new layers only, and the image containerd unpacks from them holds
every layer's files. Small images stand in for the project's 6 GB one; the code path is the same.

Needs root, buildah (make image installs it) and containerd (make node-packages; make test does both).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from oobleck_dev.buildahstore import BuildahStore, BuildahStoreError
from oobleck_dev.imagestore import ImageStoreError, TemplateStore, chain_ids

pytestmark = pytest.mark.integration  # starts containerd and buildah (see tests/conftest.py: make test-unit)

BIG = 4_000_000  # bytes of the lower layer: what an incremental import must not send again


@pytest.fixture
def buildah(tmp_path: Path) -> list[str]:
    missing = [tool for tool in ("buildah", "containerd", "ctr") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"needs root and {missing} (make test installs them: the image and node-packages targets)")
    storage = ["--root", str(tmp_path / "storage"), "--runroot", str(tmp_path / "run"), "--storage-driver", "overlay"]
    return ["buildah", *storage]


def build(buildah: list[str], name: str, base: str, files: dict[str, bytes], context: Path) -> None:
    """Commit `files` as one new layer on `base` ("scratch" for none) and name the image `name`."""
    run = lambda *args: subprocess.run([*buildah, *args], check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    container = run("from", "--quiet", base)
    for path, data in files.items():
        source = context / path
        source.write_bytes(data)
        run("copy", container, str(source), f"/{path}")
    run("commit", "--quiet", "--rm", "--format", "docker", container, name)


def image_files(store: TemplateStore, image: str, names: list[str], mount: Path) -> dict[str, bytes]:
    with store.serving() as ctr:
        mount.mkdir(exist_ok=True)
        subprocess.run([*ctr, "images", "mount", image, str(mount)], check=True, capture_output=True)
        try:
            return {name: (mount / name).read_bytes() for name in names}
        finally:
            subprocess.run([*ctr, "images", "unmount", "--rm", str(mount)], check=True, capture_output=True)


def test_a_rebuild_imports_its_new_layers_only_and_unpacks_whole(buildah, tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    big = os.urandom(BIG)
    build(buildah, "localhost/oobleck:one", "scratch", {"torch": big}, context)
    build(buildah, "localhost/oobleck:two", "localhost/oobleck:one", {"wheel": b"v2"}, context)
    pause = tmp_path / "pause"
    pause.write_bytes(b"\x7fELF stand-in: the pause image is imported, never run here")
    store = TemplateStore(tmp_path / "store", "localhost/pause:test", pause, buildah)

    store.ensure("localhost/oobleck:one")
    assert store.imported_bytes > BIG
    assert store.images() == ["localhost/oobleck:one", "localhost/pause:test"]

    store.ensure("localhost/oobleck:two")
    assert 0 < store.imported_bytes < BIG // 10, "the unchanged lower layer was sent again"
    assert store.images() == ["localhost/oobleck:two", "localhost/pause:test"]
    assert image_files(store, "localhost/oobleck:two", ["torch", "wheel"], tmp_path / "mnt") == {
        "torch": big,
        "wheel": b"v2",
    }
    with store.serving() as ctr:
        listed = subprocess.run([*ctr, "images", "list", "--quiet"], check=True, capture_output=True, text=True)
    assert "localhost/oobleck:one" not in listed.stdout.split()

    # A rebuild whose lowest layer changed shares nothing below: all of it is sent.
    build(buildah, "localhost/oobleck:three", "scratch", {"torch": big[::-1]}, context)
    store.ensure("localhost/oobleck:three")
    assert store.imported_bytes > BIG
    assert image_files(store, "localhost/oobleck:three", ["torch"], tmp_path / "mnt") == {"torch": big[::-1]}


def test_a_layer_is_rebuilt_as_buildah_pushes_it_and_a_changed_file_is_refused(buildah, tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    files = {"torch": os.urandom(100_000), "empty": b"", "odd": b"x" * 513}
    build(buildah, "localhost/oobleck:one", "scratch", files, context)
    pushed = tmp_path / "pushed"
    subprocess.run(
        [*buildah, "push", "--quiet", "--disable-compression", "localhost/oobleck:one", f"dir:{pushed}"],
        check=True,
        capture_output=True,
    )
    store = BuildahStore(buildah)
    (layer,) = store.image("localhost/oobleck:one").layers
    stream = store.stream(layer)
    rebuilt = stream.read()
    stream.verify()
    assert rebuilt == (pushed / layer.diff_id.split(":")[1]).read_bytes()

    # The file as the layer holds it changed behind buildah's back: the rebuilt tar is not the layer's.
    (store.root / "overlay" / layer.id / "diff" / "odd").write_bytes(b"y" * 513)
    stream = store.stream(layer)
    stream.read()
    with pytest.raises(BuildahStoreError, match="not its"):
        stream.verify()
    template = TemplateStore(tmp_path / "store", "localhost/pause:test", tmp_path / "pause", buildah)
    (tmp_path / "pause").write_bytes(b"\x7fELF stand-in")
    with pytest.raises(ImageStoreError, match="reading localhost/oobleck:one from buildah's store"):
        template.ensure("localhost/oobleck:one")


def test_chain_ids_follow_the_oci_definition():
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert chain_ids([a, b]) == [a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()]
    assert chain_ids([]) == []

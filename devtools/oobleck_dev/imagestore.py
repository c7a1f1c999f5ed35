"""One containerd image store, imported once, that every real node starts from.

The project image is ~6.4 GB and a containerd holds it twice (the layer blobs and the unpacked
snapshots, ~13 GB); once imported, the layer blobs are dropped (`ctr content prune references`). One containerd per node is required (a kubelet kills runtime pods it does not
own), so instead of importing into each node, the image is imported once into a template store
under the cache (`~/.cache/oobleck/k8s-node/store`), and each node's containerd root starts as a
hard-linked copy of it (`cp -al`): the files are shared, only containerd's two bolt databases are
real copies (bolt writes in place). Layer blobs and lower snapshot folders are never written by a
node (overlayfs writes a container's changes to a new upper folder), so sharing them is safe; a node
deleting an image only drops its own links. A new build of the image adds only its changed layers
to the template (content is deduplicated by digest) and older project images are removed from it.

`pause_archive` makes the sandbox ("pause") image: a docker-archive with one static binary.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from oobleck_dev.controlplane import ManagedProcess, stop_processes
from oobleck_dev.hoststate import unmount_under
from oobleck_dev.nodeconfig import NodeLayout, containerd_config

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
BOLT_FILES = ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db")
PROJECT_IMAGE_PREFIX = "localhost/oobleck:"


class ImageStoreError(RuntimeError):
    """The template store could not be made; the message names the step and shows the output."""


def pause_archive(pause_binary: Path, name: str) -> bytes:
    """A docker-archive (what `ctr image import` reads) of an image holding only `/pause` as its entrypoint,
    run as 65535:65535 as the upstream pause image is."""
    layer_buffer = io.BytesIO()
    with tarfile.open(fileobj=layer_buffer, mode="w", format=tarfile.USTAR_FORMAT) as layer:
        info = tarfile.TarInfo("pause")
        data = pause_binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        layer.addfile(info, io.BytesIO(data))
    layer_bytes = layer_buffer.getvalue()
    layer_digest = hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
        "created": "1970-01-01T00:00:00Z",
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = f"{hashlib.sha256(config_bytes).hexdigest()}.json"
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": [f"{layer_digest}/layer.tar"]}]
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, content in (
            (config_name, config_bytes),
            (f"{layer_digest}/layer.tar", layer_bytes),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(content), 0o644, 0
            tar.addfile(info, io.BytesIO(content))
    return archive.getvalue()


class TemplateStore:
    """The template containerd root under `folder` (`folder/root`), holding the pause and project images."""

    def __init__(self, folder: Path, pause_image: str, pause_binary: Path, buildah: Path) -> None:
        self.folder = folder
        self.root = folder / "root"
        self.pause_image, self.pause_binary, self.buildah = pause_image, pause_binary, buildah
        self.import_s: float | None = None  # seconds the last ensure() spent importing (None: nothing to do)

    def _images_file(self) -> Path:
        return self.folder / "contents.json"

    def images(self) -> list[str]:
        """The images the template holds (as recorded after its last complete import and prune)."""
        try:
            contents = json.loads(self._images_file().read_text())
            return list(contents["images"]) if contents.get("layer_blobs") == "pruned" else []
        except (OSError, ValueError, KeyError, AttributeError):
            return []

    def ensure(self, image: str, timeout_s: float = 1800.0) -> None:
        """Make the template hold `image` and the pause image (and no other project image). Call it holding
        realnodes' host lock: one import at a time, and none while a node is being cloned."""
        wanted = {image, self.pause_image}
        if wanted <= set(self.images()):
            return
        began = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        # An import whose owner was killed: its folder, and any mount its containerd left in the store.
        for stale in self.folder.glob("import-*"):
            shutil.rmtree(stale, ignore_errors=True)
        unmount_under(str(self.root))
        work = Path(tempfile.mkdtemp(prefix="import-", dir=self.folder))
        # A containerd on the template root alone (no kubelet: it only imports).
        layout = NodeLayout(1, work)
        config = work / "config.toml"
        config.write_text(containerd_config(layout, self.pause_image, root=self.root))
        containerd = ManagedProcess(
            "containerd-import", ["containerd", "--config", str(config)], work / "containerd.log"
        )
        try:
            self._wait_socket(containerd, layout.socket)
            ctr = ["ctr", "--address", str(layout.socket), "--namespace", NAMESPACE]
            present = set(self._run([*ctr, "images", "list", "--quiet"], "list images").split())
            if self.pause_image not in present:
                self._run(
                    [*ctr, "images", "import", "-"],
                    "import the pause image",
                    pause_archive(self.pause_binary, self.pause_image),
                )
            if image not in present:
                self._import_project_image(ctr, image, timeout_s)
            stale = [name for name in present if name.startswith(PROJECT_IMAGE_PREFIX) and name != image]
            if stale:
                # containerd's garbage collector then drops the layers no image uses any more.
                self._run([*ctr, "images", "remove", "--sync", *stale], "remove older project images")
            # A container runs on the unpacked snapshots; the layer blobs (as large again) only serve to unpack
            # once more. Dropping the manifests' references to them lets the garbage collector remove them; the
            # next import writes the blobs again, finds every unchanged layer already unpacked, and prunes again.
            self._run([*ctr, "content", "prune", "references"], "drop the unpacked layers' blobs")
            self._images_file().write_text(json.dumps({"images": sorted(wanted), "layer_blobs": "pruned"}))
        finally:
            stop_processes([containerd], 30.0)
            shutil.rmtree(work, ignore_errors=True)
        self.import_s = round(time.monotonic() - began, 1)

    def _import_project_image(self, ctr: list[str], image: str, timeout_s: float) -> None:
        """buildah writes the docker-archive to a pipe that ctr reads: no 6 GB file in between."""
        push = subprocess.Popen(
            [str(self.buildah), "push", "--quiet", image, "docker-archive:/dev/stdout"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert push.stdout is not None
        try:
            imported = subprocess.run(
                [*ctr, "images", "import", "-"],
                stdin=push.stdout,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        finally:
            push.stdout.close()
            push_err = push.communicate(timeout=60)[1].decode(errors="replace")
        if push.returncode != 0 or imported.returncode != 0:
            raise ImageStoreError(
                f"importing {image} into the template store {self.root} failed:\n"
                f"buildah push (exit {push.returncode}): {push_err[-2000:]}\n"
                f"ctr import (exit {imported.returncode}): {(imported.stderr or imported.stdout)[-2000:]}"
            )

    @staticmethod
    def _wait_socket(containerd: ManagedProcess, socket: Path, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not socket.exists():
            if not containerd.alive() or time.monotonic() > deadline:
                raise ImageStoreError(f"containerd did not open {socket}:\n{containerd.log_tail()}")
            time.sleep(0.1)

    @staticmethod
    def _run(args: list[str], what: str, stdin: bytes | None = None) -> str:
        result = subprocess.run(args, input=stdin, capture_output=True, timeout=600)
        if result.returncode != 0:
            raise ImageStoreError(
                f"{what}: {' '.join(args)} exited {result.returncode}: {result.stderr.decode()[-2000:]}"
            )
        return result.stdout.decode()

    def clone(self, destination: Path) -> None:
        """A node's containerd root: hard links to the template's files, real copies of the bolt databases."""
        if destination.exists():
            raise ImageStoreError(f"{destination} exists: a node starts from an empty folder")
        result = subprocess.run(["cp", "-al", str(self.root), str(destination)], capture_output=True, text=True)
        if result.returncode != 0:
            raise ImageStoreError(f"cp -al {self.root} {destination}: {result.stderr[-2000:]}")
        for relative in BOLT_FILES:
            linked = destination / relative
            if linked.exists():
                copy = linked.with_name(linked.name + ".copy")
                shutil.copy2(linked, copy)
                os.replace(copy, linked)

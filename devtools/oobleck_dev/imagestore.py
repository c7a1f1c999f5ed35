"""One containerd image store, imported once, that every real node starts from.

The project image is ~6.4 GB and a containerd holds it twice (the layer blobs and the unpacked
snapshots, ~13 GB); once imported, the layer blobs are dropped (`ctr content prune references`). One containerd per node is required (a kubelet kills runtime pods it does not
own), so instead of importing into each node, the image is imported once into a template store
under the cache (`~/.cache/oobleck/k8s-node/store`), and each node's containerd root starts as a
hard-linked copy of it (`cp -al`): the files are shared, only containerd's two bolt databases are
real copies (bolt writes in place). Layer blobs and lower snapshot folders are never written by a
node (overlayfs writes a container's changes to a new upper folder), so sharing them is safe; a node
deleting an image only drops its own links. A new build of the image reaches the template through an
OCI layout beside it (ocilayout.py): buildah writes only the layers the layout lacks, and the archive
imported leaves out the layers the template has unpacked, so a source edit moves megabytes, not the
image. Older project images are removed from the template after the new one is in.

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
from oobleck_dev.ocilayout import LayoutImage, keep_only, unpacked_prefix, write_archive

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
        self.imported: dict[str, float] = {}
        """the last project image import: layers in the image, layers left out (unpacked already), GB streamed"""

    def _images_file(self) -> Path:
        return self.folder / "contents.json"

    def _contents(self) -> dict:
        try:
            contents = json.loads(self._images_file().read_text())
            return contents if isinstance(contents, dict) and contents.get("layer_blobs") == "pruned" else {}
        except (OSError, ValueError):
            return {}

    def images(self) -> list[str]:
        """The images the template holds (as recorded after its last complete import and prune)."""
        return list(self._contents().get("images") or [])

    def unpacked_layers(self) -> list[str]:
        """The project image's layer digests, bottom first, whose snapshots the template holds."""
        return list(self._contents().get("layers") or [])

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
            layers = self.unpacked_layers()
            if image not in present:
                layers = self._import_project_image(ctr, image, timeout_s)
            stale = [name for name in present if name.startswith(PROJECT_IMAGE_PREFIX) and name != image]
            if stale:
                # containerd's garbage collector then drops the layers no image uses any more.
                self._run([*ctr, "images", "remove", "--sync", *stale], "remove older project images")
            # A container runs on the unpacked snapshots; the layer blobs (as large again) only serve to unpack
            # once more. Dropping the manifests' references to them lets the garbage collector remove them; the
            # next import writes the blobs again, finds every unchanged layer already unpacked, and prunes again.
            self._run([*ctr, "content", "prune", "references"], "drop the unpacked layers' blobs")
            contents = {"images": sorted(wanted), "layer_blobs": "pruned", "layers": layers}
            self._images_file().write_text(json.dumps(contents))
        finally:
            stop_processes([containerd], 30.0)
            shutil.rmtree(work, ignore_errors=True)
        self.import_s = round(time.monotonic() - began, 1)

    def _import_project_image(self, ctr: list[str], image: str, timeout_s: float) -> list[str]:
        """Bring `image` into the layout (only its new layers are written), then stream ctr an archive without the
        layers the template has unpacked. Returns the image's layer digests."""
        layout = self.folder / "layout"
        tag = image.rpartition(":")[2]
        push = subprocess.run(
            [
                str(self.buildah),
                "push",
                "--quiet",
                "--disable-compression",
                "--format",
                "oci",
                image,
                f"oci:{layout}:{tag}",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if push.returncode != 0:
            raise ImageStoreError(f"buildah push {image} into {layout} (exit {push.returncode}): {push.stderr[-2000:]}")
        pushed = keep_only(layout, tag)
        skip = unpacked_prefix(pushed.layers, self.unpacked_layers())
        try:
            self._import_archive(ctr, layout, pushed, image, skip, timeout_s)
        except ImageStoreError:
            if not skip:
                raise
            # The snapshots recorded as unpacked are gone (the store was changed by hand): send every layer.
            self._import_archive(ctr, layout, pushed, image, 0, timeout_s)
        return pushed.layers

    def _import_archive(
        self, ctr: list[str], layout: Path, pushed: LayoutImage, image: str, skip: int, timeout_s: float
    ) -> None:
        # ctr's output goes to a file: a pipe nobody reads while the archive is written could fill and stall it.
        with tempfile.TemporaryFile() as output:
            importing = subprocess.Popen(
                [*ctr, "images", "import", "-"], stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT
            )
            assert importing.stdin is not None
            try:
                written = write_archive(importing.stdin, layout, pushed, image, skip)
                importing.stdin.close()
            except BrokenPipeError:
                written = -1  # ctr exited early: its output below says why
            code = importing.wait(timeout=timeout_s)
            output.seek(0)
            said = output.read().decode(errors="replace")
        if code != 0:
            raise ImageStoreError(
                f"ctr import of {image} into the template store {self.root} (exit {code}): {said[-2000:]}"
            )
        self.imported = {"layers": len(pushed.layers), "left_out": skip, "streamed_gb": round(written / 1e9, 3)}

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

"""One containerd image store, imported once, that every real node starts from.

The project image is ~6.4 GB and a containerd holds it twice (the layer blobs and the unpacked
snapshots, ~13 GB); once imported, the layer blobs are dropped (`ctr content prune references`). One containerd per node is required (a kubelet kills runtime pods it does not
own), so instead of importing into each node, the image is imported once into a template store
under the cache (`~/.cache/oobleck/k8s-node/store`), and each node's containerd root starts as a
hard-linked copy of it (`cp -al`): the files are shared, only containerd's two bolt databases are
real copies (bolt writes in place). Layer blobs and lower snapshot folders are never written by a
node (overlayfs writes a container's changes to a new upper folder), so sharing them is safe; a node
deleting an image only drops its own links. Older project images are removed from the template.

A new build imports only its changed layers. The archive streamed to `ctr images import` is an OCI layout
holding a manifest, the image's config and the layers from the first one the template has not unpacked yet
(a layer's snapshot is named by its chain ID), each rebuilt from buildah's store as it is sent
(buildahstore.py); containerd unpacks those onto the snapshots it has. A source edit reads and moves the
wheel's layer (megabytes), not the 6 GB of torch and CUDA wheels below it.

`pause_archive` makes the sandbox ("pause") image: a docker-archive with one static binary.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from oobleck_dev.buildahstore import BuildahStore, BuildahStoreError
from oobleck_dev.controlplane import ManagedProcess, stop_processes
from oobleck_dev.hoststate import unmount_under
from oobleck_dev.nodeconfig import NodeLayout, containerd_config

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
BOLT_FILES = ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db")
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"  # uncompressed: the store's own layers, as they are
IMAGE_NAME_ANNOTATION = "io.containerd.image.name"
COPY_CHUNK = 1 << 20  # names an index.json entry in `ctr images import`


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
            _add_bytes(tar, path, content)
    return archive.getvalue()


def chain_ids(diff_ids: Iterable[str]) -> list[str]:
    """The OCI chain IDs of a layer stack (what containerd names each layer's unpacked snapshot): the first
    layer's is its diff ID, each next one sha256 of "<chain below> <its diff ID>"."""
    chains: list[str] = []
    for diff_id in diff_ids:
        below = chains[-1] if chains else None
        chains.append(
            diff_id if below is None else "sha256:" + hashlib.sha256(f"{below} {diff_id}".encode()).hexdigest()
        )
    return chains


def _blob_name(digest: str) -> str:
    algorithm, hexdigest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hexdigest}"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


class TemplateStore:
    """The template containerd root under `folder` (`folder/root`), holding the pause and project images."""

    def __init__(self, folder: Path, pause_image: str, pause_binary: Path, buildah: Sequence[str]) -> None:
        self.folder = folder
        self.root = folder / "root"
        self.pause_image, self.pause_binary, self.buildah = pause_image, pause_binary, list(buildah)
        self.import_s: float | None = None  # seconds the last ensure() spent importing (None: nothing to do)
        self.imported_bytes = 0  # blob bytes the last ensure() streamed into containerd

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
        self.imported_bytes = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.serving() as ctr:
            present = set(self._run([*ctr, "images", "list", "--quiet"], "list images").split())
            if self.pause_image not in present:
                self._run(
                    [*ctr, "images", "import", "-"],
                    "import the pause image",
                    pause_archive(self.pause_binary, self.pause_image),
                )
            if image not in present:
                self._import_project_image(ctr, image, timeout_s)
            self._remove_all_but(ctr, wanted)
            # A container runs on the unpacked snapshots; the layer blobs (as large again) only serve to unpack
            # once more. Dropping the manifests' references to them lets the garbage collector remove them; an
            # import sends the blobs of the layers not unpacked yet only.
            self._run([*ctr, "content", "prune", "references"], "drop the unpacked layers' blobs")
            self._images_file().write_text(json.dumps({"images": sorted(wanted), "layer_blobs": "pruned"}))
        self.import_s = round(time.monotonic() - began, 1)

    @contextlib.contextmanager
    def serving(self) -> Iterator[list[str]]:
        """A containerd on the template root alone (no kubelet), for as long as the block runs: yields the `ctr`
        command that talks to it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        # Any mount the containerd of an import whose owner was killed left in the store.
        unmount_under(str(self.root))
        # The sockets live here: a unix socket's path has at most 104 bytes, which a folder under a test's
        # temporary path or a long $OOBLECK_CACHE can exceed.
        work = Path(tempfile.mkdtemp(prefix="oobleck-import-"))
        layout = NodeLayout(1, work)
        config = work / "config.toml"
        config.write_text(containerd_config(layout, self.pause_image, root=self.root))
        containerd = ManagedProcess(
            "containerd-import", ["containerd", "--config", str(config)], work / "containerd.log"
        )
        try:
            self._wait_socket(containerd, layout.socket)
            yield ["ctr", "--address", str(layout.socket), "--namespace", NAMESPACE]
        finally:
            stop_processes([containerd], 30.0)
            shutil.rmtree(work, ignore_errors=True)

    def _remove_all_but(self, ctr: list[str], wanted: set[str]) -> None:
        """Remove every image record but `wanted` and the ID references the CRI plugin keeps for them
        (`sha256:<config>`, same manifest); containerd's garbage collector then drops the layers no image
        uses any more."""
        records = [line.split() for line in self._run([*ctr, "images", "list"], "list images").splitlines()[1:]]
        kept_manifests = {fields[2] for fields in records if len(fields) > 2 and fields[0] in wanted}
        stale = [fields[0] for fields in records if len(fields) > 2 and fields[2] not in kept_manifests]
        if stale:
            self._run([*ctr, "images", "remove", "--sync", *stale], "remove older images")

    def _import_project_image(self, ctr: list[str], image: str, timeout_s: float) -> None:
        shutil.rmtree(self.folder / "oci", ignore_errors=True)  # the OCI layout earlier versions pushed into
        buildah = BuildahStore(self.buildah)
        stored = buildah.image(image)
        unpacked = self._committed_snapshots(ctr)
        first_new = next(
            (i for i, chain in enumerate(chain_ids(stored.diff_ids)) if chain not in unpacked), len(stored.layers)
        )
        config_digest = "sha256:" + hashlib.sha256(stored.config).hexdigest()
        layers = [{"mediaType": OCI_LAYER, "digest": layer.diff_id, "size": layer.size} for layer in stored.layers]
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(stored.config)},
                "layers": layers,
            }
        ).encode()
        manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {IMAGE_NAME_ANNOTATION: image},
                }
            ],
        }
        with tempfile.TemporaryFile() as output:
            importer = subprocess.Popen(
                [*ctr, "images", "import", "-"], stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT
            )
            assert importer.stdin is not None
            try:
                with (
                    importer.stdin,
                    tarfile.open(
                        fileobj=importer.stdin, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=COPY_CHUNK
                    ) as tar,
                ):
                    _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
                    _add_bytes(tar, "index.json", json.dumps(index).encode())
                    _add_bytes(tar, _blob_name(manifest_digest), manifest)
                    _add_bytes(tar, _blob_name(config_digest), stored.config)
                    for layer in stored.layers[first_new:]:
                        info = tarfile.TarInfo(_blob_name(layer.diff_id))
                        info.size, info.mode = layer.size, 0o644
                        stream = buildah.stream(layer)
                        tar.addfile(info, stream)
                        stream.verify()
                        self.imported_bytes += layer.size
            except BrokenPipeError:
                pass  # ctr quit early: its exit status and output say why
            except BuildahStoreError as error:
                importer.kill()
                raise ImageStoreError(f"reading {image} from buildah's store: {error}") from None
            try:
                importer.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                importer.kill()
                raise ImageStoreError(f"importing {image} into {self.root} took over {timeout_s:g} s") from None
            output.seek(0)
            said = output.read().decode(errors="replace")
        if importer.returncode != 0:
            raise ImageStoreError(
                f"importing {image} into the template store {self.root} (layers {first_new}.. of "
                f"{len(stored.layers)}) failed: ctr exited {importer.returncode}: {said[-2000:]}"
            )

    def _committed_snapshots(self, ctr: list[str]) -> set[str]:
        lines = self._run([*ctr, "snapshots", "ls"], "list the unpacked layers").splitlines()[1:]
        return {fields[0] for fields in (line.split() for line in lines) if fields and fields[-1] == "Committed"}

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

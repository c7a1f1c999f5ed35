"""An image's layers read straight from buildah's store (containers/storage, overlay driver), one layer at a time.

`buildah push` reads every layer of an image from the store, even into a destination that holds most of
them already: for the project image, 6 GB read and hashed to send a wheel's few megabytes. Here a layer's tar
is rebuilt only when it is asked for, from what containers/storage keeps for that purpose: the layer's
tar-split (`overlay-layers/<id>.tar-split.gz`: the tar's headers and padding verbatim, and for each file its
name and size) and the files themselves (`overlay/<id>/diff`). The bytes are those of the layer's diff ID,
and `LayerStream` checks that digest as it streams; a mismatch is an error, never a silently different layer.

Read-only: the store is changed only by buildah (its files are replaced by rename, so a reader sees whole
ones). The image must stay in the store while its layers are read (scripts/test holds it with a container).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SEGMENT, FILE = 2, 1  # tar-split entry types: raw tar bytes (base64), a file's name and size
CHUNK = 1 << 20


class BuildahStoreError(RuntimeError):
    """The image or one of its layers could not be read from the store; the message says which."""


@dataclass(frozen=True)
class StoredLayer:
    id: str  # containers/storage's layer id
    diff_id: str  # sha256 of the layer's uncompressed tar
    size: int


@dataclass(frozen=True)
class StoredImage:
    name: str
    config: bytes  # exact bytes: their sha256 is the image's id
    layers: list[StoredLayer]  # bottom first, as the config's rootfs.diff_ids

    @property
    def diff_ids(self) -> list[str]:
        return [layer.diff_id for layer in self.layers]


class BuildahStore:
    """The store that `buildah` (a command with its --root and --storage-driver options) works on."""

    def __init__(self, buildah: Sequence[str]) -> None:
        self.buildah = list(buildah)
        root, driver = self._ask("info", "--format", "{{.store.GraphRoot}} {{.store.GraphDriverName}}").split()
        if driver != "overlay":
            raise BuildahStoreError(f"{root}: storage driver {driver!r}; only overlay layers are read here")
        self.root = Path(root)

    def image(self, name: str) -> StoredImage:
        info = json.loads(self._ask("inspect", "--type", "image", name))
        config = info["Config"].encode()
        image_id = info["FromImageID"]
        if hashlib.sha256(config).hexdigest() != image_id:
            raise BuildahStoreError(f"{name}: buildah's config is not the one image {image_id} was named for")
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        chain = self._layer_chain(self._top_layer(image_id))
        if [layer.diff_id for layer in chain] != diff_ids:
            raise BuildahStoreError(f"{name}: the store's layer chain does not match the config's diff IDs")
        return StoredImage(name, config, chain)

    def stream(self, layer: StoredLayer) -> LayerStream:
        return LayerStream(self.root, layer)

    def _top_layer(self, image_id: str) -> str:
        images = json.loads((self.root / "overlay-images" / "images.json").read_text())
        for image in images:
            if image["id"] == image_id:
                return image["layer"]
        raise BuildahStoreError(f"image {image_id} is not in {self.root}/overlay-images/images.json")

    def _layer_chain(self, top: str) -> list[StoredLayer]:
        records = {r["id"]: r for r in json.loads((self.root / "overlay-layers" / "layers.json").read_text())}
        chain: list[StoredLayer] = []
        layer_id: str | None = top
        while layer_id:
            record = records.get(layer_id)
            if record is None:
                raise BuildahStoreError(f"layer {layer_id} is not in {self.root}/overlay-layers/layers.json")
            chain.append(StoredLayer(layer_id, record["diff-digest"], int(record["diff-size"])))
            layer_id = record.get("parent")
        return chain[::-1]

    def _ask(self, *args: str) -> str:
        result = subprocess.run([*self.buildah, *args], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise BuildahStoreError(f"buildah {' '.join(args)}: {result.stderr.strip()[-2000:]}")
        return result.stdout


class LayerStream(io.RawIOBase):
    """A layer's tar, rebuilt from its tar-split and its files, as a readable file of `layer.size` bytes;
    `verify()` once it is read checks that they were the layer's diff ID."""

    def __init__(self, root: Path, layer: StoredLayer) -> None:
        self.layer = layer
        self._split = root / "overlay-layers" / f"{layer.id}.tar-split.gz"
        self._files = root / "overlay" / layer.id / "diff"
        if not self._split.is_file() or not self._files.is_dir():
            raise BuildahStoreError(f"layer {layer.id}: no tar-split or diff folder in {root}")
        self._chunks = self._generate()
        self._pending = memoryview(b"")
        self._digest = hashlib.sha256()
        self._sent = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        """Fill `buffer` (tarfile counts a short read as the end of the data)."""
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view):
            if not self._pending:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._pending = memoryview(chunk)
            n = min(len(view) - filled, len(self._pending))
            view[filled : filled + n] = self._pending[:n]
            self._digest.update(self._pending[:n])
            self._pending = self._pending[n:]
            filled += n
        self._sent += filled
        return filled

    def _generate(self) -> Iterator[bytes]:
        with gzip.open(self._split, "rt") as entries:
            for line in entries:
                entry = json.loads(line)
                if entry["type"] == SEGMENT:
                    yield base64.b64decode(entry["payload"])
                elif entry["type"] == FILE and entry.get("size"):
                    yield from self._file(entry["name"], int(entry["size"]))

    def _file(self, name: str, size: int) -> Iterator[bytes]:
        path = self._files / name
        if not path.resolve().is_relative_to(self._files.resolve()):
            raise BuildahStoreError(f"layer {self.layer.id}: tar-split names {name!r}, outside the layer")
        with path.open("rb") as source:
            left = size
            while left:
                chunk = source.read(min(left, CHUNK))
                if not chunk:
                    raise BuildahStoreError(f"layer {self.layer.id}: {name} is shorter than its {size} bytes")
                left -= len(chunk)
                yield chunk

    def verify(self) -> None:
        """Raise BuildahStoreError unless what was read, and nothing more, is the layer's tar."""
        while self.read(CHUNK):
            pass
        digest = "sha256:" + self._digest.hexdigest()
        if self._sent != self.layer.size or digest != self.layer.diff_id:
            raise BuildahStoreError(
                f"layer {self.layer.id}: rebuilt {self._sent} bytes with digest {digest}, "
                f"not its {self.layer.size} bytes of {self.layer.diff_id}"
            )

"""The project image as an OCI layout kept beside the template store, and the import archive made from it.

`buildah push ... oci:<layout>:<tag>` with uncompressed layers writes only the blobs the layout lacks: after a
source edit, the small top layer, the config and the manifest; the torch and dependency layers (~6 GB) are
neither read from buildah's store nor written again. The archive `ctr images import` reads is then made from
the layout, leaving out the layers whose snapshots the template store has already unpacked: containerd unpacks
a layer only when its snapshot (keyed by the chain of layers up to it) is missing, so it never needs those
blobs. Only a prefix of the layers the store holds can be left out: a layer's snapshot depends on every layer
below it.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REF_NAME = "org.opencontainers.image.ref.name"
"""The layout's tag annotation (buildah writes it)."""
IMAGE_NAME = "io.containerd.image.name"
"""The annotation `ctr images import` names the image by."""


@dataclass(frozen=True)
class LayoutImage:
    """One image in a layout: its index entry and manifest."""

    entry: dict[str, Any]
    manifest: dict[str, Any]

    @property
    def layers(self) -> list[str]:
        return [layer["digest"] for layer in self.manifest["layers"]]

    def blobs(self) -> list[str]:
        return [self.entry["digest"], self.manifest["config"]["digest"], *self.layers]


def blob_path(layout: Path, digest: str) -> Path:
    algorithm, _, hex_digest = digest.partition(":")
    if algorithm != "sha256" or len(hex_digest) != 64 or not all(c in "0123456789abcdef" for c in hex_digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return layout / "blobs" / "sha256" / hex_digest


def keep_only(layout: Path, tag: str) -> LayoutImage:
    """The image tagged `tag`; every other index entry and every blob it does not use are removed (a layout
    holds one image: older top layers would otherwise pile up with every build)."""
    index_file = layout / "index.json"
    index = json.loads(index_file.read_text())
    entry = next((m for m in index.get("manifests", []) if (m.get("annotations") or {}).get(REF_NAME) == tag), None)
    if entry is None:
        raise ValueError(f"{layout}: no image tagged {tag!r} in index.json")
    image = LayoutImage(entry, json.loads(blob_path(layout, entry["digest"]).read_text()))
    used = {blob_path(layout, digest).name for digest in image.blobs()}
    for path in (layout / "blobs" / "sha256").iterdir():
        if path.name not in used:
            path.unlink()
    index_file.write_text(json.dumps({**index, "manifests": [entry]}))
    return image


def unpacked_prefix(layers: Sequence[str], unpacked: Sequence[str]) -> int:
    """How many of `layers`, from the bottom, the store has unpacked in the same order (their snapshots exist)."""
    count = 0
    for mine, theirs in zip(layers, unpacked, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def write_archive(out: IO[bytes], layout: Path, image: LayoutImage, name: str, skip: int) -> int:
    """An OCI archive of `image` named `name`, without its `skip` lowest layers, written to `out` as a stream.
    Returns the bytes of blobs written."""
    # Named by containerd's own annotation only: with the layout's tag as well, ctr would add a second image.
    annotations = {k: v for k, v in (image.entry.get("annotations") or {}).items() if k != REF_NAME}
    entry = {**image.entry, "annotations": {**annotations, IMAGE_NAME: name}}
    index = {"schemaVersion": 2, "manifests": [entry]}
    written = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path, content in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps(index).encode()),
        ):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(content), 0o644
            tar.addfile(info, io.BytesIO(content))
        for digest in [image.entry["digest"], image.manifest["config"]["digest"], *image.layers[skip:]]:
            path = blob_path(layout, digest)
            tar.add(str(path), arcname=f"blobs/sha256/{path.name}")
            written += path.stat().st_size
    return written

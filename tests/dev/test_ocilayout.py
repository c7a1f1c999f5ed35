"""The OCI layout beside the real nodes' template store, and the import archive made from it (no root needed)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from oobleck_dev.ocilayout import IMAGE_NAME, REF_NAME, blob_path, keep_only, unpacked_prefix, write_archive


def _blob(layout: Path, content: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    path = blob_path(layout, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return {"digest": digest, "size": len(content)}


def _image(layout: Path, tag: str, layers: list[bytes]) -> dict[str, object]:
    manifest = {
        "schemaVersion": 2,
        "config": _blob(layout, f"config of {tag}".encode()),
        "layers": [_blob(layout, layer) for layer in layers],
    }
    return {**_blob(layout, json.dumps(manifest).encode()), "annotations": {REF_NAME: tag}}


def _layout(tmp_path: Path) -> Path:
    layout = tmp_path / "layout"
    old = _image(layout, "old", [b"torch", b"deps", b"wheel v1"])
    new = _image(layout, "new", [b"torch", b"deps", b"wheel v2"])
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [old, new]}))
    return layout


def test_the_layout_keeps_one_image_and_the_blobs_it_uses(tmp_path):
    layout = _layout(tmp_path)
    image = keep_only(layout, "new")
    assert [m["digest"] for m in json.loads((layout / "index.json").read_text())["manifests"]] == [
        image.entry["digest"]
    ]
    kept = sorted(p.name for p in (layout / "blobs" / "sha256").iterdir())
    assert kept == sorted(blob_path(layout, d).name for d in image.blobs())
    assert len(kept) == 5, "manifest, config and three layers; the old config, manifest and wheel are gone"
    with pytest.raises(ValueError, match="no image tagged 'old'"):
        keep_only(layout, "old")


def test_only_a_bottom_prefix_of_unpacked_layers_is_left_out():
    assert unpacked_prefix(["a", "b", "c"], ["a", "b", "x"]) == 2
    assert unpacked_prefix(["a", "b", "c"], []) == 0
    # A layer's snapshot is keyed by every layer below it: the same layer above a different one is not unpacked.
    assert unpacked_prefix(["a", "b", "c"], ["x", "b", "c"]) == 0
    assert unpacked_prefix(["a", "b"], ["a", "b", "c"]) == 2


def test_the_archive_names_the_image_and_leaves_out_the_unpacked_layers(tmp_path):
    layout = _layout(tmp_path)
    image = keep_only(layout, "new")
    out = io.BytesIO()
    written = write_archive(out, layout, image, "localhost/oobleck:new", skip=2)
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        names = tar.getnames()
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    assert names[:2] == ["oci-layout", "index.json"]
    sent = [image.entry["digest"], image.manifest["config"]["digest"], image.layers[2]]
    assert names[2:] == [f"blobs/sha256/{blob_path(layout, d).name}" for d in sent], "torch and deps left out"
    assert written == sum(blob_path(layout, d).stat().st_size for d in sent)
    (entry,) = index["manifests"]
    assert entry["annotations"] == {IMAGE_NAME: "localhost/oobleck:new"}, "one name only: ctr adds one image"
    assert entry["digest"] == image.entry["digest"]


def test_a_digest_that_is_not_sha256_hex_is_refused(tmp_path):
    for digest in ("sha256:../../etc/passwd", "md5:" + "0" * 64, "sha256:" + "g" * 64):
        with pytest.raises(ValueError, match="not a sha256 digest"):
            blob_path(tmp_path, digest)

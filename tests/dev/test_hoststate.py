"""What real nodes undo on the host (oobleck_dev.hoststate), on this host's real cgroup hierarchies."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from oobleck_dev import hoststate

pytestmark = pytest.mark.integration  # writes the host's cgroup folders (see tests/conftest.py: make test-unit)


def _writable_hierarchy() -> Path | None:
    for hierarchy in hoststate.cgroup_hierarchies():
        if os.access(hierarchy, os.W_OK):
            return hierarchy
    return None


def _node_tree(pods: int, below: str = "") -> tuple[str, list[Path]]:
    """A node's cgroup tree as a kubelet makes it (10 containers a pod) in a writable hierarchy: its name and
    its deepest folders."""
    hierarchy = _writable_hierarchy()
    if hierarchy is None:
        pytest.skip("no writable cgroup hierarchy (needs root)")
    name = f"oobleck-test-{uuid.uuid4().hex[:8]}"
    leaves = []
    for pod in range(pods):
        for container in range(10):
            leaf = hierarchy / name / "kubepods" / f"pod{pod}" / f"c{container}" / below
            leaf.mkdir(parents=True)
            leaves.append(leaf)
    return name, leaves


def test_a_cgroup_tree_whose_folders_vanish_meanwhile_is_still_removed_whole() -> None:
    """runc removes its container's cgroup while `down` walks the node's tree: a folder gone between the
    listing and the visit is skipped, not an error (a full real-node run once failed on it)."""
    name, leaves = _node_tree(pods=20)
    stop = threading.Event()

    def runc_cleaning_up() -> None:
        for leaf in reversed(leaves):
            if stop.is_set():
                return
            try:
                leaf.rmdir()
            except OSError:
                pass

    remover = threading.Thread(target=runc_cleaning_up)
    try:
        remover.start()
        assert hoststate.remove_cgroup_tree(name) == []
    finally:
        stop.set()
        remover.join()
        hoststate.remove_cgroup_tree(name)
    assert not any((h / name).exists() for h in hoststate.cgroup_hierarchies())


def test_killing_a_cgroup_tree_whose_folders_vanish_meanwhile_is_not_an_error() -> None:
    """The same race for the walk that signals the tree's processes (a full run failed on it in `down`)."""
    name, leaves = _node_tree(pods=40, below="inner")
    done = threading.Event()

    def runc_cleaning_up() -> None:
        for leaf in reversed(leaves):
            for folder in (leaf, leaf.parent):
                try:
                    folder.rmdir()
                except OSError:
                    pass
        done.set()

    remover = threading.Thread(target=runc_cleaning_up)
    try:
        remover.start()
        walks = 0
        while not done.is_set():
            assert hoststate.kill_cgroup_tree(name) == 0  # no process in it: nothing signalled, nothing raised
            walks += 1
    finally:
        remover.join()
        hoststate.remove_cgroup_tree(name)
    assert walks >= 1

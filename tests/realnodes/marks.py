"""The marks every real-node test module carries."""

from __future__ import annotations

import pytest


def realnode_marks(timeout_s: int) -> list[pytest.MarkDecorator]:
    """Marks of a module of jobs on real nodes that may take `timeout_s` (a first run builds and imports the
    image: minutes); one xdist group, because a host runs one set of real nodes at a time."""
    return [
        pytest.mark.realnodes,
        pytest.mark.integration,
        pytest.mark.slow,
        pytest.mark.image,
        pytest.mark.xdist_group("realnodes"),
        pytest.mark.timeout(timeout_s),
    ]

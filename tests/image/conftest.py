"""The `image` marker: tests that build the project's image (scripts/image/build, cached) and run it."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "image: builds the Dockerfile with buildah and runs the image")

"""Lint, format and types: `make test` fails on any ruff or mypy finding (config in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import oobleck
from oobleck_dev.tools import cache_root

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


REPO = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def test_ruff_finds_nothing() -> None:
    result = run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted() -> None:
    result = run("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, "run `ruff format` on:\n" + result.stdout + result.stderr


def test_mypy_finds_nothing_in_the_product() -> None:
    # The product's folders have other import names than their paths (pyproject's package-dir): mypy
    # reads them as installed, through the editable link tree that holds `oobleck` (src/, operator/,
    # runtime/, planner_cy/ under their import names). Its cache lives with the project's other caches, so
    # that a fresh clone checks in a second what did not change (mypy re-reads a file whose hash differs).
    tree = Path(oobleck.__path__[0])
    assert (tree / "operator").is_dir() and (tree / "runtime").is_dir(), f"not the editable link tree: {tree}"
    env = {**os.environ, "MYPY_CACHE_DIR": str(cache_root() / "mypy")}
    result = run("mypy", "--config-file", str(REPO / "pyproject.toml"), str(tree), env=env)
    assert result.returncode == 0, result.stdout + result.stderr

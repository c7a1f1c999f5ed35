"""Shared data for the OobleckJob API tests: the example job and the invalid variants of it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-gpt.yaml"
CASES = Path(__file__).with_name("invalid_jobs.yaml")


def example_job() -> dict[str, Any]:
    """examples/tiny-gpt.yaml as a dict."""
    return yaml.safe_load(EXAMPLE.read_text())


def with_changes(document: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of `document` with each dotted path set to its value (None removes the key)."""
    result = copy.deepcopy(document)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = result
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return result


def invalid_cases() -> list[dict[str, Any]]:
    """The cases of invalid_jobs.yaml, each with its full `manifest`."""
    cases = yaml.safe_load(CASES.read_text())
    ids = [case["id"] for case in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids in invalid_jobs.yaml"
    base = example_job()
    return [{**case, "manifest": with_changes(base, case["set"])} for case in cases]


@pytest.fixture
def example() -> dict[str, Any]:
    """A fresh copy of examples/tiny-gpt.yaml."""
    return example_job()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrize over the invalid jobs by name: `invalid_case` (all), `invalid_spec_case` (those
    # the spec model can judge).
    if "invalid_case" in metafunc.fixturenames:
        cases = invalid_cases()
        metafunc.parametrize("invalid_case", cases, ids=[c["id"] for c in cases])
    if "invalid_spec_case" in metafunc.fixturenames:
        cases = [c for c in invalid_cases() if "pydantic" in c]
        metafunc.parametrize("invalid_spec_case", cases, ids=[c["id"] for c in cases])

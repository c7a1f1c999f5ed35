"""Builders shared by the operator's unit tests (the `h` fixture): specs, pod and node summaries."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

import pytest

from oobleck.api.resource import COORDINATOR_ROLE, WORKER_ROLE
from oobleck.api.spec import OobleckJobSpec, parse_spec
from oobleck.api.status import OobleckJobStatus
from oobleck.operator.decision import JobContext
from oobleck.operator.observe import NodeSummary, PodSummary
from oobleck.operator.render import coordinator_name, worker_name

JOB = "tiny"
UID = "uid-1"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def spec_dict(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"gpt": {"layers": 4, "hiddenSize": 64, "heads": 4, "sequenceLength": 32, "vocabSize": 256}},
        "nodes": {"min": 2, "max": 4},
        "gpusPerNode": 1,
        "device": "cuda",
        "f": 1,
        "training": {"steps": 40, "globalBatchSize": 16, "microbatchSize": 2},
    }
    spec.update(overrides)
    return spec


def spec(**overrides: Any) -> OobleckJobSpec:
    return parse_spec(spec_dict(**overrides))


def context(job_spec: OobleckJobSpec, status: OobleckJobStatus | None = None) -> JobContext:
    return JobContext(JOB, "ns", UID, 1, job_spec, status or OobleckJobStatus())


def worker(
    index: int, *, node: str | None = None, phase: str = "Running", generation: int | None = None, **fields: Any
) -> PodSummary:
    return PodSummary(
        name=worker_name(JOB, index),
        uid=f"pod-{index}",
        role=WORKER_ROLE,
        node_name=f"node-{index}" if node is None else (node or None),
        phase=phase,
        created=NOW.timestamp() - 5,
        generation=generation,
        owner_uid=UID,
        **fields,
    )


def coordinator() -> PodSummary:
    return PodSummary(
        name=coordinator_name(JOB),
        uid="c",
        role=COORDINATOR_ROLE,
        node_name="node-0",
        phase="Running",
        created=0.0,
        owner_uid=UID,
    )


def node(name: str, gpus: int = 8, allocatable: int | None = None, ready: str = "True", **fields: Any) -> NodeSummary:
    alloc = gpus if allocatable is None else allocatable
    return NodeSummary(
        name=name, ready=ready, capacity=(("nvidia.com/gpu", gpus),), allocatable=(("nvidia.com/gpu", alloc),), **fields
    )


def nodes(count: int) -> dict[str, NodeSummary]:
    return {f"node-{i}": node(f"node-{i}") for i in range(count)}


@pytest.fixture
def h():
    """This module: the builders above (conftest modules are not importable under --import-mode=importlib)."""
    return sys.modules[__name__]

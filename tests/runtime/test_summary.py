"""`oobleck launch`'s summary of the workers' loss records: a step logged twice (a replay after a rollback) must
agree within the engine's tolerance, since the replay may run in another layout."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from oobleck.runtime.backends.local.summary import summarize


@dataclass
class LoggedChild:
    losses_path: Path
    code: int | None = 0


def summary_of(tmp_path: Path, first: float, replayed: float):
    """Two steps by one worker in generation 0, step 1 logged again in generation 1 by another."""
    records = {
        "node1-gpu0": [(0, 0, 4.2), (1, 0, first)],
        "node3-gpu0": [(1, 1, replayed)],
    }
    children = {}
    for order, (worker, steps) in enumerate(records.items()):
        path = tmp_path / f"{worker}.losses.jsonl"
        lines = [{"step": s, "generation": g, "loss": loss, "time": 10.0 * order + s} for s, g, loss in steps]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        children[worker] = LoggedChild(path)
    return summarize(children, None, [], [], 2, "", 1.0, str(tmp_path))


def test_a_replay_one_float32_ulp_apart_is_the_same_step(tmp_path):
    summary = summary_of(tmp_path, 4.137394905090332, 4.137394428253174)  # seen after a rollback to 2 nodes
    assert summary.ok, summary.error
    assert summary.losses == {0: 4.2, 1: 4.137394428253174}


def test_a_replay_from_a_wrong_state_fails_the_run(tmp_path):
    summary = summary_of(tmp_path, 4.1373949, 4.1374949)
    assert not summary.ok and "step 1 logged twice with different losses" in summary.error


def test_non_finite_losses_agree_only_with_each_other(tmp_path):
    assert summary_of(tmp_path, math.nan, math.nan).ok
    assert not summary_of(tmp_path, math.nan, 4.2).ok

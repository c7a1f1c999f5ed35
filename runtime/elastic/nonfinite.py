"""A step whose loss or gradients are NaN or Inf: `training.onNonFinite` (fail | skipStep | rollback).

The engine checks its reduced gradient sums (and the loss) before the update (train/numerics.py
`find_non_finite`); the
verdict rides on the step's commit (runtime/elastic/commit.py StepCommit: a rank that saw one marks its
arrival, the last arrival writes "commit-nonfinite"), so every rank of the generation takes the same
branch at the same step, whether or not its own layers saw the NaN. Then `handle`:

- fail: raise a JobFault (NonFiniteLoss); the pod reports it and the operator fails the job with it.
- skipStep: no update; the step counts as done (the next step reads the next data). AdamW's per-parameter
  step counters still advance, so that they equal the global step, which copies and snapshots check.
- rollback: every rank restores its layers from the newest in-memory snapshot that all ranks hold
  (they agree on it through the store), and the step counts as done: training goes on with the next
  step's data from the snapshot's weights and moments (counters set to the global step as above).
"""

from __future__ import annotations

import datetime
import json
import logging

from oobleck.api.addresses import worker_id
from oobleck.api.causes import make_cause
from oobleck.runtime.causes import JobFault
from oobleck.runtime.elastic import keys

log = logging.getLogger("oobleck.runtime.elastic.nonfinite")

ROLLBACK_WAIT_S = 60.0


def _advance_counters(worker, step: int) -> None:
    for (layer, _), state in worker.optimizer.state.items():
        if layer in worker.layers:
            state.step.fill_(step + 1)


def handle(worker, detail: str, control=None) -> None:
    """Carry out the job's policy for a non-finite step `worker.step` (see the module docstring)."""
    step, policy = worker.step, worker.config.on_non_finite
    if worker.snapshots is not None:
        worker.snapshots.fence()  # a capture in flight reads the state changed below
    for _, module in worker.layers.items():
        module.zero_grad(set_to_none=True)
    log.warning(
        json.dumps({"event": "non-finite", "job": worker.config.job, "step": step, "policy": policy, "detail": detail})
    )
    if policy == "skipStep":
        _advance_counters(worker, step)
        return
    if policy == "rollback":
        restored = _rollback(worker, step, control)
        if restored is not None:
            _advance_counters(worker, step)
            log.warning(json.dumps({"event": "rolled-back", "job": worker.config.job, "step": step, "to": restored}))
            return
        detail += "; rollback: no snapshot that every rank holds (snapshot.interval_steps, a snapshot before this step)"
    raise JobFault(make_cause("NonFiniteLoss", f"step {step}: {detail}", field="spec.training.onNonFinite", step=step))


def _rollback(worker, step: int, control) -> int | None:
    """Restore every held layer from the newest snapshot step all members hold; that step, or None."""
    from oobleck.runtime.train.layer_state import unflatten

    snapshots = worker.snapshots
    if snapshots is None:
        return None
    snapshots.fence()
    held = set(worker.layers)
    store_ = snapshots.store
    mine = max(
        (s for s in store_.steps() if s <= step and held <= set(map(int, store_.holdings().get(str(s), [])))),
        default=-1,
    )
    agreed = mine
    if control is not None and worker.plan is not None and worker.plan.world_size > 1:
        agreed = _agree(control.store, worker, step, mine)
    if agreed < 0 or agreed > mine:
        return None
    try:
        data = {layer: store_.get(agreed, layer) for layer in held}
    except KeyError:
        return None
    for layer, module in worker.layers.items():
        unflatten(data[layer].to(worker.device), layer, module, worker.optimizer)
    return agreed


def _agree(store, worker, step: int, mine: int) -> int:
    """The smallest newest-snapshot step over the generation's members (each posts its own)."""
    plan = worker.plan
    prefix = keys.nonfinite_prefix(plan.generation, step)
    store.set(prefix + worker_id(worker.node, worker.gpu), str(mine))
    names = [prefix + worker_id(a.node, a.gpu) for a in plan.ranks]
    store.wait(names, datetime.timedelta(seconds=ROLLBACK_WAIT_S))
    return min(int(store.get(name)) for name in names)

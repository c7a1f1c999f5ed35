"""The coordinator store's keys: every name is built here, and the small operations on them.

Key layout (nothing else spells a key):

    epoch                   the store's incarnation: a fresh token every time a server starts (store.EPOCH_KEY)
    generation              the plan generation in force (written by the plan controller)
    gen{g}/abort            present once generation g is aborted; value: the first failure report
    gen{g}/ready/{worker}   present once the worker has adopted generation g
    failures                a queue of failure reports (JSON), consumed by the plan controller
    hb/{worker}             a worker's heartbeat counter (`add`), independent of generations
    progress/{worker}       the worker's last step event: {"generation", "step", "phase"}
    held/{worker}           the layers a worker holds and their step (the controller's copy sources),
                            its snapshots {step: layers} and its snapshot server's address (snapshot.py)
    snap/gen{g}/step{t}/done  ranks of generation g whose snapshot of step t reached their buddy
    snap/complete/{t}       present once some generation's ranks all finished their snapshot of step t
    gen{g}/commit/{step}/   "arrived" counter and "decision" (commit | commit-nonfinite | abort) of a step,
                            "nonfinite": what a rank found NaN/Inf (reconfig.py, nonfinite.py)
    nonfinite/{g}/{step}/{worker}  the newest snapshot step a worker holds, to agree on a rollback (nonfinite.py)
    gen{g}/holding/{worker} what a worker holds as it joins generation g (sources.py)
    live/{worker}           HOST:PORT of the worker's liveness responder (health.py)
    e{epoch}/{job}/gen{g}/  the rendezvous namespace of generation g (process groups, see groups.py)
"""

from __future__ import annotations

import datetime
import json

import torch.distributed as dist

from oobleck.runtime.elastic.store import is_store_loss

GENERATION_KEY = "generation"
FAILURES_QUEUE = "failures"


def abort_key(generation: int) -> str:
    """Present once `generation` is aborted: survivors `wait` on it (wakes in ~1.5 ms)."""
    return f"gen{generation}/abort"


def heartbeat_key(worker: str) -> str:
    return f"hb/{worker}"


def progress_key(worker: str) -> str:
    return f"progress/{worker}"


def ready_key(generation: int, worker: str) -> str:
    """Present once `worker` has adopted `generation` (peers then watch its heartbeat strictly)."""
    return f"gen{generation}/ready/{worker}"


def held_key(worker: str) -> str:
    """What a worker holds: {"generation", "step", "layers"} (the controller picks copy sources by it)."""
    return f"held/{worker}"


def snapshot_done_key(generation: int, step: int) -> str:
    """Counter: ranks of `generation` whose snapshot of `step` is captured and held by their buddy."""
    return f"snap/gen{generation}/step{step}/done"


def snapshot_complete_key(step: int) -> str:
    """Present once every rank of some generation finished its snapshot of `step`."""
    return f"snap/complete/{step}"


def holding_key(generation: int, worker: str) -> str:
    """What `worker` holds as it joins `generation` (sources.py: the members settle copy sources from these)."""
    return f"gen{generation}/holding/{worker}"


def nonfinite_prefix(generation: int, step: int) -> str:
    """Where each member posts the newest snapshot step it holds, to agree on a rollback (nonfinite.py)."""
    return f"nonfinite/{generation}/{step}/"


def liveness_key(worker: str) -> str:
    """`HOST:PORT` of `worker`'s liveness responder (rewritten after a coordinator restart; health.py)."""
    return f"live/{worker}"


def commit_prefix(generation: int, step: int) -> str:
    return f"gen{generation}/commit/{step}/"


def epoch_prefix(epoch: str) -> str:
    """Prefix of every rendezvous in store incarnation `epoch` (groups.py adds `{job}/gen{g}/`).

    Group names must never repeat (pytorch#55967), and a recreated store may see a rendezvous that
    the previous incarnation already half-ran: the epoch makes every name new.
    """
    return f"e{epoch}/"


def set_generation(store: dist.Store, generation: int) -> None:
    store.set(GENERATION_KEY, str(generation))


def current_generation(store: dist.Store) -> int | None:
    if not store.check([GENERATION_KEY]):
        return None
    return int(store.get(GENERATION_KEY))


def post_abort(store: dist.Store, generation: int, reason: dict) -> bool:
    """Abort `generation` (idempotent); returns True if this call was the first to abort it."""
    key = abort_key(generation)
    payload = json.dumps(reason, sort_keys=True)
    # compare_set with an empty expected value sets only if absent: the first reason wins.
    stored = store.compare_set(key, "", payload)
    return stored.decode() == payload


def aborted(store: dist.Store, generation: int) -> bool:
    return store.check([abort_key(generation)])


def wait_abort(store: dist.Store, generation: int, timeout_s: float) -> bool:
    """Block until `generation` is aborted or `timeout_s` passes; returns whether it was aborted."""
    try:
        store.wait([abort_key(generation)], datetime.timedelta(seconds=timeout_s))
        return True
    except RuntimeError as error:
        if is_store_loss(error):
            raise
        return False


def push_failure(store: dist.Store, report: dict) -> None:
    store.queue_push(FAILURES_QUEUE, json.dumps(report, sort_keys=True))


def pop_failures(store: dist.Store) -> list[dict]:
    """Every queued failure report, without blocking."""
    reports = []
    while store.queue_len(FAILURES_QUEUE) > 0:
        reports.append(json.loads(store.queue_pop(FAILURES_QUEUE, False)))
    return reports


def set_progress(store: dist.Store, worker: str, generation: int, step: int, phase: str) -> None:
    store.set(progress_key(worker), json.dumps({"generation": generation, "step": step, "phase": phase}))


def get_progress(store: dist.Store, workers: list[str]) -> dict[str, dict]:
    """Last progress event of each worker that reported one."""
    present = [w for w in workers if store.check([progress_key(w)])]
    if not present:
        return {}
    values = store.multi_get([progress_key(w) for w in present])
    return {w: json.loads(v) for w, v in zip(present, values)}

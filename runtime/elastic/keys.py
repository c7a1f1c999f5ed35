"""The coordinator store's keys: every name is built here, and the small operations on them.

Key layout (nothing else spells a key):

    epoch                   the store's incarnation: a fresh token every time a server starts (store.EPOCH_KEY)
    generation              the plan generation in force (written by the plan controller)
    gen{g}/abort            present once generation g is aborted; value: the first failure report
    gen{g}/wake/{worker}    set to wake the worker's abort listener (by every abort of g, for each member)
    gen{g}/ready/{worker}   present once the worker has adopted generation g
    failures                a queue of failure reports (JSON), consumed by the plan controller
    hb/{worker}             a worker's heartbeat counter (`set` to its next count), independent of generations
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

Values a worker acts on (aborts, failure reports, holdings in `held/` and `gen{g}/holding/`, liveness
addresses, commit decisions, `snap/complete/` marks) are sealed under the job key (signing.py) by the operations below; a value that does not verify
is treated as absent (and counted). `signer` defaults to this process's (`signing.job_signer`). Counters
(heartbeats; `add`: arrivals, snapshot acknowledgements) and progress reports cannot be sealed this way.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable

import torch.distributed as dist

from oobleck.runtime.elastic.signing import Signer, job_signer
from oobleck.runtime.elastic.store import is_store_loss

GENERATION_KEY = "generation"
FAILURES_QUEUE = "failures"


def abort_key(generation: int) -> str:
    """Present once `generation` is aborted (its value: the first failure report, signed)."""
    return f"gen{generation}/abort"


def wake_key(generation: int, worker: str) -> str:
    """Set for each member of `generation` by every abort of it, and by a worker whose abort listener must move
    on: the listener blocks on its own key (a TCPStore `wait` ends only when the key it waits for is set)."""
    return f"gen{generation}/wake/{worker}"


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
    """Counter: ranks of `generation` whose snapshot of `step` is captured and held by their buddy (the layers
    the buddy holds itself, by its own capture)."""
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


def decision_key(generation: int, step: int) -> str:
    """The commit decision of `step` (commit.py): first writer wins."""
    return commit_prefix(generation, step) + "decision"


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


def post_abort(
    store: dist.Store, generation: int, reason: dict, members: Iterable[str], signer: Signer | None = None
) -> bool:
    """Abort `generation` (idempotent) and wake its `members`' abort listeners; returns True if this call was the
    first to abort it."""
    signer = signer or job_signer()
    key = abort_key(generation)
    payload = signer.seal(key, json.dumps(reason, sort_keys=True))
    # compare_set with an empty expected value sets only if absent: the first reason wins.
    stored = store.compare_set(key, "", payload).decode()
    first = stored == payload
    if not first and signer.verified(key, stored, "abort") is None:
        # A stranger's value holds the key: ours replaces it (it must not block the job's real abort).
        store.set(key, payload)
        first = True
    wake(store, generation, members)  # after the abort is in force: a woken listener reads it
    return first


def wake(store: dist.Store, generation: int, workers: Iterable[str]) -> None:
    """Wake the abort listeners of `workers` waiting in `generation` (a wake is no abort: they look for one)."""
    names = [wake_key(generation, w) for w in workers]
    if names:
        store.multi_set(names, ["1"] * len(names))


def abort_reason(store: dist.Store, generation: int, signer: Signer | None = None) -> bytes | None:
    """The first failure report that aborted `generation` (JSON), or None (not aborted, or only by a stranger)."""
    key = abort_key(generation)
    if not store.check([key]):
        return None
    return (signer or job_signer()).verified(key, store.get(key), "abort")


def aborted(store: dist.Store, generation: int, signer: Signer | None = None) -> bool:
    return abort_reason(store, generation, signer) is not None


def wait_abort(store: dist.Store, generation: int, worker: str, timeout_s: float, signer: Signer | None = None) -> bool:
    """`worker`'s abort listener: block until `generation` is aborted, `worker` is woken (`wake`) or `timeout_s`
    passes; returns whether `generation` is aborted (a verified abort: a stranger's value aborts nothing, and
    it does not end the wait either, since only the wake key does)."""
    key = wake_key(generation, worker)
    store.delete_key(key)  # a wake already taken; an abort posted before this is seen just below
    if aborted(store, generation, signer):
        return True
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        if is_store_loss(error):
            raise
        return False
    return aborted(store, generation, signer)


def push_failure(store: dist.Store, report: dict, signer: Signer | None = None) -> None:
    value = (signer or job_signer()).seal(FAILURES_QUEUE, json.dumps(report, sort_keys=True))
    store.queue_push(FAILURES_QUEUE, value)


def pop_failures(store: dist.Store, signer: Signer | None = None) -> list[dict]:
    """Every queued failure report that verifies, without blocking (refused ones are dropped and counted)."""
    signer = signer or job_signer()
    reports = []
    while store.queue_len(FAILURES_QUEUE) > 0:
        report = signer.open_json(FAILURES_QUEUE, store.queue_pop(FAILURES_QUEUE, False), "failure_report")
        if report is not None:
            reports.append(report)
    return reports


def propose_decision(store: dist.Store, generation: int, step: int, proposal: str, signer: Signer | None = None) -> str:
    """Post `proposal` as `step`'s commit decision unless one is in force (compare-and-set: the first writer
    wins); returns the decision in force. A stranger's value in the way is cleared (only if unchanged, so a
    real decision posted meanwhile stands) and the proposal tried again."""
    signer = signer or job_signer()
    key = decision_key(generation, step)
    sealed = signer.seal(key, proposal)
    for _ in range(16):
        stored = store.compare_set(key, "", sealed)
        decision = signer.verified(key, stored, "commit_decision") if stored else None
        if decision is not None:
            return decision.decode()
        store.compare_set(key, stored, "")  # "" counts as absent for the next compare_set
    raise RuntimeError(f"commit decision of step {step}: a stranger keeps overwriting it")


_PEEK = b"\x00oobleck-peek\x00"
"""A value no writer ever stores: `peek`'s compare-and-set expects it, so it never changes a key."""


def peek(store: dist.Store, key: str) -> bytes | None:
    """`key`'s value, or None when it is absent, in one round trip that never blocks.

    `check` + `get` cost three round trips on a TCPStore (its `get` waits for the key first, then reads
    it); a compare-and-set expecting a value nobody stores changes nothing and answers the value in
    force, or (key absent) the expected value back. Every rank waiting for a step's commit decision
    reads it this way on the step's critical path."""
    value = bytes(store.compare_set(key, _PEEK, _PEEK))
    return None if value == _PEEK else value


def read_decision(store: dist.Store, generation: int, step: int, signer: Signer | None = None) -> str | None:
    """`step`'s commit decision, or None (not decided yet, or a value that does not verify)."""
    key = decision_key(generation, step)
    stored = peek(store, key)
    if not stored:
        return None
    decision = (signer or job_signer()).verified(key, stored, "commit_decision")
    return None if decision is None else decision.decode()


def mark_snapshot_complete(store: dist.Store, step: int, signer: Signer | None = None) -> None:
    key = snapshot_complete_key(step)
    store.set(key, (signer or job_signer()).seal(key, "1"))


def snapshot_complete(store: dist.Store, step: int, signer: Signer | None = None) -> bool:
    """Whether every rank of some generation finished its snapshot of `step` (a forged mark does not count:
    it would let retention drop the newest complete step)."""
    key = snapshot_complete_key(step)
    return (
        store.check([key]) and (signer or job_signer()).verified(key, store.get(key), "snapshot_complete") is not None
    )


def set_held(store: dist.Store, worker: str, value: dict, signer: Signer | None = None) -> None:
    """Publish what `worker` holds (`held_key`)."""
    key = held_key(worker)
    store.set(key, (signer or job_signer()).seal(key, json.dumps(value)))


def get_held(store: dist.Store, worker: str, signer: Signer | None = None) -> dict | None:
    """What `worker` published as held, or None (nothing yet, or a value that does not verify)."""
    key = held_key(worker)
    if not store.check([key]):
        return None
    return (signer or job_signer()).open_json(key, store.get(key), "held")


def set_holding(store: dist.Store, generation: int, worker: str, value: str, signer: Signer | None = None) -> None:
    key = holding_key(generation, worker)
    store.set(key, (signer or job_signer()).seal(key, value))


def open_holdings(
    generation: int, workers: list[str], values: list[bytes], signer: Signer | None = None
) -> dict[str, bytes | None]:
    """The holdings `values` (read at `holding_key(generation, w)` for each of `workers`), None where refused."""
    signer = signer or job_signer()
    return {w: signer.verified(holding_key(generation, w), v, "holding") for w, v in zip(workers, values)}


def set_liveness(store: dist.Store, worker: str, address: str, signer: Signer | None = None) -> None:
    key = liveness_key(worker)
    store.set(key, (signer or job_signer()).seal(key, address))


def get_liveness(store: dist.Store, workers: list[str], signer: Signer | None = None) -> dict[str, str]:
    """The liveness responder addresses of those of `workers` that published one that verifies."""
    signer = signer or job_signer()
    found = {}
    for worker in workers:
        key = liveness_key(worker)
        if store.check([key]):
            address = signer.verified(key, store.get(key), "liveness")
            if address is not None:
                found[worker] = address.decode()
    return found


def set_progress(store: dist.Store, worker: str, generation: int, step: int, phase: str) -> None:
    store.set(progress_key(worker), json.dumps({"generation": generation, "step": step, "phase": phase}))


def get_progress(store: dist.Store, workers: list[str]) -> dict[str, dict]:
    """Last progress event of each worker that reported one."""
    present = [w for w in workers if store.check([progress_key(w)])]
    if not present:
        return {}
    values = store.multi_get([progress_key(w) for w in present])
    return {w: json.loads(v) for w, v in zip(present, values)}

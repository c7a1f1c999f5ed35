"""Store values under the job key, against a stranger's plain TCPStore client on the same real store."""

from __future__ import annotations

import json
import os
import stat

import pytest
from torch.distributed import TCPStore

from oobleck.runtime.elastic import keys
from oobleck.runtime.elastic.signing import Rejected, Signer, load_key, write_key
from oobleck.runtime.train.metrics import WorkerMetrics

pytestmark = pytest.mark.integration


@pytest.fixture
def stores():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    stranger = TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    return master, job, LandedWrites(stranger)


class LandedWrites:
    """A store connection whose writes have reached the server when they return. TCPStore's `set` and
    `queue_push` send without waiting for a reply, and the job reads on its own connection, which can
    overtake them (CI once read `held/node2:0` before the forged value existed, so nothing was refused):
    a round trip on the same connection comes back only after the write was applied."""

    def __init__(self, store: TCPStore) -> None:
        self._store = store

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)
        self._store.check([key])

    def queue_push(self, key: str, value: str) -> None:
        self._store.queue_push(key, value)
        self._store.queue_len(key)

    def get(self, key: str) -> bytes:
        return self._store.get(key)


def test_a_key_file_is_private_and_read_back(tmp_path):
    path = tmp_path / "job.key"
    key = write_key(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_key(str(path)) == key and len(key) >= 32
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="OOBLECK_JOB_KEY_FILE=.*short.*at least 16"):
        load_key(str(tmp_path / "short"))


def test_a_strangers_abort_is_ignored_counted_and_replaced_by_the_jobs(stores):
    _, job, stranger = stores
    signer = Signer(b"j" * 32)
    metrics = WorkerMetrics("job", "node0", 0)
    signer.on_reject(metrics.count_rejected)
    stranger.set(keys.abort_key(3), json.dumps({"kind": "heartbeat", "dead": ["node0:0"]}))
    assert not keys.aborted(job, 3, signer)
    assert keys.abort_reason(job, 3, signer) is None
    assert not keys.wait_abort(job, 3, "node0:0", 0.1, signer), "a present but forged abort key aborts nothing"
    assert signer.rejected["abort"] == 1, "one forged value read three times is one refused message"
    sample = metrics.registry.get_sample_value(
        "oobleck_worker_rejected_messages_total", {"job": "job", "node": "node0", "gpu": "0", "kind": "abort"}
    )
    assert sample == signer.rejected["abort"]
    # The job's own abort replaces the forged value, then the first real reason wins.
    assert keys.post_abort(job, 3, {"kind": "process-exit", "dead": ["node1:0"]}, ["node0:0"], signer)
    assert not keys.post_abort(job, 3, {"kind": "other"}, ["node0:0"], signer)
    assert keys.wait_abort(job, 3, "node0:0", 1.0, signer)
    assert json.loads(keys.abort_reason(job, 3, signer) or b"") == {"kind": "process-exit", "dead": ["node1:0"]}
    # A stranger overwriting it afterwards is refused again.
    stranger.set(keys.abort_key(3), "anything")
    assert not keys.aborted(job, 3, signer)


def test_held_holdings_failures_and_liveness_verify_under_the_key(stores):
    _, job, stranger = stores
    signer = Signer(b"j" * 32)
    keys.set_held(job, "node1:0", {"snapshot_address": "10.0.0.2:5000"}, signer)
    assert keys.get_held(job, "node1:0", signer) == {"snapshot_address": "10.0.0.2:5000"}
    # A value copied to another worker's key, or rewritten by a stranger, does not verify.
    stranger.set(keys.held_key("node2:0"), job.get(keys.held_key("node1:0")))
    assert keys.get_held(job, "node2:0", signer) is None
    stranger.set(keys.held_key("node1:0"), json.dumps({"snapshot_address": "6.6.6.6:1"}))
    assert keys.get_held(job, "node1:0", signer) is None
    keys.set_holding(job, 2, "node1:0", '{"step": 4}', signer)
    stranger.set(keys.holding_key(2, "node2:0"), '{"step": 9}')
    values = job.multi_get([keys.holding_key(2, w) for w in ("node1:0", "node2:0")])
    assert keys.open_holdings(2, ["node1:0", "node2:0"], values, signer) == {"node1:0": b'{"step": 4}', "node2:0": None}
    keys.push_failure(job, {"kind": "heartbeat", "dead": ["node3:0"]}, signer)
    stranger.queue_push(keys.FAILURES_QUEUE, json.dumps({"kind": "heartbeat", "dead": ["node0:0"]}))
    assert keys.pop_failures(job, signer) == [{"kind": "heartbeat", "dead": ["node3:0"]}]
    keys.set_liveness(job, "node1:0", "10.0.0.2:6000", signer)
    stranger.set(keys.liveness_key("node2:0"), "6.6.6.6:1")
    assert keys.get_liveness(job, ["node1:0", "node2:0"], signer) == {"node1:0": "10.0.0.2:6000"}
    assert {k: signer.rejected[k] for k in ("held", "holding", "failure_report", "liveness")} == {
        "held": 2,
        "holding": 1,
        "failure_report": 1,
        "liveness": 1,
    }
    with pytest.raises(Rejected):
        Signer(b"x" * 32).open(keys.held_key("node1:0"), job.get(keys.held_key("node1:0")), "held")


def test_without_a_key_values_are_stored_as_they_are(stores):
    _, job, stranger = stores
    plain = Signer(None)
    keys.set_held(job, "node1:0", {"step": 1}, plain)
    assert json.loads(stranger.get(keys.held_key("node1:0"))) == {"step": 1}
    stranger.set(keys.abort_key(0), json.dumps({"kind": "heartbeat"}))
    assert keys.aborted(job, 0, plain) and plain.rejected == {}


def test_a_strangers_commit_decision_is_never_followed_and_cannot_block_the_real_one(stores):
    _, job, stranger = stores
    signer = Signer(b"j" * 32)
    stranger.set(keys.decision_key(1, 5), "abort")
    assert keys.read_decision(job, 1, 5, signer) is None
    assert keys.propose_decision(job, 1, 5, "commit", signer) == "commit"
    assert keys.propose_decision(job, 1, 5, "abort", signer) == "commit", "the first real decision wins"
    assert keys.read_decision(job, 1, 5, signer) == "commit"
    stranger.set(keys.decision_key(1, 5), "abort")
    assert keys.read_decision(job, 1, 5, signer) is None
    assert signer.rejected["commit_decision"] == 1, "the same forged value, read twice, is one message"


def test_a_strangers_snapshot_complete_mark_does_not_count(stores):
    _, job, stranger = stores
    signer = Signer(b"j" * 32)
    stranger.set(keys.snapshot_complete_key(8), "1")
    assert not keys.snapshot_complete(job, 8, signer)
    keys.mark_snapshot_complete(job, 8, signer)
    assert keys.snapshot_complete(job, 8, signer)
    assert keys.snapshot_complete(job, 8, Signer(None)) and not keys.snapshot_complete(job, 9, signer)

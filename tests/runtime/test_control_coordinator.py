"""The coordinator's store: key layout, abort broadcast, failure queue, and surviving its own loss."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from oobleck.runtime.elastic import keys as co
from oobleck.runtime.elastic.coordinator import Coordinator
from oobleck.runtime.elastic.store import StoreTimeouts, StoreUnavailable, connect, is_store_loss

FAST = StoreTimeouts(connect_s=5.0, op_s=2.0, reconnect_s=10.0, retry_s=0.02)


def test_abort_is_first_writer_wins_and_wakes_waiters_fast():
    with Coordinator() as coordinator:
        waiter, _ = connect("127.0.0.1", coordinator.port, FAST)
        woke: list[float] = []
        thread = threading.Thread(
            target=lambda: (co.wait_abort(waiter, 7, "node0:0", 5.0), woke.append(time.perf_counter()))
        )
        thread.start()
        time.sleep(0.2)  # the waiter is blocked in store.wait
        poster = coordinator.store()
        posted = time.perf_counter()
        assert co.post_abort(poster, 7, {"by": "a"}, ["node0:0", "node1:0"]) is True
        assert co.post_abort(poster, 7, {"by": "b"}, ["node0:0", "node1:0"]) is False
        thread.join(5)
        assert woke, "the waiter never woke"
        assert woke[0] - posted < 0.1, f"abort broadcast took {woke[0] - posted:.4f} s"
        assert json.loads(poster.get(co.abort_key(7))) == {"by": "a"}
        assert co.aborted(poster, 7) and not co.aborted(poster, 8)
        assert co.wait_abort(poster, 8, "node0:0", 0.05) is False
        co.wake(poster, 8, ["node0:0"])  # a wake is no abort
        assert co.wait_abort(poster, 8, "node0:0", 5.0) is False


def test_failure_queue_and_progress_round_trip():
    with Coordinator() as coordinator:
        store = coordinator.store()
        assert co.pop_failures(store) == []
        co.push_failure(store, {"dead": ["n1:0"], "generation": 0})
        co.push_failure(store, {"dead": ["n2:0"], "generation": 0})
        assert [r["dead"] for r in co.pop_failures(store)] == [["n1:0"], ["n2:0"]]
        assert co.pop_failures(store) == []
        co.set_progress(store, "n0:0", 3, 12, "forward")
        assert co.get_progress(store, ["n0:0", "n9:0"]) == {"n0:0": {"generation": 3, "step": 12, "phase": "forward"}}
        assert co.current_generation(store) is None
        co.set_generation(store, 4)
        assert co.current_generation(store) == 4


def test_clients_survive_a_restarted_coordinator_with_a_new_epoch():
    coordinator = Coordinator().start()
    port, first_epoch = coordinator.port, coordinator.epoch
    client, epoch = connect("127.0.0.1", port, FAST)
    assert epoch == first_epoch
    client.add(co.heartbeat_key("n0:0"), 1)
    coordinator.stop()
    with pytest.raises(RuntimeError) as lost:
        client.add(co.heartbeat_key("n0:0"), 1)
    assert is_store_loss(lost.value)
    # A worker retries in the background while the coordinator is being recreated.
    result: list = []
    thread = threading.Thread(target=lambda: result.append(connect("127.0.0.1", port, FAST)))
    thread.start()
    time.sleep(0.3)
    restarted = Coordinator(port=port).start()
    thread.join(10)
    store, epoch = result[0]
    assert epoch == restarted.epoch != first_epoch
    # Every key of the old incarnation is gone; the rendezvous namespace differs for the same generation.
    assert not store.check([co.heartbeat_key("n0:0")])
    assert co.epoch_prefix(epoch) != co.epoch_prefix(first_epoch)
    restarted.stop()


def test_connect_gives_up_with_a_clear_error():
    with Coordinator() as coordinator:
        port = coordinator.port
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port} unreachable"):
        connect("127.0.0.1", port, StoreTimeouts(connect_s=0.2, reconnect_s=0.5, retry_s=0.05))


def test_port_out_of_range_is_refused():
    with pytest.raises(ValueError, match="port"):
        Coordinator(port=70000)


def _rendezvous(rank: int, port: int, prefix: str, out: list, world: int = 2) -> None:
    """One gloo group under `prefix` on a fresh client, then an all_reduce."""
    store, _ = connect("127.0.0.1", port, FAST)
    group_store = dist.PrefixStore(prefix, store)
    pg = dist.ProcessGroupGloo(group_store, rank, world, datetime.timedelta(seconds=20))
    tensor = torch.tensor([rank + 1.0])
    pg.allreduce([tensor]).wait()
    out.append(float(tensor))


def test_rendezvous_under_the_new_epoch_after_a_coordinator_loss():
    """A rendezvous cut by a coordinator loss is redone under the new incarnation's prefix."""
    coordinator = Coordinator().start()
    port = coordinator.port
    # Rank 0 arrives at generation 5 and leaves its address in the store; then the store dies.
    half = dist.PrefixStore(co.epoch_prefix(coordinator.epoch) + "job/gen5/", connect("127.0.0.1", port, FAST)[0])
    half.set("0", "stale address of rank 0")
    coordinator.stop()
    restarted = Coordinator(port=port).start()
    out: list = []
    prefix = co.epoch_prefix(restarted.epoch) + "job/gen5/"
    threads = [threading.Thread(target=_rendezvous, args=(r, port, prefix, out)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert out == [3.0, 3.0]
    restarted.stop()


@pytest.mark.integration
def test_module_entry_point_serves_until_sigterm(tmp_path):
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "oobleck.runtime.elastic.coordinator", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = json.loads(proc.stdout.readline())
        store, epoch = connect("127.0.0.1", line["port"], FAST)
        assert epoch == line["epoch"]
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_the_server_listens_on_its_host_alone_and_restarts_on_the_same_port():
    """Local nodes give each pod its own loopback address and the same port: two coordinators coexist."""
    import socket

    first = Coordinator("127.0.0.7", 0).start()
    try:
        second = Coordinator("127.0.0.8", first.port).start()  # same port, another address: no collision
        try:
            for coordinator in (first, second):
                store, epoch = connect(coordinator.host, coordinator.port, FAST)
                assert epoch == coordinator.epoch
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.9", first.port), timeout=2).close()
            old_epoch = first.epoch
            first.stop()
            first.start()  # a restart comes back on the same address and port
            assert connect("127.0.0.7", first.port, FAST)[1] == first.epoch != old_epoch
        finally:
            second.stop()
    finally:
        first.stop()

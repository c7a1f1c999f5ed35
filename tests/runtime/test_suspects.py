"""The watcher's verdict rules on its own clock (suspects.PeerClocks), without threads or a store."""

from __future__ import annotations

from oobleck.runtime.elastic.health import HealthTimeouts
from oobleck.runtime.elastic.suspects import PeerClocks

TIMEOUTS = HealthTimeouts(dead_after_s=1.5)
PEERS = ("a", "b")


def _beating(clocks: PeerClocks, now: float) -> None:
    clocks.record(list(PEERS), [b"1", b"1"], now)


def test_an_armed_peer_silent_past_dead_after_is_dead_and_a_beating_one_is_not():
    clocks = PeerClocks()
    clocks.new_peers(PEERS, 0.0)
    _beating(clocks, 0.0)
    clocks.arm("a", 1.0)
    clocks.arm("b", 1.0)
    clocks.record(["b"], [b"2"], 2.0)
    assert clocks.dead(PEERS, {}, 2.4, TIMEOUTS) == ()
    assert clocks.dead(PEERS, {}, 2.6, TIMEOUTS) == ("a",)


def test_a_reconnects_grace_outlives_a_generation_switch_and_the_arming_inside_it():
    """After a coordinator restart the next generation can start while a peer's heartbeat thread still waits
    in its connect backoff: the peers are held to dead_after_s from the end of the grace, not from the switch."""
    clocks = PeerClocks()
    clocks.new_peers(PEERS, 0.0)
    _beating(clocks, 0.0)
    clocks.new_store(PEERS, resumed=10.0 + 3.0)  # reconnected at 10 s, rejoin grace 3 s
    clocks.new_peers(PEERS, 10.5)  # the next generation's watch
    clocks.arm("a", 11.0)
    clocks.arm("b", 11.0)
    clocks.record(["b"], [b"1"], 12.0)  # b's heartbeat thread is back; a's is still backing off
    assert clocks.dead(PEERS, {}, 13.0 + 1.4, TIMEOUTS) == ("b",)  # one that beat is judged from its beat
    assert clocks.dead(PEERS, {}, 13.0 + 1.6, TIMEOUTS) == ("a", "b")

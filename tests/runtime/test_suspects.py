"""The detector's verdict rules on its own clock (suspects.PeerClocks), and a probe round (suspects.ProbeRound)
against real sockets: one that the kernel accepts but nobody answers (a stopped process) and a live responder."""

from __future__ import annotations

import socket
import time

import pytest

from oobleck.runtime.elastic.health import HealthTimeouts
from oobleck.runtime.elastic.liveness import NO_ANSWER, LivenessResponder
from oobleck.runtime.elastic.suspects import PeerClocks, ProbeRound

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


def test_a_peer_whose_probe_round_is_out_waits_for_it_past_dead_after():
    """On an overloaded host a round confirms for up to confirm_timeout_s, longer than dead_after_s: its peer is
    judged by the round, not by its silence meanwhile."""
    clocks = PeerClocks()
    clocks.new_peers(PEERS, 0.0)
    _beating(clocks, 0.0)
    clocks.arm("a", 0.0)
    clocks.arm("b", 0.0)
    assert clocks.dead(PEERS, {}, 1.6, TIMEOUTS, probing=("a",)) == ("b",)
    assert clocks.dead(PEERS, {"a": "no answer"}, 1.6, TIMEOUTS) == ("a", "b")


def _wait_done(round_: ProbeRound, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not round_.done():
        assert time.monotonic() < end, "the probe round did not end"
        time.sleep(0.01)


def test_a_probe_round_names_a_peer_that_accepts_but_never_answers_and_spares_one_that_answers():
    responder = LivenessResponder("127.0.0.1")
    with socket.socket() as stopped:  # listening, never accepting: a stopped process's port
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(8)
        addresses = {"hung": f"127.0.0.1:{stopped.getsockname()[1]}", "live": responder.address}
        round_ = ProbeRound(HealthTimeouts(overloaded_per_core=1e9), addresses, lambda peer, moment: False)
        _wait_done(round_)
    unanswered = round_.unanswered()
    assert list(unanswered) == ["hung"] and NO_ANSWER in unanswered["hung"], unanswered


def test_a_suspect_that_beats_before_its_round_ends_is_spared():
    """The detector thread goes on reading beats while a round probes: a beat seen meanwhile spares the peer."""
    with socket.socket() as stopped:
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(8)
        beat_at: dict[str, float] = {}
        round_ = ProbeRound(
            HealthTimeouts(overloaded_per_core=1e9),
            {"slow": f"127.0.0.1:{stopped.getsockname()[1]}"},
            lambda peer, moment: beat_at.get(peer, float("-inf")) > moment,
        )
        beat_at["slow"] = time.monotonic()  # it beat while its probe was out
        _wait_done(round_)
    assert round_.unanswered() == {}


def test_a_suspicion_falls_due_after_the_silence_of_the_armed_peer_seen_last_and_not_again_within_its_probe():
    clocks = PeerClocks()
    clocks.new_peers(PEERS, 0.0)
    assert clocks.suspicion_due(PEERS, 0.15) == float("inf")  # nobody armed: silence is no suspicion yet
    clocks.arm("a", 1.0)
    clocks.arm("b", 1.0)
    clocks.record(["b"], [b"2"], 1.3)
    assert clocks.suspicion_due(PEERS, 0.15) == pytest.approx(1.15)
    clocks.probed["a"] = 1.2
    assert clocks.suspicion_due(PEERS, 0.15) == pytest.approx(1.35)

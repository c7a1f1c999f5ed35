"""Who among a worker's peers is dead: the detector's clocks of their heartbeats, and the liveness probes of
the silent ones (health.py's detector thread drives both; see its docstring for the protocol).

The verdict rules live here, apart from the threads: a peer is held to `dead_after_s` once it adopted the
generation (armed); a silent armed peer is probed after `suspect_after_s`, and a probe without an answer is
the verdict at once (confirmed first on an overloaded host).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from oobleck.runtime.elastic.liveness import NO_ANSWER, host_overloaded, probe_liveness

if TYPE_CHECKING:
    from oobleck.runtime.elastic.health import HealthTimeouts

log = logging.getLogger(__name__)


class PeerClocks:
    """The detector's view of its peers' heartbeat counters, on this worker's own monotonic clock."""

    def __init__(self) -> None:
        self.last_value: dict[str, int] = {}  # peers whose key exists in this store incarnation
        self.last_change: dict[str, float] = {}
        self.seen: set[str] = set()  # peers that have beaten at least once (in any incarnation)
        self.probed: dict[str, float] = {}  # suspects probed (monotonic time) since their last beat
        self.armed: set[str] = set()  # peers that adopted the generation: silence is death
        self.resumed = float("-inf")  # silence counts from no earlier than this (a store reconnect's grace)

    def new_peers(self, peers: tuple[str, ...], now: float) -> None:
        """A new peer set: every peer gets a full dead_after_s from now (or from the end of a reconnect's grace)."""
        self.last_change = dict.fromkeys(peers, max(now, self.resumed))
        self.last_value = {p: self.last_value[p] for p in peers if p in self.last_value}
        self.armed = set()

    def new_store(self, peers: tuple[str, ...], resumed: float) -> None:
        """A (new) store connection: silence counts from `resumed`, and the counters of a new incarnation
        must be checked for before multi_get waits on them. The grace outlives a generation switch and an
        arming inside it: after a coordinator restart the next generation can begin while a peer's heartbeat
        thread still waits in c10d's connect backoff (seen in CI: two peers silent 1.5 s after arming)."""
        self.resumed = resumed
        self.last_change = dict.fromkeys(peers, resumed)
        self.last_value = {}
        self.armed = set()

    def arm(self, peer: str, now: float) -> None:
        self.armed.add(peer)
        self.last_change[peer] = max(now, self.resumed)

    def record(self, present: list[str], values: list[bytes], now: float) -> set[str]:
        """Note the present peers' counters read at `now`; the peers that beat since the last read."""
        beat = set()
        for peer, raw in zip(present, values):
            value = int(raw)
            if self.last_value.get(peer) != value:
                self.last_value[peer] = value
                self.last_change[peer] = now
                self.seen.add(peer)
                self.probed.pop(peer, None)
                beat.add(peer)
        return beat

    def silence(self, peer: str, now: float) -> float:
        return now - self.last_change.get(peer, now)

    def beat_since(self, peer: str, moment: float) -> bool:
        """Whether `peer` beat (or its clock was reset) after monotonic time `moment` (read by a ProbeRound's thread)."""
        return self.last_change.get(peer, float("-inf")) > moment

    def suspects(self, peers: tuple[str, ...], now: float, after_s: float) -> list[str]:
        """Armed peers silent for `after_s` and not probed within it."""
        return [
            p
            for p in peers
            if p in self.armed and self.silence(p, now) > after_s and now - self.probed.get(p, -1e9) > after_s
        ]

    def suspicion_due(self, peers: tuple[str, ...], after_s: float) -> float:
        """When the earliest armed peer becomes a suspect if it does not beat meanwhile (monotonic; inf: none)."""
        last = [max(self.last_change[p], self.probed.get(p, float("-inf"))) for p in peers if p in self.armed]
        return min(last) + after_s if last else float("inf")

    def dead(
        self,
        peers: tuple[str, ...],
        unanswered: dict[str, str],
        now: float,
        timeouts: HealthTimeouts,
        probing: tuple[str, ...] = (),
    ) -> tuple[str, ...]:
        """The verdict. A peer is held to dead_after_s once it has adopted the generation (armed): before
        that it may be importing torch or waiting in a rendezvous, where a loaded machine can starve its
        heartbeat thread of the GIL for seconds (measured: 1.5 s at load 13 on 2 cores). A death in that
        window surfaces as a rendezvous / collective error or through the controller (process or pod
        status); a peer that never beats at all is dead after startup_grace_s. A probe that got no
        answer is the verdict at once; a peer whose probe round is still out (`probing`) waits for it
        (its confirmation may outlast dead_after_s on an overloaded host)."""
        return tuple(
            p
            for p in peers
            if p in unanswered
            or (p not in probing and p in self.armed and self.silence(p, now) > timeouts.dead_after_s)
            or (p not in probing and p not in self.seen and self.silence(p, now) > timeouts.startup_grace_s)
        )


def probe_all(addresses: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Probe every peer at its responder `addresses[peer]` at once, for `timeout_s`; those that do not answer -> why."""
    results: dict[str, str | None] = {}

    def one(peer: str, address: str) -> None:
        results[peer] = probe_liveness(address, timeout_s)

    threads = [threading.Thread(target=one, args=item, daemon=True) for item in addresses.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * timeout_s)
    return {p: why for p, why in results.items() if why is not None}


class ProbeRound:
    """One round of liveness probes of silent peers, on a thread of its own: the detector's thread goes on
    beating and reading the peers' beats meanwhile (a confirmation on an overloaded host can outlast
    dead_after_s), and a suspect that beats before the round ends is spared.

    `beat_since(peer, t)`: whether the detector has seen `peer` beat after monotonic time `t`; `on_done`: called
    when the round ends (the detector judges it then, not at its next tick).
    """

    def __init__(
        self,
        timeouts: HealthTimeouts,
        addresses: dict[str, str],
        beat_since: Callable[[str, float], bool],
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.timeouts = timeouts
        self.addresses = addresses
        self.suspects = tuple(addresses)
        self.started = time.monotonic()
        self._beat_since = beat_since
        self._on_done = on_done
        self._unanswered: dict[str, str] = {}
        self._done = threading.Event()
        threading.Thread(target=self._run, name="oobleck-probe-round", daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def unanswered(self) -> dict[str, str]:
        """Once done: the suspects that neither answered nor beat since the round began -> why."""
        return {p: why for p, why in self._unanswered.items() if not self._beat_since(p, self.started)}

    def _run(self) -> None:
        try:
            unanswered = probe_all(self.addresses, self.timeouts.probe_timeout_s)
            if unanswered and host_overloaded(self.timeouts.overloaded_per_core):
                unanswered = self._confirm(unanswered)
            self._unanswered = unanswered
        except Exception:  # an unexpected error judges nobody: the suspects are probed again
            log.exception("liveness probe round")
        finally:
            self._done.set()
            self._on_done()

    def _confirm(self, unanswered: dict[str, str]) -> dict[str, str]:
        """Ask the peers that accepted but did not answer again until they answer or beat, for at most
        confirm_timeout_s (HealthTimeouts); those still silent then are the verdict."""
        hung = [p for p, why in unanswered.items() if NO_ANSWER in why]
        deadline = time.monotonic() + self.timeouts.confirm_timeout_s
        while hung and (left := deadline - time.monotonic()) > 0:
            again = probe_all({p: self.addresses[p] for p in hung}, min(left, 2 * self.timeouts.probe_timeout_s))
            hung = [p for p in hung if p in again and not self._beat_since(p, self.started)]
        return {p: why for p, why in unanswered.items() if NO_ANSWER not in why or p in hung}

"""Who among a worker's peers is dead: the watcher's clocks of their heartbeats, and the liveness probes of
the silent ones (health.py's watcher thread drives both; see its docstring for the protocol).

The verdict rules live here, apart from the threads: a peer is held to `dead_after_s` once it adopted the
generation (armed); a silent armed peer is probed after `suspect_after_s`, and a probe without an answer is
the verdict at once (confirmed first on an overloaded host).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from oobleck.runtime.elastic import keys
from oobleck.runtime.elastic.liveness import NO_ANSWER, host_overloaded, probe_liveness

if TYPE_CHECKING:
    from oobleck.runtime.elastic.health import HealthTimeouts


class PeerClocks:
    """The watcher's view of its peers' heartbeat counters, on this worker's own monotonic clock."""

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

    def suspects(self, peers: tuple[str, ...], now: float, after_s: float) -> list[str]:
        """Armed peers silent for `after_s` and not probed within it."""
        return [
            p
            for p in peers
            if p in self.armed and self.silence(p, now) > after_s and now - self.probed.get(p, -1e9) > after_s
        ]

    def dead(
        self, peers: tuple[str, ...], unanswered: dict[str, str], now: float, timeouts: HealthTimeouts
    ) -> tuple[str, ...]:
        """The verdict. A peer is held to dead_after_s once it has adopted the generation (armed): before
        that it may be importing torch or waiting in a rendezvous, where a loaded machine can starve its
        heartbeat thread of the GIL for seconds (measured: 1.5 s at load 13 on 2 cores). A death in that
        window surfaces as a rendezvous / collective error or through the controller (process or pod
        status); a peer that never beats at all is dead after startup_grace_s. A probe that got no
        answer is the verdict at once."""
        return tuple(
            p
            for p in peers
            if p in unanswered
            or (p in self.armed and self.silence(p, now) > timeouts.dead_after_s)
            or (p not in self.seen and self.silence(p, now) > timeouts.startup_grace_s)
        )


class SuspectProber:
    """Probes the silent peers' liveness responders, with the timeouts of `HealthTimeouts`."""

    def __init__(self, timeouts: HealthTimeouts) -> None:
        self.timeouts = timeouts

    def probe_suspects(
        self, store: dist.Store, clocks: PeerClocks, generation: int, peers: tuple[str, ...], present: list[str]
    ) -> dict[str, str]:
        """Probe the armed peers silent for suspect_after_s (not again within it); those that did not answer
        and did not beat meanwhile -> why."""
        now = time.monotonic()
        suspects = clocks.suspects(peers, now, self.timeouts.suspect_after_s)
        if not suspects or generation < 0:
            return {}
        unanswered = self.probe(store, suspects)
        if unanswered and host_overloaded(self.timeouts.overloaded_per_core):
            unanswered = self.confirm(store, unanswered, clocks.last_value)
        # The probes took this thread's time: every peer's beats are read again, so that one that beat
        # meanwhile (a probed one too: slow, not dead) is not judged on counters older than the probes
        # (a 2 s confirmation outlasts dead_after_s).
        again = store.multi_get([keys.heartbeat_key(p) for p in present]) if present else []
        now = time.monotonic()
        beat = clocks.record(present, again, now)
        clocks.probed.update((p, now) for p in suspects if p not in beat)
        return {p: why for p, why in unanswered.items() if p not in beat}

    def probe(self, store: dist.Store, suspects: list[str], timeout_s: float | None = None) -> dict[str, str]:
        """Probe the silent `suspects` at once (for `timeout_s`, default probe_timeout_s); those that do not
        answer -> why. A suspect that never published a responder is left to dead_after_s."""
        timeout = timeout_s or self.timeouts.probe_timeout_s
        addresses = keys.get_liveness(store, suspects)
        results: dict[str, str | None] = {}

        def one(peer: str, address: str) -> None:
            results[peer] = probe_liveness(address, timeout)

        threads = [threading.Thread(target=one, args=item, daemon=True) for item in addresses.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * timeout)
        return {p: why for p, why in results.items() if why is not None}

    def confirm(self, store: dist.Store, unanswered: dict[str, str], last_value: dict[str, int]) -> dict[str, str]:
        """Ask the peers that accepted but did not answer again until they answer or beat, for at most
        confirm_timeout_s (HealthTimeouts); those still silent then are the verdict."""
        hung = [p for p, why in unanswered.items() if NO_ANSWER in why]
        deadline = time.monotonic() + self.timeouts.confirm_timeout_s
        while hung and (left := deadline - time.monotonic()) > 0:
            again = self.probe(store, hung, min(left, 2 * self.timeouts.probe_timeout_s))
            beats = store.multi_get([keys.heartbeat_key(p) for p in hung])
            hung = [p for p, raw in zip(hung, beats) if p in again and last_value.get(p) == int(raw)]
        return {p: why for p, why in unanswered.items() if NO_ANSWER not in why or p in hung}

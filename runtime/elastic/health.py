"""Failure detection inside a worker: heartbeats, their watcher, collective errors and a GPU probe.

Every worker runs a few small daemon threads, each with its own store connection (a store client
serialises its operations, so a blocking wait must not sit in front of a beat):

- `oobleck-detect` beats (sets `hb/{worker}` to its next count) every `heartbeat_period_s` and reads the
  peers' counters every `watch_period_s` (by default the same period), in one thread (one wake-up per
  period, not one per task: on a host where the ranks share cores, every wake-up is CPU taken from
  training). A peer whose counter had not moved at a read is read again the moment its suspicion falls
  due, so silence is judged as finely as reads twice as frequent would, at a wake-up only when a beat
  was missed. The counters are kept
  on this worker's own monotonic clock, so clocks need not agree. A peer silent for `suspect_after_s`
  is probed, on a `ProbeRound` thread of its own so that the beats go on: its `LivenessResponder` is
  asked a question that C++ threads answer without Python's GIL, so a worker starved of CPU or of the
  GIL by its own training thread still answers, while one that is dead (connection refused), stopped
  or hung as a whole (SIGSTOP, a frozen host: no answer) or cut off by the network (no connection)
  does not. No answer within `probe_timeout_s` is the verdict; an answer spares the peer until
  `dead_after_s` of silence (a process whose Python is stuck but whose responder lives);
- `oobleck-abort` blocks on its wake key `gen{g}/wake/{worker}`, which every abort of the generation sets for
  each member (keys.post_abort), so that one worker's detection reaches every survivor in milliseconds.
  After a generation switch without an abort the detector thread wakes it onto the new generation (and
  looks for that generation's abort itself until it has moved); stop() wakes it too, so that the process
  never exits while the thread is inside a store call (CPython then ends it mid-call: SIGABRT);
- and, with `gpu_probe_period_s`, `oobleck-gpu-probe` probes the GPUs (a slow `nvidia-smi` must not delay
  a beat).

On a failure the detector sets `failure` (the Event the engine's waits check), posts the abort key
of the generation, and hands a `FailureReport` to a `FailureReporter` (locally: the coordinator's
failure queue, read by the plan controller; in a pod: an annotation on the worker's own pod).
A broken collective ("Connection closed by peer" on gloo's TCP pairs) is the fastest signal of a
process death: `signal(error)` turns it into the same failure path.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from oobleck.api.reports import FailureKind, FailureReport
from oobleck.runtime.elastic import keys
from oobleck.runtime.elastic.gpu_health import GpuHealth, probe_gpus
from oobleck.runtime.elastic.liveness import LivenessResponder, advertised_host
from oobleck.runtime.elastic.store import (
    Endpoint,
    KeptConnection,
    StoreTimeouts,
    StoreUnavailable,
    connect_endpoint,
    is_store_loss,
)
from oobleck.runtime.elastic.suspects import PeerClocks, ProbeRound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthTimeouts:
    """Detection timing; every value overridable (e.g. longer on a loaded machine)."""

    heartbeat_period_s: float = 0.05
    """How often a worker beats (sets its heartbeat counter to the next count)."""
    dead_after_s: float = 1.0
    """A peer whose counter has not moved for this long is dead even though its liveness responder answers
    (its Python is stuck), or when it has no responder (detection < dead_after + watch period)."""
    watch_period_s: float = 0.0
    """How often the detector reads the peers' counters (one round trip); 0: the heartbeat period. A peer not seen
    beating at a read is read again when its suspicion falls due, so a read period as long as the heartbeat's
    finds a silent peer as soon as twice as many reads would."""
    suspect_after_s: float = 0.0
    """Silence after which a peer is probed (a suspicion costs one probe, never a verdict by itself);
    0: max(0.15, 1.5 heartbeat periods)."""
    probe_timeout_s: float = 0.25
    """How long a probed peer has to answer; no answer is the verdict. A hung peer is found within
    suspect_after + watch period + this (0.45 s) of its last beat; a dead one within suspect_after +
    watch period (its port refuses the connection)."""
    confirm_timeout_s: float = 2.0
    """On an overloaded host (run queue above `overloaded_per_core` per core) a peer that accepted the probe
    but did not answer in probe_timeout_s is asked again, probe after probe, for up to this long before the
    verdict, and spared as soon as it answers or beats: its responder and its heartbeat thread may only be
    waiting for a time slice (seen under the test suite's load on 2 cores, where one second of asking was
    not always enough). A quiet host keeps the 0.45 s bound; a refused connection is a verdict at once
    either way."""
    overloaded_per_core: float = 2.0
    """Runnable tasks per core (the 1-minute load average, or those runnable at the probe's instant) above
    which the host counts as overloaded (see confirm_timeout_s)."""
    abort_wait_s: float = 2.0
    """Slice of the abort listener's blocking wait (on its wake key, set by every abort of the generation and when
    the listener must move on: a generation switch without an abort, stop()). The slice bounds only the listener's
    wake-ups, and how long stop() may wait for a listener it could not wake (its store unreachable)."""
    gpu_probe_period_s: float = 5.0
    """How often the GPU probe runs (0 disables it)."""
    startup_grace_s: float = 60.0
    """Silence allowed from a peer that has never beaten (still starting: importing torch takes seconds
    on a loaded machine). A death before the first beat is left to the controller (pod / process status)."""
    rejoin_grace_s: float = 3.0
    """Extra silence allowed after the coordinator came back: peers' clients reconnect with backoff."""
    abort_backstop_s: float = 1.0
    """How often the detector thread also looks for the abort key (the abort listener's blocking wait is the
    fast path; this covers a listener that gave up)."""

    def __post_init__(self) -> None:
        if self.watch_period_s == 0:
            object.__setattr__(self, "watch_period_s", self.heartbeat_period_s)
        if self.suspect_after_s == 0:
            object.__setattr__(self, "suspect_after_s", max(0.15, 1.5 * self.heartbeat_period_s))
        for name in (
            "heartbeat_period_s",
            "dead_after_s",
            "watch_period_s",
            "abort_wait_s",
            "suspect_after_s",
            "probe_timeout_s",
            "confirm_timeout_s",
            "overloaded_per_core",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.dead_after_s <= 2 * self.heartbeat_period_s:
            raise ValueError(
                f"dead_after_s: must exceed two heartbeat periods: {self.dead_after_s} <= 2 * {self.heartbeat_period_s}"
            )
        if not self.heartbeat_period_s < self.suspect_after_s <= self.dead_after_s:
            raise ValueError(
                f"suspect_after_s: must exceed one heartbeat period and not exceed dead_after_s: "
                f"{self.heartbeat_period_s} < {self.suspect_after_s} <= {self.dead_after_s} does not hold"
            )


class FailureReporter(Protocol):
    """Tells the plan controller about a failure. In a pod: annotate the worker's own pod."""

    def report(self, report: FailureReport) -> None: ...


class StoreFailureReporter:
    """Local reporter: pushes the report onto the coordinator's `failures` queue."""

    def __init__(self, endpoint: Endpoint, timeouts: StoreTimeouts = StoreTimeouts()) -> None:
        self._endpoint = endpoint
        self._timeouts = timeouts
        # Connected up front: a failure report must not wait for a connection.
        self._store = KeptConnection(
            lambda: connect_endpoint(endpoint, timeouts)[0], connect_endpoint(endpoint, timeouts)[0]
        )
        self._lock = threading.Lock()

    def report(self, report: FailureReport) -> None:
        def push(store: dist.Store) -> None:
            keys.push_failure(store, report.model_dump(mode="json"))
            # A push has no reply: on a connection to a dead server it "succeeds" silently.
            # A call that answers proves it arrived (or raises, and we push again).
            store.queue_len(keys.FAILURES_QUEUE)

        with self._lock:
            self._store.run(push)


class CallbackFailureReporter:
    """In-process reporter (tests, an embedded controller): calls `callback(report)`."""

    def __init__(self, callback: Callable[[FailureReport], None]) -> None:
        self._callback = callback

    def report(self, report: FailureReport) -> None:
        self._callback(report)


# Text of errors that mean "a peer of this collective is gone" (gloo TCP pairs, NCCL, the store).
_PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "Socket closed",
    "EOF",
    "Application timeout caused pair closure",
    "ncclRemoteError",
    "NCCL communicator was aborted",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether an exception from a collective / p2p op means a peer died or the link broke."""
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, dist.DistNetworkError) or any(marker in text for marker in _PEER_LOSS_MARKERS)


class FailureDetector:
    """A worker's failure detection: the detector (beats and watch), abort-listener and GPU-probe threads.

    Usage: `start()`, then for every plan generation: `watch(generation, peers)` before adopting it
    and `ready()` once adopted; the engine checks `failure`; the worker calls `signal(error)` when a
    collective raises.
    """

    def __init__(
        self,
        job: str,
        worker: str,
        endpoint: Endpoint,
        *,
        reporter: FailureReporter | None = None,
        timeouts: HealthTimeouts = HealthTimeouts(),
        store_timeouts: StoreTimeouts = StoreTimeouts(),
        failure: threading.Event | None = None,
        gpu_probe: Callable[[], list[GpuHealth]] = probe_gpus,
        advertise: str | None = None,
    ) -> None:
        """`advertise`: the address peers probe this worker's liveness responder at (default: advertised_host)."""
        self.job = job
        self._advertise = advertise
        self.worker = worker
        self._endpoint = endpoint
        self.timeouts = timeouts
        self._store_timeouts = store_timeouts
        self.reporter = reporter if reporter is not None else StoreFailureReporter(endpoint, store_timeouts)
        self.failure = failure if failure is not None else threading.Event()
        self._gpu_probe = gpu_probe
        self._stop = threading.Event()
        self._wake = threading.Event()  # the detector thread's sleep: set by stop() and by an ended probe round
        self._rearm = threading.Event()  # the idle abort listener's sleep: set by stop() and watch()
        self._listening = -1  # the generation the abort listener waits in (-1: none)
        self._woken = -1  # the generation the detector thread last woke the listener out of
        self._lock = threading.Lock()
        self._generation = -1
        self._peers: tuple[str, ...] = ()
        self._watch_version = 0  # bumped by watch(): the detector thread resets its clocks
        self._generation_epoch: str | None = None  # the epoch the watched generation began in
        self._reported: set[tuple[int, str]] = set()
        self.last_report: FailureReport | None = None
        self.epoch = ""
        self._threads: list[threading.Thread] = []
        self._trigger = KeptConnection(self._connect)
        self._trigger_lock = threading.RLock()  # _connect may re-enter trigger on a new epoch

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> FailureDetector:
        store, self.epoch, address = connect_endpoint(self._endpoint, self._store_timeouts)
        self._trigger = KeptConnection(self._connect, store)
        self.responder = LivenessResponder(self._advertise or advertised_host(address[0]))
        loops = [("oobleck-detect", self._detect_loop), ("oobleck-abort", self._abort_loop)]
        if self.timeouts.gpu_probe_period_s > 0:
            loops.append(("oobleck-gpu-probe", self._gpu_loop))
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._rearm.set()
        for thread in self._threads:
            # The detector thread wakes the abort listener as it ends; a listener it could not wake (the store
            # unreachable) leaves its wait within abort_wait_s.
            thread.join(timeout=self.timeouts.abort_wait_s + self._store_timeouts.connect_s)
        self._threads.clear()

    def watch(self, generation: int, peers: list[str] | tuple[str, ...], epoch: str | None = None) -> None:
        """Adopt a plan generation: clear `failure`, watch `peers` (this worker is skipped).

        `epoch`: the coordinator incarnation the generation rendezvouses in, when the caller knows it.
        A restart that a thread of this detector notices late (its own connection still on the old
        incarnation) then does not abort a generation that began after it.
        """
        with self._lock:
            self._generation = generation
            self._generation_epoch = epoch
            self._peers = tuple(p for p in peers if p != self.worker)
            self._watch_version += 1
            self.failure.clear()
        self._rearm.set()
        self._wake.set()  # the detector reads the new peers at once (it arms them as they adopt the generation)

    def ready(self) -> None:
        """This worker has adopted its generation: peers start holding it to `dead_after_s`."""
        generation = self._generation
        key = keys.ready_key(generation, self.worker)

        def mark(store: dist.Store) -> None:
            store.set(key, "1")
            store.check([key])  # `set` has no reply

        with self._trigger_lock:
            self._trigger.run(mark)

    @property
    def generation(self) -> int:
        return self._generation

    # -- failure entry points ----------------------------------------------------------------------

    def signal(self, error: BaseException) -> bool:
        """Classify an exception raised by a collective; a peer loss triggers the failure path."""
        if not is_peer_failure(error):
            return False
        self.trigger(FailureKind.COLLECTIVE, (), f"{type(error).__name__}: {error}")
        return True

    def trigger(
        self, kind: FailureKind, dead: tuple[str, ...], detail: str, generation: int | None = None
    ) -> FailureReport | None:
        """Set `failure`, abort the generation and report (once per generation and dead worker)."""
        with self._lock:
            generation = self._generation if generation is None else generation
            if generation != self._generation:
                return None  # a late signal about a generation this worker already left
            self.failure.set()
            fresh = tuple(d for d in dead if (generation, d) not in self._reported)
            if dead and not fresh:
                return None
            if not dead and (generation, "") in self._reported:
                return None
            self._reported.update((generation, d) for d in (fresh or ("",)))
        report = FailureReport(
            job=self.job, generation=generation, reporter=self.worker, kind=kind, dead=fresh, detail=detail
        )
        self.last_report = report
        log.warning("failure detected by %s in generation %d: %s %s %s", self.worker, generation, kind, fresh, detail)
        try:
            self._post_abort(generation, report)
        except (RuntimeError, StoreUnavailable) as error:
            log.error("cannot post the abort of generation %d: %s", generation, error)
        try:
            self.reporter.report(report)
        except (RuntimeError, StoreUnavailable) as error:
            log.error("cannot report the failure: %s", error)
        return report

    # -- threads -----------------------------------------------------------------------------------

    def _post_abort(self, generation: int, report: FailureReport) -> None:
        """Post the abort on a connection kept for it: connecting takes ~0.2 s on a busy host, and
        this is the critical path of every survivor's wake-up."""
        with self._lock:
            members = (*self._peers, self.worker) if generation == self._generation else (self.worker,)
        reason = report.model_dump(mode="json")
        with self._trigger_lock:
            self._trigger.run(lambda store: keys.post_abort(store, generation, reason, members))

    def _connect(self) -> dist.Store:
        store, epoch, _ = connect_endpoint(self._endpoint, self._store_timeouts)
        if epoch != self.epoch:
            log.warning("coordinator restarted: epoch %s -> %s", self.epoch, epoch)
            previous, self.epoch = self.epoch, epoch
            if previous and self._generation_epoch != epoch:
                # Groups of this generation may be half-built in the lost store: everyone leaves the
                # generation and re-rendezvouses under the next one (new epoch, new prefix).
                self.trigger(FailureKind.COORDINATOR_RESTART, (), f"store epoch {previous} -> {epoch}")
        return store

    def _detect_loop(self) -> None:
        """Beat, read the peers' beats and judge them (see the module docstring)."""
        key = keys.heartbeat_key(self.worker)
        clocks = PeerClocks()
        store: dist.Store | None = None
        seen_version = -1
        probes: ProbeRound | None = None
        judged: set[str] = set()  # the peers reported dead since the last watch()
        beats = 0
        # One wake-up per tick, on a fixed schedule; a beat or read due within half a tick is done at this one
        # (scheduled each on its own, they drift apart under load and the thread wakes twice a period). A read
        # is also due when a peer's suspicion falls due (`suspicion_due`): between ticks only if a peer was not
        # seen beating at the last read.
        tick = min(self.timeouts.heartbeat_period_s, self.timeouts.watch_period_s)
        next_tick = next_beat = next_read = next_abort_check = time.monotonic()
        suspicion_due = float("inf")
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                generation, peers, version = self._generation, self._peers, self._watch_version
            if version != seen_version:
                seen_version, probes = version, None  # a round about the previous peers is not judged
                judged = set()
                clocks.new_peers(peers, now)
                next_read = now
            try:
                if store is None:
                    store = self._connect()
                    # Before the first beat: a peer that sees us beat can also probe us. Again after a
                    # coordinator restart (an empty store), where nobody could beat during the outage and
                    # peers reconnect with c10d's backoff.
                    keys.set_liveness(store, self.worker, self.responder.address)
                    clocks.new_store(peers, time.monotonic() + self.timeouts.rejoin_grace_s)
                if now >= next_beat - tick / 2:
                    # A set has no reply to wait for (an add's would be a second wake-up a beat); the read
                    # below notices a lost connection.
                    beats += 1
                    store.set(key, str(beats))
                    next_beat = now + self.timeouts.heartbeat_period_s
                if now >= min(next_read - tick / 2, suspicion_due):
                    next_read = now + self.timeouts.watch_period_s
                    next_abort_check = self._mind_listener(store, generation, now, next_abort_check)
                    self._read_beats(store, clocks, generation, peers)
                    if probes is None and generation >= 0:
                        probes = self._probe_suspects(store, clocks, peers)
            except RuntimeError as error:
                if not is_store_loss(error):
                    raise
                store = None
                continue
            except StoreUnavailable as error:
                log.error("failure detector: %s", error)
                return
            unanswered: dict[str, str] = {}
            if probes is not None and probes.done():
                unanswered = probes.unanswered()
                ended = time.monotonic()
                clocks.probed.update((p, ended) for p in probes.suspects if not clocks.beat_since(p, probes.started))
                probes = None
            probing = probes.suspects if probes is not None else ()
            self._judge(store, clocks, generation, peers, unanswered, probing, judged)
            now = time.monotonic()
            next_tick = next_tick + tick if next_tick + tick > now else now + tick  # a late thread skips missed ticks
            suspicion_due = (
                clocks.suspicion_due(peers, self.timeouts.suspect_after_s) if probes is None else float("inf")
            )
            # (a floor: a suspicion due at this instant is one only once its silence exceeds suspect_after_s)
            self._wake.wait(max(min(next_tick, suspicion_due) - now, tick / 20))
            self._wake.clear()
        if store is not None and self._listening >= 0:  # stopping: the listener must leave its store call
            try:
                keys.wake(store, self._listening, [self.worker])
            except RuntimeError as error:
                log.info("failure detector: could not wake the abort listener: %s", error)

    def _mind_listener(self, store: dist.Store, generation: int, now: float, next_abort_check: float) -> float:
        """Wake the abort listener out of a wait in an older generation (a switch without an abort), and look for
        this generation's abort until it waits in it (else every abort_backstop_s: a listener that gave up);
        returns when to look next."""
        listening = self._listening
        if listening not in (-1, generation) and listening != self._woken:
            keys.wake(store, listening, [self.worker])
            self._woken = listening
        if generation >= 0 and not self.failure.is_set() and (listening != generation or now >= next_abort_check):
            next_abort_check = now + self.timeouts.abort_backstop_s
            if keys.aborted(store, generation):
                self._follow_abort(store, generation)
        return next_abort_check

    def _judge(
        self,
        store: dist.Store | None,
        clocks: PeerClocks,
        generation: int,
        peers: tuple[str, ...],
        unanswered: dict[str, str],
        probing: tuple[str, ...],
        judged: set[str],
    ) -> None:
        """Report the peers found dead now and not reported since the last watch() (`judged`, updated)."""
        now = time.monotonic()
        dead = clocks.dead(peers, unanswered, now, self.timeouts, probing)
        if dead and generation >= 0 and store is not None:
            dead = self._not_done(store, dead, generation)
        fresh = tuple(p for p in dead if p not in judged) if generation >= 0 else ()
        if fresh:
            judged.update(fresh)
            silent = ", ".join(f"{p} {clocks.silence(p, now):.2f}s{self._why(unanswered, p)}" for p in fresh)
            # On a thread of its own: a pod's report is a Kubernetes API call, and the beats must go on.
            threading.Thread(
                target=self.trigger,
                args=(FailureKind.HEARTBEAT, fresh, f"no heartbeat: {silent}", generation),
                name="oobleck-verdict",
                daemon=True,
            ).start()

    def _probe_suspects(self, store: dist.Store, clocks: PeerClocks, peers: tuple[str, ...]) -> ProbeRound | None:
        """Start a round of probes of the armed peers silent for suspect_after_s (not again within it), if any.
        A suspect that never published a responder is left to dead_after_s."""
        now = time.monotonic()
        suspects = clocks.suspects(peers, now, self.timeouts.suspect_after_s)
        if not suspects:
            return None
        addresses = keys.get_liveness(store, suspects)
        clocks.probed.update((p, now) for p in suspects if p not in addresses)
        return ProbeRound(self.timeouts, addresses, clocks.beat_since, self._wake.set) if addresses else None

    def _read_beats(self, store: dist.Store, clocks: PeerClocks, generation: int, peers: tuple[str, ...]) -> None:
        """Arm the peers that adopted `generation`, read every present peer's counter (its key exists in this
        store incarnation) into `clocks`."""
        for peer in peers:
            if peer not in clocks.armed and generation >= 0 and store.check([keys.ready_key(generation, peer)]):
                clocks.arm(peer, time.monotonic())  # it has adopted the generation: from now on, silence is death
        present = [p for p in peers if p in clocks.last_value or store.check([keys.heartbeat_key(p)])]
        values = store.multi_get([keys.heartbeat_key(p) for p in present]) if present else []
        clocks.record(present, values, time.monotonic())

    def _gpu_loop(self) -> None:
        while not self._stop.wait(self.timeouts.gpu_probe_period_s):
            self._check_gpus(self._generation)

    def _check_gpus(self, generation: int) -> None:
        bad = [g for g in self._gpu_probe() if not g.healthy]
        if bad and generation >= 0:
            detail = "; ".join(f"gpu {g.index}: {g.detail}" for g in bad)
            self.trigger(FailureKind.GPU, (self.worker,), detail, generation)

    @staticmethod
    def _not_done(store: dist.Store, dead: tuple[str, ...], generation: int) -> tuple[str, ...]:
        """`dead` without the peers that reported their last step done in `generation`: those exit on purpose
        when training ends, and a peer a moment behind them must not report them (it failed a finished job)."""
        try:
            progress = keys.get_progress(store, list(dead))
        except RuntimeError:  # the store went away: the report's own push decides what happens
            return dead
        finished = {p for p, r in progress.items() if r.get("phase") == "done" and r.get("generation") == generation}
        return tuple(p for p in dead if p not in finished)

    @staticmethod
    def _why(unanswered: dict[str, str], peer: str) -> str:
        return f" (probe: {unanswered[peer]})" if peer in unanswered else ""

    def _abort_loop(self) -> None:
        store: dist.Store | None = None
        while not self._stop.is_set():
            self._listening = -1
            self._rearm.clear()
            generation = self._generation
            if generation < 0 or self.failure.is_set():
                self._rearm.wait(self.timeouts.abort_wait_s)  # until the next watch()
                continue
            try:
                if store is None:
                    store = self._connect()
                self._listening = generation
                if keys.wait_abort(store, generation, self.worker, self.timeouts.abort_wait_s):
                    self._follow_abort(store, generation)
            except RuntimeError as error:
                if not is_store_loss(error):
                    raise
                store = None
                self._stop.wait(self._store_timeouts.retry_s)
            except StoreUnavailable as error:
                log.error("abort listener: %s", error)
                return
        self._listening = -1

    def _follow_abort(self, store: dist.Store, generation: int) -> None:
        """Another worker aborted `generation`: stop waiting on collectives now."""
        with self._lock:
            if generation != self._generation:
                return
            self.failure.set()
        try:
            reason = keys.abort_reason(store, generation)
            if reason is not None:
                self.last_report = FailureReport.model_validate_json(reason)
        except (RuntimeError, ValueError, TypeError):
            pass


def wait_alive(store: dist.Store, workers: list[str], timeout_s: float) -> None:
    """Block until every one of `workers` has sent a heartbeat (a start barrier for a controller)."""
    store.wait([keys.heartbeat_key(w) for w in workers], datetime.timedelta(seconds=timeout_s))

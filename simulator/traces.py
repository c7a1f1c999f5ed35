"""Availability traces: which nodes are up when. Read from files, or generated from a seed.

File format (the Oobleck artifact's, inherited from Bamboo's simulator): one event per line,
`TIME_MS,add|remove,NODE`, in time order; nodes added at time 0 are the starting cluster, which may be
empty: real availability traces start empty or grow (the job starts once its nodes can form a pipeline).
Our extension for stragglers: `TIME_MS,slow,NODE,SPEED`, where SPEED in (0, 1] is the node's speed from
then on as a share of its profiled speed (0.5: every stage on it takes twice as long; 1 ends a slowdown).
A node keeps its speed across removals and re-additions until the next `slow` event names it.
Blank lines and lines starting with `#` are comments, except `# duration_ms: N`, which sets how long the
trace runs. Without it (and without a duration given by the caller) a trace ends at its last event, as the
artifact's simulators stop there. Bad input raises TraceError naming the file, line and field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TRACES_DIR = Path(__file__).parent / "traces"


class TraceError(ValueError):
    """A trace file or generator argument that cannot be used; the message names where and which field."""


@dataclass(frozen=True)
class Event:
    time_s: float
    kind: str  # "add", "remove" or "slow"
    node: str
    speed: float = 1.0  # "slow" events: the node's speed from now on (share of its profiled speed)


SLOW = "slow"


@dataclass(frozen=True)
class Step:
    """Everything that happens at one time: nodes removed, nodes added, new speeds."""

    time_s: float
    removed: list[str]
    added: list[str]
    speeds: dict[str, float]


@dataclass(frozen=True)
class Trace:
    """Events in time order; `initial` are the nodes up at time 0 (their add events are not in `events`)."""

    name: str
    initial: tuple[str, ...]
    events: tuple[Event, ...]
    duration_s: float

    def batches(self) -> list[tuple[float, list[str], list[str]]]:
        """Availability events grouped by time: (time, removed nodes, added nodes), in time order."""
        return [(s.time_s, s.removed, s.added) for s in self.steps() if s.removed or s.added]

    def steps(self) -> list[Step]:
        """Every event grouped by time, speed changes included, in time order."""
        out: list[Step] = []
        for event in self.events:
            if not out or out[-1].time_s != event.time_s:
                out.append(Step(event.time_s, [], [], {}))
            if event.kind == SLOW:
                out[-1].speeds[event.node] = event.speed
            else:
                (out[-1].removed if event.kind == "remove" else out[-1].added).append(event.node)
        return out

    def slowdowns(self) -> int:
        """Speed changes below full speed (the straggler episodes)."""
        return sum(1 for e in self.events if e.kind == SLOW and e.speed < 1)

    def additions(self) -> int:
        return sum(1 for e in self.events if e.kind == "add")

    def ready_after(self, startup_s: float) -> Trace:
        """The same trace with every node usable `startup_s` after it is added (the node start-up delay,
        the artifact's 45 s "spot instance creation time"): adds move later, a node removed before it is
        ready never joins, and adds that would land after the end are dropped."""
        if startup_s <= 0:
            return self
        # Pair each add with the removal that ends that stay (a node may come and go several times).
        removals: dict[str, list[float]] = {}
        for event in self.events:
            if event.kind == "remove":
                removals.setdefault(event.node, []).append(event.time_s)
        stays = [(0.0, node) for node in self.initial] + [(e.time_s, e.node) for e in self.events if e.kind == "add"]
        moved: list[Event] = [e for e in self.events if e.kind == SLOW]  # speeds are the node's, up or not
        for time_s, node in stays:
            ends = [t for t in removals.get(node, []) if t >= time_s]
            end = ends[0] if ends else math.inf
            start = time_s + startup_s
            if start < end and start <= self.duration_s:
                moved.append(Event(start, "add", node))
                if end < math.inf:
                    moved.append(Event(end, "remove", node))
        moved.sort(key=_order)
        return Trace(f"{self.name} (+{startup_s:g} s start-up)", (), tuple(moved), self.duration_s)

    def with_spares(self, count: int, join_s: float) -> Trace:
        """The nodes that train when `count` of the nodes up are kept as warm spares (started, not training).

        A training node lost is replaced by a spare that trains `join_s` later (instead of waiting for a
        fresh node and its start-up); a fresh node fills a vacancy left with no spare to take it first,
        then the spare pool, and trains only when the pool is full. At the start the last `count` nodes
        are the spares. Speed events pass through unchanged. Apply after `ready_after`."""
        if count <= 0:
            return self
        spares: list[str] = []
        joining: dict[str, float] = {}  # spare folded in -> when it trains
        vacancies = 0  # training nodes lost with no spare to replace them
        out: list[Event] = []

        def replace(time_s: float) -> None:
            nonlocal vacancies
            if spares:
                joining[spares.pop(0)] = time_s + join_s
            else:
                vacancies += 1

        def flush(until: float) -> None:
            for node, due in sorted(joining.items(), key=lambda item: (item[1], item[0])):
                if due <= until:
                    del joining[node]
                    if due <= self.duration_s:
                        out.append(Event(due, "add", node))

        def arrive(time_s: float, nodes: list[str]) -> list[str]:
            """The nodes of an arriving batch that train (the others become spares)."""
            nonlocal vacancies
            fill = min(vacancies, len(nodes))
            vacancies -= fill
            rest = nodes[fill:]
            pooled = min(count - len(spares), len(rest))
            spares.extend(rest[len(rest) - pooled :])
            return nodes[:fill] + rest[: len(rest) - pooled]

        initial = arrive(0.0, list(self.initial))
        for step in self.steps():
            flush(step.time_s)
            for node in step.removed:
                if node in spares:
                    spares.remove(node)
                elif node in joining:
                    del joining[node]
                    replace(step.time_s)
                else:
                    out.append(Event(step.time_s, "remove", node))
                    replace(step.time_s)
            out += [Event(step.time_s, "add", node) for node in arrive(step.time_s, step.added)]
            out += [Event(step.time_s, SLOW, node, speed) for node, speed in step.speeds.items()]
        flush(self.duration_s)
        out.sort(key=_order)
        return Trace(
            f"{self.name} ({count} warm spare{'s' * (count != 1)})", tuple(initial), tuple(out), self.duration_s
        )

    def renamed(self, names: dict[str, str]) -> Trace:
        """The same trace with nodes renamed by `names`; other nodes whose name a new one takes get a
        "trace:" prefix, so no two nodes share a name."""
        taken = set(names.values())

        def name(node: str) -> str:
            if node in names:
                return names[node]
            return f"trace:{node}" if node in taken else node

        events = tuple(Event(e.time_s, e.kind, name(e.node), e.speed) for e in self.events)
        return Trace(self.name, tuple(name(n) for n in self.initial), events, self.duration_s)

    def max_nodes(self) -> int:
        alive, most = len(self.initial), len(self.initial)
        for event in self.events:
            if event.kind != SLOW:
                alive += 1 if event.kind == "add" else -1
                most = max(most, alive)
        return most

    def node_counts(self) -> list[tuple[float, int]]:
        """(time, nodes up from then on), starting at 0."""
        points = [(0.0, len(self.initial))]
        for time_s, removed, added in self.batches():
            points.append((time_s, points[-1][1] - len(removed) + len(added)))
        return points

    def losses(self) -> int:
        return sum(1 for e in self.events if e.kind == "remove")


def _order(event: Event) -> tuple[float, int, str]:
    """Events at one time: removals, then additions, then speed changes."""
    return (event.time_s, ("remove", "add", SLOW).index(event.kind), event.node)


def build(
    name: str, initial: Iterable[str], events: Iterable[Event], duration_s: float | None = None, where: str = ""
) -> Trace:
    """A trace; without a duration it ends at its last event (the artifact's simulators stop there).
    Errors name `where` (the file) or else `name`."""
    where = where or name
    events = tuple(events)
    initial = tuple(initial)
    if duration_s is None:
        duration_s = events[-1].time_s if events else 0.0
    if events and duration_s < events[-1].time_s:
        raise TraceError(
            f"{where}: duration {duration_s} s must not end before the last event at {events[-1].time_s} s"
        )
    if not duration_s > 0:
        raise TraceError(f"{where}: the trace has no length: give a duration or events after time 0")
    if not initial and not any(e.kind == "add" for e in events):
        raise TraceError(f"{where}: no node is ever added: the trace has no cluster")
    return Trace(name, initial, events, float(duration_s))


def parse(text: str, source: str = "trace", duration_s: float | None = None) -> Trace:
    """Parse the artifact's CSV format; TraceError names `source:LINE: field`."""
    alive: set[str] = set()
    initial: list[str] = []
    events: list[Event] = []
    last = 0.0
    file_duration: float | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{source}:{number}"
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            if key.strip() == "duration_ms":
                try:
                    declared = float(value) / 1e3
                except ValueError:
                    raise TraceError(f"{where}: duration_ms: expected milliseconds, got {value.strip()!r}") from None
                if not 0 < declared < float("inf"):
                    raise TraceError(f"{where}: duration_ms: must be > 0, got {value.strip()!r}")
                file_duration = declared
            continue
        if not line:
            continue
        parts = [part.strip() for part in line.split(",")]
        expected = 4 if len(parts) > 1 and parts[1] == SLOW else 3
        if len(parts) != expected:
            form = "TIME_MS,slow,NODE,SPEED" if expected == 4 else "TIME_MS,add|remove,NODE"
            raise TraceError(f"{where}: expected {expected} fields {form}, got {len(parts)}: {raw!r}")
        time_text, kind, node = parts[:3]
        try:
            time_ms = float(time_text)
        except ValueError:
            raise TraceError(f"{where}: time: expected milliseconds, got {time_text!r}") from None
        if not time_ms >= 0 or time_ms == float("inf"):
            raise TraceError(f"{where}: time: must be a finite number >= 0, got {time_text!r}")
        if time_ms / 1e3 < last:
            raise TraceError(f"{where}: time: {time_text} ms is before the previous event ({last * 1e3:g} ms)")
        if kind not in ("add", "remove", SLOW):
            raise TraceError(f"{where}: event: expected 'add', 'remove' or 'slow', got {kind!r}")
        if not node:
            raise TraceError(f"{where}: node: empty")
        if kind == SLOW:
            speed = _speed(parts[3], where)
            if node not in alive:
                raise TraceError(f"{where}: node: {node!r} is slowed while not up")
            last = time_ms / 1e3
            events.append(Event(time_ms / 1e3, SLOW, node, speed))
            continue
        if kind == "add" and node in alive:
            raise TraceError(f"{where}: node: {node!r} is added while already up")
        if kind == "remove" and node not in alive:
            raise TraceError(f"{where}: node: {node!r} is removed while not up")
        last = time_ms / 1e3
        if kind == "add":
            alive.add(node)
        else:
            alive.discard(node)
        if time_ms == 0 and kind == "add":
            initial.append(node)
        else:
            events.append(Event(time_ms / 1e3, kind, node))
    return build(
        Path(source).stem, initial, events, duration_s if duration_s is not None else file_duration, where=source
    )


def _speed(text: str, where: str) -> float:
    try:
        speed = float(text)
    except ValueError:
        raise TraceError(f"{where}: speed: expected a share of full speed in (0, 1], got {text!r}") from None
    if not 0 < speed <= 1:
        raise TraceError(f"{where}: speed: must be in (0, 1] (0.5: half speed, 1: full speed again), got {text!r}")
    return speed


def load(path: str | Path, duration_s: float | None = None) -> Trace:
    """Read a trace file; a bare name (e.g. `artifact-30n-10m`) is looked up among the bundled traces."""
    path = Path(path)
    if not path.exists() and (TRACES_DIR / f"{path}.csv").exists():
        path = TRACES_DIR / f"{path}.csv"
    try:
        text = path.read_text()
    except OSError as error:
        raise TraceError(f"{path}: cannot read: {error.strerror or error}") from error
    return parse(text, str(path), duration_s)


def dump(trace: Trace) -> str:
    """The artifact's CSV text of a trace (what `parse` reads back)."""
    lines = [f"# duration_ms: {round(trace.duration_s * 1e3)}"]
    lines += [f"0,add,{node}" for node in trace.initial]
    lines += [
        f"{round(e.time_s * 1e3)},{e.kind},{e.node}" + (f",{e.speed!r}" if e.kind == SLOW else "") for e in trace.events
    ]
    return "\n".join(lines) + "\n"


def _names(count: int) -> list[str]:
    return [f"node{i}" for i in range(count)]


def _check(**values: float) -> None:
    for field, value in values.items():
        if not value > 0:
            raise TraceError(f"{field}: must be > 0, got {value}")


def fixed_interval(
    nodes: int, interval_s: float, losses: int, order: Iterable[int] | None = None, name: str | None = None
) -> Trace:
    """The artifact's failure-frequency scenario: `nodes` nodes at time 0 (named node1..nodeN), one removed
    every `interval_s`, `losses` times, no additions; the trace ends at the last removal. `order`: which
    node (1-based) each removal takes (default: a stride over the cluster, each node at most once)."""
    _check(nodes=nodes, interval_s=interval_s, losses=losses)
    if losses >= nodes:
        raise TraceError(f"losses: {losses} must be fewer than the {nodes} starting nodes")
    chosen = list(order) if order is not None else [1 + (k * 7) % nodes for k in range(1, losses + 1)]
    if len(chosen) != losses or len(set(chosen)) != losses or not all(1 <= n <= nodes for n in chosen):
        raise TraceError(f"order: expected {losses} distinct node numbers in 1..{nodes}, got {chosen}")
    events = [Event(k * interval_s, "remove", f"node{n}") for k, n in enumerate(chosen, start=1)]
    initial = [f"node{i}" for i in range(1, nodes + 1)]
    return build(name or f"fixed-{nodes}n-every-{interval_s:g}s", initial, events)


@dataclass(frozen=True)
class SpotPattern:
    """A spot-instance availability pattern: a cluster that starts at some size (or empty) and grows to its
    capacity, loses nodes in preemption bursts and gets replacements back, under a ceiling that moves each
    hour (the stretches where the provider has less to give)."""

    capacity: int
    first_join_s: float  # when the first nodes arrive (0: the trace starts with them)
    first_nodes: int  # how many arrive then; the rest join over `ramp_s`
    ramp_s: float
    burst_interval_s: float  # mean time between preemption bursts (exponential gaps)
    burst_sizes: tuple[tuple[int, int], ...]  # (nodes per burst, weight)
    rejoin_s: float  # mean delay before a replacement joins (exponential)
    ceiling: tuple[int, int]  # each hour the nodes up are capped at a uniform draw from this range
    duration_s: float


SPOT_PATTERNS = {
    # Both from the statistics of the Oobleck artifact's scaled traces (tools/simulator/traces/scaled/, branch
    # sosp23-artifact; originally Bamboo's measurements), scaled to 30 nodes.
    # scale_gcp-trace.csv: empty until 480 s, 15 nodes then, 30 within 10 min; 63 removal bursts in 10.8 h
    # (one per 10.3 min; 56 of one node, 6 of two, 1 of four); 60 join batches; 22.2 nodes up on average.
    "gcp": SpotPattern(30, 480.0, 15, 600.0, 615.0, ((1, 56), (2, 6), (4, 1)), 600.0, (18, 26), 38760.0),
    # scale_p3-trace.csv (EC2 P3): 20 nodes at 0, 30 within 25 min; 85 bursts in 11.4 h (one per 8 min; 50 of
    # one node, 21 of two, 9 of three, 2 of four, 3 of five); 93 join batches; 24.1 nodes up on average.
    "ec2-p3": SpotPattern(
        30, 0.0, 20, 1500.0, 480.0, ((1, 50), (2, 21), (3, 9), (4, 2), (5, 3)), 420.0, (19, 30), 40920.0
    ),
}


def spot_pattern(pattern: str | SpotPattern, seed: int) -> Trace:
    """A seeded availability trace in the shape of a named SPOT_PATTERNS entry (or a SpotPattern)."""
    if isinstance(pattern, str):
        if pattern not in SPOT_PATTERNS:
            raise TraceError(f"pattern: unknown {pattern!r}; choose from {', '.join(SPOT_PATTERNS)}")
        name, shape = f"{pattern}-like-seed{seed}", SPOT_PATTERNS[pattern]
    else:
        name, shape = f"spot-pattern-seed{seed}", pattern
    rng = random.Random(seed)
    up: list[str] = []
    counter = 0
    initial: list[str] = []
    events: list[Event] = []
    pending: list[float] = []  # times replacements (or the ramp's nodes) are due

    def join(t: float) -> None:
        nonlocal counter
        counter += 1
        node = f"node{counter}"
        up.append(node)
        if t == 0:
            initial.append(node)
        else:
            events.append(Event(t, "add", node))

    for _ in range(shape.first_nodes):
        join(shape.first_join_s)
    pending += sorted(
        shape.first_join_s + rng.uniform(0, shape.ramp_s) for _ in range(shape.capacity - shape.first_nodes)
    )
    sizes, weights = zip(*shape.burst_sizes)
    t = shape.first_join_s + rng.expovariate(1 / shape.burst_interval_s)
    ceiling: dict[int, int] = {}  # hour -> the most nodes the provider gives then (drawn when first needed)
    while True:
        due = min(pending, default=math.inf)
        if min(t, due) >= shape.duration_s:
            break
        if due <= t:
            pending.remove(due)
            hour = int(due // 3600)
            if hour not in ceiling:
                ceiling[hour] = rng.randint(*shape.ceiling)
            cap = ceiling[hour] if due > shape.first_join_s + shape.ramp_s else shape.capacity
            if len(up) < cap:
                join(due)
            else:  # the provider has none to give now: try again later
                pending.append(due + rng.expovariate(1 / shape.rejoin_s))
            continue
        size = min(rng.choices(sizes, weights)[0], len(up))
        for node in sorted(rng.sample(up, size)):
            up.remove(node)
            events.append(Event(t, "remove", node))
            pending.append(t + rng.expovariate(1 / shape.rejoin_s))
        t += rng.expovariate(1 / shape.burst_interval_s)
    events.sort(key=lambda e: (e.time_s, e.kind != "remove", e.node))
    return build(name, initial, events, shape.duration_s)


def mtbf(nodes: int, mtbf_s: float, repair_s: float, duration_s: float, seed: int) -> Trace:
    """Independent node failures: each node fails after an exponential time of mean `mtbf_s` while up and
    comes back (the same node) `repair_s` later. Seeded: the same arguments give the same trace."""
    _check(nodes=nodes, mtbf_s=mtbf_s, repair_s=repair_s, duration_s=duration_s)
    rng = random.Random(seed)
    events: list[Event] = []
    for name in _names(nodes):
        t = rng.expovariate(1 / mtbf_s)
        while t < duration_s:
            events.append(Event(t, "remove", name))
            if t + repair_s < duration_s:
                events.append(Event(t + repair_s, "add", name))
            t += repair_s + rng.expovariate(1 / mtbf_s)
    events.sort(key=lambda e: (e.time_s, e.kind != "remove", e.node))
    return build(f"mtbf-{nodes}n-{mtbf_s:g}s-seed{seed}", _names(nodes), events, duration_s)


def spot(
    nodes: int, wave_interval_s: float, wave_fraction: float, return_s: float, duration_s: float, seed: int
) -> Trace:
    """Spot-style preemption waves: waves arrive with exponential gaps of mean `wave_interval_s`; each takes
    a random share (up to `wave_fraction`, at least one node) of the nodes up; they return `return_s` later."""
    _check(nodes=nodes, wave_interval_s=wave_interval_s, return_s=return_s, duration_s=duration_s)
    if not 0 < wave_fraction <= 1:
        raise TraceError(f"wave_fraction: must be in (0, 1], got {wave_fraction}")
    rng = random.Random(seed)
    up = set(_names(nodes))
    returns: list[tuple[float, str]] = []
    events: list[Event] = []
    t = rng.expovariate(1 / wave_interval_s)
    while t < duration_s:
        for back, name in sorted(r for r in returns if r[0] <= t):
            events.append(Event(back, "add", name))
            up.add(name)
        returns = [r for r in returns if r[0] > t]
        size = max(1, round(rng.uniform(0, wave_fraction) * len(up))) if up else 0
        for name in rng.sample(sorted(up), size):
            events.append(Event(t, "remove", name))
            up.discard(name)
            returns.append((t + return_s, name))
        t += rng.expovariate(1 / wave_interval_s)
    events += [Event(back, "add", name) for back, name in sorted(returns) if back < duration_s]
    events.sort(key=lambda e: (e.time_s, e.kind != "remove", e.node))
    return build(f"spot-{nodes}n-seed{seed}", _names(nodes), events, duration_s)

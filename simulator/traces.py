"""Availability traces: which nodes are up when. Read from files, or generated from a seed.

File format (the Oobleck artifact's, inherited from Bamboo's simulator): one event per line,
`TIME_MS,add|remove,NODE`, in time order; nodes added at time 0 are the starting cluster. Blank lines
and lines starting with `#` are comments, except `# duration_ms: N`, which sets how long the trace runs.
Without it (and without a duration given by the caller) a trace runs until its last event plus the
median gap between event times. Bad input raises TraceError naming the file, line and field.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TRACES_DIR = Path(__file__).parent / "traces"


class TraceError(ValueError):
    """A trace file or generator argument that cannot be used; the message names where and which field."""


@dataclass(frozen=True)
class Event:
    time_s: float
    kind: str  # "add" or "remove"
    node: str


@dataclass(frozen=True)
class Trace:
    """Events in time order; `initial` are the nodes up at time 0 (their add events are not in `events`)."""

    name: str
    initial: tuple[str, ...]
    events: tuple[Event, ...]
    duration_s: float

    def batches(self) -> list[tuple[float, list[str], list[str]]]:
        """Events grouped by time: (time, removed nodes, added nodes), in time order."""
        out: list[tuple[float, list[str], list[str]]] = []
        for event in self.events:
            if not out or out[-1][0] != event.time_s:
                out.append((event.time_s, [], []))
            (out[-1][1] if event.kind == "remove" else out[-1][2]).append(event.node)
        return out

    def max_nodes(self) -> int:
        alive, most = len(self.initial), len(self.initial)
        for event in self.events:
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


def _default_duration(times: list[float]) -> float:
    distinct = sorted(set(times))
    if not distinct:
        return 3600.0
    gaps = [b - a for a, b in zip([0.0, *distinct], distinct) if b > a]
    return distinct[-1] + (statistics.median(gaps) if gaps else 3600.0)


def build(name: str, initial: Iterable[str], events: Iterable[Event], duration_s: float | None = None) -> Trace:
    events = tuple(events)
    if duration_s is None:
        duration_s = _default_duration([e.time_s for e in events])
    if events and duration_s <= events[-1].time_s:
        raise TraceError(f"{name}: duration {duration_s} s must be after the last event at {events[-1].time_s} s")
    return Trace(name, tuple(initial), events, float(duration_s))


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
        if len(parts) != 3:
            raise TraceError(f"{where}: expected 3 fields TIME_MS,add|remove,NODE, got {len(parts)}: {raw!r}")
        time_text, kind, node = parts
        try:
            time_ms = float(time_text)
        except ValueError:
            raise TraceError(f"{where}: time: expected milliseconds, got {time_text!r}") from None
        if not time_ms >= 0 or time_ms == float("inf"):
            raise TraceError(f"{where}: time: must be a finite number >= 0, got {time_text!r}")
        if time_ms / 1e3 < last:
            raise TraceError(f"{where}: time: {time_text} ms is before the previous event ({last * 1e3:g} ms)")
        if kind not in ("add", "remove"):
            raise TraceError(f"{where}: event: expected 'add' or 'remove', got {kind!r}")
        if not node:
            raise TraceError(f"{where}: node: empty")
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
    if not initial:
        raise TraceError(f"{source}: no node is added at time 0: the trace needs a starting cluster")
    return build(Path(source).stem, initial, events, duration_s if duration_s is not None else file_duration)


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
    lines += [f"{round(e.time_s * 1e3)},{e.kind},{e.node}" for e in trace.events]
    return "\n".join(lines) + "\n"


def _names(count: int) -> list[str]:
    return [f"node{i}" for i in range(count)]


def _check(**values: float) -> None:
    for field, value in values.items():
        if not value > 0:
            raise TraceError(f"{field}: must be > 0, got {value}")


def fixed_interval(nodes: int, interval_s: float, losses: int, replace_after_s: float | None) -> Trace:
    """The artifact's scenario: `nodes` nodes, one lost every `interval_s`, `losses` times; a fresh
    replacement node joins `replace_after_s` after each loss (None: never). Losses rotate over the
    starting nodes, each a different node, so no node is lost twice."""
    _check(nodes=nodes, interval_s=interval_s, losses=losses)
    if losses > nodes:
        raise TraceError(f"losses: {losses} exceeds the {nodes} starting nodes")
    if replace_after_s is not None and not 0 < replace_after_s < interval_s:
        raise TraceError(f"replace_after_s: must be in (0, interval_s = {interval_s}), got {replace_after_s}")
    events = []
    for k in range(1, losses + 1):
        # Spread the losses over the cluster (stride coprime-ish to the pipeline sizes the planner picks).
        events.append(Event(k * interval_s, "remove", f"node{(k * 7) % nodes}"))
        if replace_after_s is not None:
            events.append(Event(k * interval_s + replace_after_s, "add", f"node{nodes + k - 1}"))
    return build(f"fixed-{nodes}n-every-{interval_s:g}s", _names(nodes), events, (losses + 1) * interval_s)


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

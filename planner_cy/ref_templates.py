"""Pure-Python reference of the exact template search (the compiled core is _templates.pyx).

The same search, written for reading rather than speed; tests require both to return identical layouts.
It differs from the core in one deliberate way: positions from the pipeline's end are capped at
min(m_ref, L), straight from the memory rule, instead of at the smaller derived cap K the core uses, so
the tests also check that K loses nothing.

Suffix state (i, c, u, p): layers [i, L) remain, the suffix's first stage is on a node with u GPUs left
for the suffix, c whole nodes follow, p = min(number of stages in the suffix, cap). Its value is the
Pareto front of (total, peak) over all valid suffixes: total = stage times + communication, peak = the
slowest stage. A stage (i, j, g) at position p runs at the tensor-parallel degree of least time that fits
there (best_time). See templates.py for the cost model, the units and the tie-break.
"""

from __future__ import annotations

from oobleck.planner.templates import CostTables, Layout, stage_memory

Front = list[tuple[int, int]]  # (total, peak), peak ascending, total strictly descending


def pareto(candidates: list[tuple[int, int]]) -> Front:
    """The (total, peak) pairs no other pair matches or beats in both, sorted by peak."""
    front: Front = []
    for total, peak in sorted(candidates, key=lambda e: (e[1], e[0])):
        if not front or total < front[-1][0]:
            front.append((total, peak))
    return front


def _powers(u: int, most: int) -> list[int]:
    """Powers of two <= min(u, most), largest first (the tie-break's GPU order)."""
    top = min(u, most)
    return [1 << k for k in range(top.bit_length() - 1, -1, -1)]


class _Search:
    def __init__(self, tables: CostTables, max_nodes: int) -> None:
        self.t = tables
        self.L = tables.num_layers
        self.G = tables.gpus
        self.C = min(max_nodes, self.L)
        self.cap = min(tables.m_ref, self.L)
        self.fronts: dict[tuple[int, int, int, int], Front] = {}

    def time(self, i: int, j: int, g: int, t: int) -> int:
        row = t.bit_length() - 1
        return int(self.t.time_pf[row, j] - self.t.time_pf[row, i]) * (self.G // g) * t

    def fits(self, i: int, j: int, g: int, t: int, p: int) -> bool:
        room, act = stage_memory(self.t, i, j, g, t)
        # state / t + min(p, m) * (split / t + replicated) * t / g <= memory, times g to stay in integers
        return min(p, self.t.m_ref) * act <= room

    def best_time(self, i: int, j: int, g: int, p: int) -> int | None:
        """The least time of [i, j) on g GPUs over the degrees that fit at position p; None: none fits."""
        times = [self.time(i, j, g, t) for t in self.t.degrees(g) if self.fits(i, j, g, t, p)]
        return min(times) if times else None

    def step(self, c: int, u: int, g: int, j: int) -> tuple[int, int, int] | None:
        """(c', u', comm) after a stage of g GPUs ending at layer j, or None if no node is left for the rest."""
        if u > g:
            return c, u - g, int(self.t.comm_intra[j - 1])
        if c > 0:
            return c - 1, self.G, int(self.t.comm_inter[j - 1])
        return None

    def next_positions(self, p: int) -> list[int]:
        """Capped stage counts q of the rest when the suffix has capped count p (and more than one stage)."""
        if p < self.cap:
            return [p - 1] if p > 1 else []
        return [q for q in (self.cap - 1, self.cap) if q >= 1]

    def front(self, i: int, c: int, u: int, p: int) -> Front:
        return self.fronts.get((i, c, u, p), [])

    def build(self) -> None:
        L = self.L
        for i in range(L - 1, -1, -1):
            for c in range(self.C):
                for u in range(1, self.G + 1):
                    most = min(c * self.G + u, L - i)  # stages: >= one per node, <= one per GPU and per layer
                    for p in range(1, self.cap + 1):
                        if (p < self.cap and not c + 1 <= p <= most) or (p == self.cap and most < p):
                            continue  # no suffix has this many stages: skip the empty state
                        candidates = []
                        for g in _powers(u, self.t.max_gpus):
                            for j in range(i + 1, L + 1):
                                st = self.best_time(i, j, g, p)
                                if st is None:
                                    continue
                                if j == L:
                                    if p == 1 and c == 0 and u == g:
                                        candidates.append((st, st))
                                    continue
                                after = self.step(c, u, g, j)
                                if after is None:
                                    continue
                                c2, u2, cm = after
                                for q in self.next_positions(p):
                                    for total, peak in self.front(j, c2, u2, q):
                                        candidates.append((st + cm + total, max(st, peak)))
                        if candidates:
                            self.fronts[i, c, u, p] = pareto(candidates)

    def min_total(self, state: tuple[int, int, int, int], bound: int) -> int | None:
        totals = [total for total, peak in self.fronts.get(state, []) if peak <= bound]
        return min(totals) if totals else None

    def next_stage(self, current: set[tuple[int, int, int, int]], remaining: int, peak: int):
        """The first stage, in tie-break order, that some live state can take while keeping the optimum.

        Returns (end, gpus, degree, time spent, the live states after it), the latter None when it ends the pipeline.
        """
        i, c, u, _ = next(iter(current))  # live states differ only in their capped position
        for j in range(i + 1, self.L + 1):
            for g in _powers(u, self.t.max_gpus):
                for t in self.t.degrees(g):
                    st = self.time(i, j, g, t)
                    positions = {state[3] for state in current if self.fits(i, j, g, t, state[3])}
                    if st > peak or not positions:
                        continue
                    if j == self.L:
                        if 1 in positions and c == 0 and u == g and st == remaining:
                            return j, g, t, st, None
                        continue
                    after = self.step(c, u, g, j)
                    if after is None:
                        continue
                    c2, u2, cm = after
                    upcoming = {
                        (j, c2, u2, q)
                        for p in positions
                        for q in self.next_positions(p)
                        if self.min_total((j, c2, u2, q), peak) == remaining - st - cm
                    }
                    if upcoming:
                        return j, g, t, st + cm, upcoming
        raise AssertionError(f"reference walk lost the optimum at layer {i}")

    def layout(self, n: int) -> Layout | None:
        """The tie-broken best layout of n nodes: least objective, least peak, then first in stage order."""
        if n > self.C:
            return None
        m1 = self.t.m_ref - 1
        roots = [(0, n - 1, self.G, p) for p in range(1, self.cap + 1)]
        entries = [(total + m1 * peak, peak) for root in roots for total, peak in self.fronts.get(root, [])]
        if not entries:
            return None
        objective, peak = min(entries)
        remaining = objective - m1 * peak
        current = {root for root in roots if self.min_total(root, peak) == remaining}
        ends: list[int] = []
        gpus: list[int] = []
        degrees: list[int] = []
        while current is not None:
            end, g, t, spent, current = self.next_stage(current, remaining, peak)
            ends.append(end)
            gpus.append(g)
            degrees.append(t)
            remaining -= spent
        return Layout(n, objective, peak, tuple(ends), tuple(gpus), tuple(degrees))


def search_layouts_ref(tables: CostTables, max_nodes: int) -> dict[int, Layout]:
    """Best layout of every node count 1..max_nodes that fits in memory; same contract as search_layouts."""
    search = _Search(tables, max_nodes)
    search.build()
    layouts = {n: search.layout(n) for n in range(1, max_nodes + 1)}
    return {n: layout for n, layout in layouts.items() if layout is not None}

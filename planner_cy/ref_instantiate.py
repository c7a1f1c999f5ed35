"""Plain-Python reference of the compiled instantiation core (_instantiate.pyx).

Same functions, same arguments, same results, written to be obviously right rather than fast:
`solve` sorts every candidate iteration time and binary-searches that list, `split` hands out
microbatches one at a time from a heap. Tests compare the compiled core with this module, and
bench/planner_plans.py reports the speed-up.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np


def t_of(base: float, slope: float, m: int) -> float:
    """T(m) = base + (m - 1) * slope, evaluated exactly as the compiled core does."""
    return base + float(m - 1) * slope


def cap_of(base: float, slope: float, limit: int, z: float) -> int:
    """How many m in [1, limit] have T(m) <= z."""
    if z < base:
        return 0
    if slope <= 0:
        return limit
    q = math.floor((z - base) / slope)
    m = limit if q >= limit else int(q) + 1
    while m < limit and t_of(base, slope, m + 1) <= z:
        m += 1
    while m > 0 and t_of(base, slope, m) > z:
        m -= 1
    return m


def max_pipelines(sizes: Sequence[int], n_nodes: int) -> int:
    """The most pipelines (of the given node counts) that use exactly n_nodes nodes; -1 if none do."""
    most = [-1] * (n_nodes + 1)
    most[0] = 0
    for j in range(1, n_nodes + 1):
        for n in sizes:
            if n <= j and most[j - n] >= 0:
                most[j] = max(most[j], most[j - n] + 1)
    return most[n_nodes]


def pipeline_counts(sizes: Sequence[int], n_nodes: int, limit: int) -> np.ndarray:
    """Flags, for k in 0..limit, whether k pipelines can use exactly n_nodes nodes."""
    reach = [set() for _ in range(n_nodes + 1)]
    reach[0].add(0)
    for j in range(1, n_nodes + 1):
        for n in sizes:
            if n <= j:
                reach[j].update(k + 1 for k in reach[j - n] if k < limit)
    return np.array([k in reach[n_nodes] for k in range(limit + 1)], dtype=bool)


def _table(sizes, caps, n_nodes, width, saturate):
    """best[j][k]: the most total capacity of k pipelines on exactly j nodes (-1: impossible)."""
    top = width - 1
    best = [[-1] * width for _ in range(n_nodes + 1)]
    best[0][0] = 0
    for j in range(1, n_nodes + 1):
        for n, c in zip(sizes, caps):
            if c <= 0 or n > j:
                continue
            for k in range(width):
                if best[j - n][k] < 0:
                    continue
                k2 = k + 1
                if k2 > top:
                    if not saturate:
                        continue
                    k2 = top
                best[j][k2] = max(best[j][k2], best[j - n][k] + c)
    return best


def _best_k(best, n_nodes, kmin, width):
    value, chosen = -1, -1
    for k in range(kmin, width):
        if best[n_nodes][k] > value:
            value, chosen = best[n_nodes][k], k
    return value, chosen


def solve(sizes, base, slope, most_each, n_nodes: int, min_pipelines: int, microbatches: int, upper=math.inf):
    """See _instantiate.solve: (Z, counts per template) or None. `upper` only speeds the compiled search up:
    a plain bisection over every candidate ignores it."""
    sizes = [int(n) for n in sizes]
    base = [float(b) for b in base]
    slope = [float(s) for s in slope]
    limit = [min(int(m), microbatches) for m in most_each]
    most = max_pipelines(sizes, n_nodes)
    if most < 0:
        return None
    saturate = most <= microbatches
    width = (min_pipelines if saturate else microbatches) + 1

    def table_at(z):
        caps = [cap_of(b, s, lim, z) for b, s, lim in zip(base, slope, limit)]
        return caps, _table(sizes, caps, n_nodes, width, saturate)

    def feasible(z):
        return _best_k(table_at(z)[1], n_nodes, min_pipelines, width)[0] >= microbatches

    candidates = sorted({t_of(b, s, m) for b, s, lim in zip(base, slope, limit) for m in range(1, lim + 1)})
    if not candidates or not feasible(candidates[-1]):
        return None
    lo, hi = -1, len(candidates) - 1  # candidates[hi] is feasible; none at or below index lo is
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid
    z = candidates[hi]
    caps, best = table_at(z)
    _, k = _best_k(best, n_nodes, min_pipelines, width)
    counts = np.zeros(len(sizes), dtype=np.int64)
    j = n_nodes
    while j > 0:
        for t, (n, c) in enumerate(zip(sizes, caps)):
            if c <= 0 or n > j:
                continue
            previous = [k - 1] + ([k] if saturate and k == width - 1 else [])
            match = [p for p in previous if p >= 0 and best[j - n][p] >= 0 and best[j - n][p] + c == best[j][k]]
            if match:
                counts[t] += 1
                j, k = j - n, match[0]
                break
        else:
            raise AssertionError("instantiation table walk did not reach zero nodes")
    return z, counts


def split(base, slope, most_each, microbatches: int):
    """See _instantiate.split: microbatches per pipeline, handed out one unit at a time, or None."""
    limit = [min(int(m), microbatches) for m in most_each]
    if not 1 <= len(base) <= microbatches or min(limit) < 1 or sum(limit) < microbatches:
        return None
    nb = [1] * len(base)
    heap = [(t_of(b, s, 2), i) for i, (b, s) in enumerate(zip(base, slope)) if limit[i] > 1]
    heapq.heapify(heap)
    for _ in range(microbatches - len(base)):
        _, i = heapq.heappop(heap)
        nb[i] += 1
        if nb[i] < limit[i]:
            heapq.heappush(heap, (t_of(base[i], slope[i], nb[i] + 1), i))
    return np.array(nb, dtype=np.int64)


def dominated(sizes, base, slope, most_each) -> np.ndarray:
    """See _instantiate.dominated: flags of the templates two others replace without loss (exact pruning)."""
    sizes = [int(n) for n in sizes]
    at = {n: t for t, n in enumerate(sizes)}
    flags = []
    for t, n in enumerate(sizes):

        def replaces(i: int, k: int) -> bool:
            if base[i] > base[t] or base[k] > base[t] or most_each[i] < 1 or most_each[k] < 1:
                return False
            return all(
                cap_of(base[i], slope[i], most_each[i], z) + cap_of(base[k], slope[k], most_each[k], z) >= m
                for m in range(1, int(most_each[t]) + 1)
                for z in [t_of(base[t], slope[t], m)]
            )

        pairs = [(i, at[n - a]) for i, a in enumerate(sizes) if i != t and 2 * a <= n and at.get(n - a, t) != t]
        flags.append(any(replaces(i, k) for i, k in pairs))
    return np.array(flags, dtype=bool)


def brute_force(sizes, times, n_nodes: int, min_pipelines: int, microbatches: int):
    """The least Z over every mix and every batch split, by enumeration (tests only: tiny inputs).

    sizes[t]: node count of template t; times[t](m): its iteration time with m microbatches, or None where m
    does not fit in memory. Tries every multiset of templates using exactly n_nodes nodes with at least
    min_pipelines (and at most `microbatches`) pipelines, and every split of the batch into counts >= 1.
    Returns (Z, mix as a sorted tuple of template indices) or None when nothing fits.
    """

    def mixes(start: int, left: int):
        if left == 0:
            yield ()
        for t in range(start, len(sizes)):
            if sizes[t] <= left:
                for rest in mixes(t, left - sizes[t]):
                    yield (t, *rest)

    def splits(total: int, parts: int):
        if parts == 1:
            yield (total,)
            return
        for first in range(1, total - parts + 2):
            for rest in splits(total - first, parts - 1):
                yield (first, *rest)

    best = None
    for mix in mixes(0, n_nodes):
        if not min_pipelines <= len(mix) <= microbatches:
            continue
        for nb in splits(microbatches, len(mix)):
            values = [times[t](m) for t, m in zip(mix, nb)]
            if any(v is None for v in values):
                continue
            z = max(values)
            if best is None or z < best[0]:
                best = (z, mix)
    return best

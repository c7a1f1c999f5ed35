"""Reconfiguration candidates: Oobleck's minimal-movement repairs of the pipelines that lost nodes, and a
fresh instantiation laid over the survivors (reconfigure.py prices them and picks one).

A pipeline that lost nodes shrinks to the template of its remaining size; one left without a template size is
topped up from added nodes, merged with another short pipeline, or borrows nodes from the largest pipeline
(which shrinks in turn); added nodes left over form new pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import PlanningError

MOVES = ("shrink", "drop", "merge", "borrow", "extend")


@dataclass(frozen=True)
class Candidate:
    """A next layout: pipelines as (template node count, nodes), with the moves that made it."""

    reason: str
    groups: tuple[tuple[int, tuple[str, ...]], ...]


def check_ids(name: str, ids: Sequence[str]) -> list[str]:
    ids = list(ids)
    if any(not isinstance(n, str) or not n for n in ids):
        raise PlanningError(f"{name}: node ids must be non-empty strings, got {ids}")
    twice = sorted({n for n in ids if ids.count(n) > 1})
    if twice:
        raise PlanningError(f"{name}: listed twice: {twice}")
    return ids


def partition(total: int, sizes: Sequence[int]) -> list[int] | None:
    """Split `total` into the most parts of the given sizes (largest parts first); None if impossible."""
    most = [-1] * (total + 1)
    most[0] = 0
    for j in range(1, total + 1):
        for n in sizes:
            if n <= j and most[j - n] >= 0 and most[j - n] + 1 > most[j]:
                most[j] = most[j - n] + 1
    if most[total] < 0:
        return None
    parts, j = [], total
    while j:
        n = next(n for n in sorted(sizes, reverse=True) if n <= j and most[j - n] == most[j] - 1)
        parts.append(n)
        j -= n
    return sorted(parts, reverse=True)


def repair(
    groups: list[list[str]], shrunk: list[bool], added: list[str], sizes: Sequence[int], merge_first: bool
) -> tuple[list[list[str]], set[str]] | None:
    """Oobleck's minimal-movement repair of the surviving groups (see the module docstring)."""
    work = _Repair([list(g) for g in groups if g], set(sizes))
    if any(not g for g in groups):
        work.moves.add("drop")
    if any(s and len(g) in work.fits for g, s in zip(groups, shrunk) if g):
        work.moves.add("shrink")
    pool = list(added)
    work.top_up(pool)
    if merge_first:
        work.merge_shorts()
    for _ in range(len(work.groups) + 1):
        if not work.short():
            break
        if not work.borrow_or_join():
            return None
    if work.short():
        return None
    if pool and not work.place_added(pool, sizes):
        return None
    return work.groups, work.moves


@dataclass
class _Repair:
    """The groups being repaired, the template sizes they must reach, and the moves made so far."""

    groups: list[list[str]]
    fits: set[int]
    moves: set[str] = field(default_factory=set)

    def short(self) -> list[int]:
        """The groups whose size has no template."""
        return [i for i, g in enumerate(self.groups) if len(g) not in self.fits]

    def top_up(self, pool: list[str]) -> None:
        """Grow short groups to a template size from the added nodes in `pool` (taken from it)."""
        for i in self.short():
            d = next((d for d in range(1, len(pool) + 1) if len(self.groups[i]) + d in self.fits), None)
            if d is not None:
                self.groups[i] += pool[:d]
                del pool[:d]
                self.moves.add("extend")

    def merge_shorts(self) -> None:
        """Merge pairs of short groups whose sizes add up to a template size."""
        work = self.groups
        while True:
            todo = self.short()
            pair = next(
                ((i, j) for i in todo for j in todo if i < j and len(work[i]) + len(work[j]) in self.fits), None
            )
            if pair is None:
                return
            i, j = pair
            work[i] += work.pop(j)
            self.moves.add("merge")

    def borrow_or_join(self) -> bool:
        """Give short groups nodes from the largest group that stays a template size, or merge a short group
        into the smallest group that makes one; False if some short group can do neither."""
        work = self.groups
        for i in self.short():
            donors = [j for j in range(len(work)) if j != i and len(work[j]) in self.fits]
            if donors:
                donor = max(donors, key=lambda j: (len(work[j]), -j))
                room = len(work[donor])
                d = next((d for d in range(1, room) if len(work[i]) + d in self.fits and room - d in self.fits), None)
                if d is not None:
                    work[i] += work[donor][room - d :]
                    del work[donor][room - d :]
                    self.moves.add("borrow")
                    continue
            partner = min(
                (j for j in range(len(work)) if j != i and len(work[i]) + len(work[j]) in self.fits),
                key=lambda j: (len(work[j]), j),
                default=None,
            )
            if partner is None:
                return False
            low, high = sorted((i, partner))
            work[low] += work.pop(high)
            self.moves.add("merge")
            return True  # indices moved: rescan
        return True

    def place_added(self, pool: list[str], sizes: Sequence[int]) -> bool:
        """Added nodes left over form new pipelines, or, too few for one, grow existing pipelines one node at a
        time; False if neither works."""
        work = self.groups
        self.moves.add("extend")
        parts = partition(len(pool), sizes)
        if parts is not None:
            taken = 0
            for n in parts:
                work.append(pool[taken : taken + n])
                taken += n
            return True
        for node in pool:
            target = min(
                (j for j in range(len(work)) if len(work[j]) + 1 in self.fits),
                key=lambda j: (len(work[j]), j),
                default=None,
            )
            if target is None:
                return False
            work[target].append(node)
        return True


def fresh(groups: list[list[str]], intact: list[bool], added: list[str], needed: list[int]) -> list[list[str]]:
    """Lay an instantiation's pipeline sizes over the survivors, keeping whole groups where sizes allow."""
    needed = sorted(needed, reverse=True)
    kept: list[list[str]] = []
    rest: list[list[str]] = []
    # Intact pipelines first (no copy at all), then shrunk groups that happen to fit a needed size.
    for want_intact in (True, False):
        for g, whole in zip(groups, intact):
            if whole == want_intact and g:
                if len(g) in needed:
                    needed.remove(len(g))
                    kept.append(g)
                else:
                    rest.append(g)
    pool = [n for g in sorted(rest, key=len, reverse=True) for n in g] + list(added)
    taken = 0
    for n in needed:
        kept.append(pool[taken : taken + n])
        taken += n
    return kept

"""`oobleck launch`'s fault injection: SIGKILL a fault's workers once all of them have started its step."""

from __future__ import annotations

import logging
import time

from oobleck.api.addresses import worker_id
from oobleck.api.plan import Plan
from oobleck.runtime.backends.local.children import Child
from oobleck.runtime.backends.local.config import Fault

log = logging.getLogger("oobleck.launcher")


class FaultInjector:
    """Kills each fault's targets `delay_s` after all of them have started its step (never blocks).

    `children` is the launcher's worker table (read, never changed here but for the kills)."""

    def __init__(self, faults: tuple[Fault, ...], children: dict[str, Child]) -> None:
        self.remaining: list[Fault] = list(faults)
        self.children = children
        self.kills: list[tuple[float, str]] = []
        """(time, worker) of every kill"""
        self._due: dict[int, tuple[float, list[str]]] = {}

    @property
    def pending(self) -> bool:
        return bool(self.remaining)

    def inject(self, plan: Plan, progress: dict[str, dict]) -> None:
        remaining = []
        now = time.monotonic()
        for fault in self.remaining:
            due = self._due.get(id(fault))
            if due is None:
                targets = self._targets(plan, fault)
                reached = [w for w in targets if progress.get(w, {}).get("step", -1) >= fault.at_step]
                if targets and len(reached) == len(targets):
                    # Resolve targets now: ranks are renumbered by the next generation.
                    self._due[id(fault)] = due = (now + fault.delay_s, targets)
            if due is not None and now >= due[0]:
                killed_at = time.time()
                for worker in due[1]:
                    self.children[worker].killed_at = killed_at
                    self.children[worker].kill()
                    self.kills.append((killed_at, worker))
                log.info("fault: SIGKILL %s at step %d (+%.3f s)", due[1], fault.at_step, fault.delay_s)
            else:
                remaining.append(fault)
        self.remaining = remaining

    def first_kill(self, workers: set[str]) -> float | None:
        """When the first of `workers` was killed by a fault, if one was."""
        return min((t for t, w in self.kills if w in workers), default=None)

    def _targets(self, plan: Plan, fault: Fault) -> list[str]:
        ranks = [plan.ranks[r] for r in fault.ranks if r < plan.world_size]
        targets = [worker_id(a.node, a.gpu) for a in ranks]
        targets += [w for w, c in self.children.items() if c.node in fault.nodes and c.code is None]
        return targets

"""Host memory for snapshots: the captured state bytes of layers by step, own and a buddy's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch


class DeferredRelease:
    """Hands a dropped buffer to `release` (the pinned pool, to be captured into again) only once no shipment
    still reads it: a step can be pruned, or a layer's snapshot replaced (a replay after a rollback), while
    the ship thread is still pushing or writing those very buffers."""

    def __init__(self, release: Callable[[torch.Tensor], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._readers: dict[int, int] = {}  # id(buffer) -> shipments reading it
        self._dropped: dict[int, torch.Tensor] = {}  # read buffers dropped meanwhile, released after the last read

    def reading(self, buffers: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                self._readers[id(buffer)] = self._readers.get(id(buffer), 0) + 1

    def read(self, buffers: Iterable[torch.Tensor]) -> None:
        """The shipment that read these is done."""
        released = []
        with self._lock:
            for buffer in buffers:
                left = self._readers.pop(id(buffer)) - 1
                if left:
                    self._readers[id(buffer)] = left
                elif id(buffer) in self._dropped:
                    released.append(self._dropped.pop(id(buffer)))
        for buffer in released:
            self._release(buffer)

    def drop(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if id(buffer) in self._readers:
                self._dropped[id(buffer)] = buffer
                return
        self._release(buffer)


class SnapshotStore:
    """Snapshots this worker holds in host memory, own and buddy-held: step -> layer -> state bytes."""

    def __init__(self, on_drop: Callable[[torch.Tensor], None] = lambda data: None) -> None:
        self._on_drop = on_drop
        """called with every tensor the store lets go of (a dropped step, a replaced layer): buffers to reuse"""
        self._lock = threading.Lock()
        self._steps: dict[int, dict[int, torch.Tensor]] = {}
        self.complete: set[int] = set()
        """steps this worker knows complete (every rank of a generation captured and pushed them)"""
        self.frozen = False

    def put(self, step: int, layer: int, data: torch.Tensor) -> None:
        with self._lock:
            replaced = self._steps.setdefault(step, {}).get(layer)
            self._steps[step][layer] = data
        if replaced is not None and replaced is not data:
            self._on_drop(replaced)

    def get(self, step: int, layer: int) -> torch.Tensor:
        with self._lock:
            try:
                return self._steps[step][layer]
            except KeyError:
                raise KeyError(
                    f"snapshot of layer {layer} at step {step}: not held here (held: {self._holdings_locked()})"
                ) from None

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def holdings(self) -> dict[str, list[int]]:
        """{step: layers} as reported in `held/{worker}` (JSON keys are strings)."""
        with self._lock:
            return self._holdings_locked()

    def _holdings_locked(self) -> dict[str, list[int]]:
        return {str(step): sorted(layers) for step, layers in sorted(self._steps.items())}

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() for layers in self._steps.values() for t in layers.values())

    def mark_complete(self, step: int) -> None:
        with self._lock:
            self.complete.add(step)

    def freeze(self) -> None:
        """No pruning until `thaw`: the controller may be planning a restore from what we reported."""
        with self._lock:
            self.frozen = True

    def thaw(self) -> None:
        with self._lock:
            self.frozen = False

    def prune(self) -> None:
        """Keep the newest complete step and the newest step being built (see the module docstring)."""
        dropped: list[torch.Tensor] = []
        with self._lock:
            if self.frozen:
                return
            steps = sorted(self._steps)
            complete = [s for s in steps if s in self.complete]
            keep = set(steps[-1:])
            if complete:
                keep.add(complete[-1])
            else:
                keep.update(steps[-2:])  # nothing known complete: the two newest
            for step in steps:
                if step not in keep:
                    dropped.extend(self._steps.pop(step).values())
        for data in dropped:
            self._on_drop(data)

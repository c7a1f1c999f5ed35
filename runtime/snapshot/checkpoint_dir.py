"""The checkpoint directory: one file per (step, layer), written atomically; a step is complete when
every layer's file exists (tier (b) of runtime/snapshot/agent.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _layer_file(root: Path, step: int, layer: int) -> Path:
    return _step_dir(root, step) / f"layer-{layer:05d}.bin"


def write_checkpoint_layer(root: str | Path, step: int, layer: int, data: torch.Tensor) -> Path:
    """Write one layer's state bytes atomically: a file that exists is complete."""
    path = _layer_file(Path(root), step, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(memoryview(data.contiguous().numpy()))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def read_checkpoint_layer(root: str | Path, step: int, layer: int) -> torch.Tensor:
    data = bytearray(_layer_file(Path(root), step, layer).read_bytes())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def checkpoint_holdings(root: str | Path | None) -> dict[int, set[int]]:
    """step -> layers whose file is in the directory (absent directory: nothing)."""
    out: dict[int, set[int]] = {}
    if root is None or not Path(root).is_dir():
        return out
    for step_dir in Path(root).glob("step-*"):
        try:
            step = int(step_dir.name[5:])
            layers = {int(p.name[6:-4]) for p in step_dir.glob("layer-*.bin")}
        except (ValueError, OSError):
            continue  # a foreign name, or a directory being deleted by a writer's pruning
        out[step] = layers
    return out


def complete_steps(held: dict[int, set[int]], num_layers: int) -> list[int]:
    """The steps of `held` (checkpoint_holdings) that every layer's file completes, oldest first."""
    return sorted(s for s, layers in held.items() if len(layers) >= num_layers)


def newest_complete_step(root: str | Path | None, num_layers: int) -> int | None:
    """The newest step complete in the directory (a rollback beyond f failures restores from it), or None."""
    complete = complete_steps(checkpoint_holdings(root), num_layers)
    return complete[-1] if complete else None


def prune_checkpoints(root: str | Path, num_layers: int, keep: int) -> None:
    """Delete steps older than the `keep`-th newest complete one (several writers may race: harmless)."""
    held = checkpoint_holdings(root)
    complete = complete_steps(held, num_layers)
    if len(complete) < keep:
        return
    oldest_kept = complete[-keep]
    for step in [s for s in held if s < oldest_kept]:
        directory = _step_dir(Path(root), step)
        for path in directory.glob("*"):
            path.unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass

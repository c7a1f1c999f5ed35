"""What a job's losses must be: the single-process, no-failure run of the same training settings
(runtime/train/reference.py), kept on disk across test runs.

Keyed by everything the losses depend on: the worker config, the global batch, torch's and Python's versions
and the sources the reference run imports (REFERENCE_SOURCES; tests/e2e/test_reference_sources.py checks in a
fresh interpreter that it imports nothing else of the project), so an edit to the elastic loop, the snapshots
or the backends keeps the cache. The state after the last kept step is kept too: a check that reads further
than the cache holds trains on from there (`train_reference(resume=...)`, checked bitwise against one run).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from oobleck_dev.tools import cache_root, repo_root

REFERENCE_SOURCES = (
    "runtime/train",
    "runtime/models",
    "runtime/errors.py",
    "runtime/__init__.py",
    "runtime/backends/__init__.py",
    "runtime/backends/pod/__init__.py",
    "runtime/backends/pod/config.py",
    "src/oobleck",
)
"""What the reference run imports of the project: an edit elsewhere cannot change its losses."""


def default_folder() -> Path:
    return cache_root() / "e2e-references"


def sources_stamp(repo: Path) -> str:
    import torch

    digest = hashlib.sha256(f"{torch.__version__} {sys.version}".encode())
    for source in REFERENCE_SOURCES:
        root = repo / source
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            digest.update(path.relative_to(repo).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class ReferenceCache:
    """Reference losses in `folder` (a `<key>.json` of losses and a `<key>.pt` of the state after them), and in
    memory for this process."""

    def __init__(self, folder: Path | None = None, repo: Path | None = None) -> None:
        self.folder = folder or default_folder()
        found = repo or repo_root()
        if found is None:
            raise RuntimeError("the reference cache is keyed by the project's sources: run from a source checkout")
        self.repo = found
        self._stamp: str | None = None
        self._memo: dict[tuple[str, int, int], tuple[float, ...]] = {}

    def for_spec(self, spec: dict[str, Any], job: str, through: int | None = None) -> tuple[float, ...]:
        """Per-step losses of the job `spec` trained in one process without failures: all its steps, or the first
        `through` (a step's loss depends on the steps before it only, so a prefix is the same run's; the job's
        steps still set its learning-rate schedule). Cached by what the losses depend on, not by the job's
        shape: jobs that share a training section share one reference run."""
        from oobleck.api.spec import parse_spec
        from oobleck.runtime.backends.pod.config import config_from_spec

        parsed = parse_spec(spec)
        config = config_from_spec(parsed, job, compute_device="cpu")
        steps = parsed.training.steps
        wanted = steps if through is None else min(steps, through)
        return self.losses(config.model_dump_json(), parsed.training.global_microbatches, wanted)

    def losses(self, config_json: str, global_microbatches: int, steps: int) -> tuple[float, ...]:
        """The first `steps` losses of the config's run: from the cache when it holds that many, else trained on
        from the cached run's last state (or step 0) and kept, the losses with the state after the last of them."""
        memo_key = (config_json, global_microbatches, steps)
        if memo_key not in self._memo:
            self._memo[memo_key] = self._read_or_train(config_json, global_microbatches, steps)
        return self._memo[memo_key]

    def _read_or_train(self, config_json: str, global_microbatches: int, steps: int) -> tuple[float, ...]:
        import torch

        from oobleck.runtime.train.config import WorkerConfig
        from oobleck.runtime.train.reference import ReferenceState, train_reference

        if self._stamp is None:
            self._stamp = sources_stamp(self.repo)
        key = hashlib.sha256(f"{self._stamp} {global_microbatches} {config_json}".encode()).hexdigest()
        losses_path, state_path = self.folder / f"{key}.json", self.folder / f"{key}.pt"
        kept: list[float] = []
        resume: ReferenceState | None = None
        try:
            kept = [float(loss) for loss in json.loads(losses_path.read_text())]
            if len(kept) >= steps:
                return tuple(kept[:steps])
            resume = ReferenceState(**torch.load(state_path, weights_only=True))
            if resume.step != len(kept):
                kept, resume = [], None
        except (OSError, ValueError, TypeError, RuntimeError):
            kept, resume = [], None
        config = WorkerConfig.model_validate_json(config_json)
        result = train_reference(config, global_microbatches, steps, resume=resume)
        losses = (*kept, *result.losses)
        self.folder.mkdir(parents=True, exist_ok=True)
        # Whole or absent, and the state first: parallel test processes may write the same key, and losses without
        # their state (a reader finds the step counts differ) only cost a run from step 0.
        for path, write in (
            (state_path, lambda to: torch.save(vars(result.state), to)),
            (losses_path, lambda to: to.write_text(json.dumps(list(losses)))),
        ):
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            write(partial)
            partial.replace(path)
        return losses

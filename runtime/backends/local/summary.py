"""What `oobleck launch` reports: one record per reconfiguration and the job's summary."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from oobleck.api.addresses import worker_id


@dataclass
class Reconfiguration:
    generation: int
    reason: str
    """what triggered it: lost, retry, add, coordinator-restart"""
    lost: list[str]
    added: list[str]
    copies: int
    copy_bytes: int
    kill_at: float | None = None
    detected_at: float | None = None
    published_at: float = 0.0
    first_step_at: float | None = None
    """time the first step of this generation completed (loss record), once known"""
    moves: str = ""
    """what the planner did about it (the plan's reason: shrink, merge, borrow, reinstantiate, ...)"""
    restore_step: int | None = None
    """a rollback: the step every worker reset to and replayed from (runtime/snapshot/agent.py)"""
    restore_sources: dict[str, int] = field(default_factory=dict)
    """a rollback: layer restores by source (own-snapshot, peer-snapshot, checkpoint)"""

    def as_dict(self) -> dict:
        out = self.__dict__.copy()
        if self.kill_at is not None:
            for name in ("detected_at", "published_at", "first_step_at"):
                value = getattr(self, name)
                out[name.replace("_at", "_s")] = None if value is None else round(value - self.kill_at, 4)
        return out


@dataclass
class Summary:
    ok: bool
    steps: int
    target_steps: int
    generations: int
    losses: dict[int, float]
    reconfigurations: list[Reconfiguration] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    failure_reports: list[dict] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    workdir: str = ""

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "steps": self.steps,
            "target_steps": self.target_steps,
            "generations": self.generations,
            "losses": {str(k): v for k, v in sorted(self.losses.items())},
            "reconfigurations": [r.as_dict() for r in self.reconfigurations],
            "exit_codes": self.exit_codes,
            "failure_reports": self.failure_reports,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "workdir": self.workdir,
        }


def format_summary(summary: Summary) -> str:
    lines = [
        f"job {'finished' if summary.ok else 'FAILED'}: {summary.steps}/{summary.target_steps} steps, "
        f"{summary.generations} generation(s), {summary.seconds:.1f} s"
    ]
    if summary.losses:
        first, last = min(summary.losses), max(summary.losses)
        lines.append(f"loss: step {first} {summary.losses[first]:.5f} -> step {last} {summary.losses[last]:.5f}")
    for r in summary.reconfigurations:
        parts = [f"generation {r.generation} ({r.reason}; planner: {r.moves})"]
        if r.lost:
            parts.append(f"lost {r.lost}")
        if r.added:
            parts.append(f"added {r.added}")
        parts.append(f"{r.copies} copies, {r.copy_bytes} bytes")
        if r.restore_step is not None:
            parts.append(f"rolled back to step {r.restore_step} from {r.restore_sources}")
        timing = r.as_dict()
        if r.kill_at is not None:
            parts.append(
                "after the kill: "
                + ", ".join(
                    f"{name[:-2]} {timing[name]:.3f} s"
                    for name in ("detected_s", "published_s", "first_step_s")
                    if timing.get(name) is not None
                )
            )
        lines.append("  " + "; ".join(parts))
    if summary.error:
        lines.append(f"error: {summary.error}")
    lines.append(f"workdir: {summary.workdir}")
    return "\n".join(lines)


def reconfiguration(
    plan, reason: str, lost: list[str], added: list[str], kill_at: float | None, detected_at: float | None
) -> Reconfiguration:
    """The summary's record of publishing `plan` (now)."""
    sources: dict[str, int] = {}
    if plan.restore_step is not None:
        for c in plan.copies:
            kind = (
                "checkpoint"
                if c.source_kind == "checkpoint"
                else "own-snapshot"
                if c.src_rank == c.dst_rank
                else "peer-snapshot"
            )
            sources[kind] = sources.get(kind, 0) + 1
    moved = [c for c in plan.copies if c.src_rank != c.dst_rank]  # a rollback also lists local restores
    return Reconfiguration(
        generation=plan.generation,
        reason=reason,
        moves=plan.reason,
        lost=lost,
        added=added,
        copies=len(moved),
        copy_bytes=sum(c.bytes for c in moved),
        kill_at=kill_at,
        detected_at=detected_at,
        published_at=time.time(),
        restore_step=plan.restore_step,
        restore_sources=sources,
    )


def summarize(
    children: dict,
    plan,
    reconfigurations: list[Reconfiguration],
    failure_reports: list[dict],
    target_steps: int,
    error: str,
    seconds: float,
    workdir: str,
) -> Summary:
    """The job's summary from the workers' loss records (`children`: worker -> launch_children.Child)."""
    records = []
    for child in children.values():
        if child.losses_path.exists():
            records += [json.loads(line) for line in child.losses_path.read_text().splitlines() if line.strip()]
    losses: dict[int, float] = {}
    for record in sorted(records, key=lambda r: r["time"]):
        step = record["step"]
        if step in losses and not _same_loss(losses[step], record["loss"]):
            error = error or f"step {step} logged twice with different losses: {losses[step]} != {record['loss']}"
        losses[step] = record["loss"]
    for reconfig in reconfigurations:
        after = [r["time"] for r in records if r["generation"] == reconfig.generation]
        reconfig.first_step_at = min(after, default=None)
    final = {worker_id(a.node, a.gpu) for a in plan.ranks} if plan else set()
    if not error and sorted(losses) != list(range(target_steps)):
        error = f"steps: logged {sorted(losses)}, expected 0..{target_steps - 1}"
    if not error and any(children[w].code != 0 for w in final if w in children):
        bad = {w: children[w].code for w in final if children[w].code != 0}
        error = f"workers of the final generation failed: {bad}"
    return Summary(
        ok=not error,
        steps=len(losses),
        target_steps=target_steps,
        generations=(plan.generation + 1) if plan else 0,
        losses=losses,
        reconfigurations=reconfigurations,
        exit_codes={w: c.code for w, c in children.items()},
        failure_reports=failure_reports,
        error=error,
        seconds=seconds,
        workdir=workdir,
    )


REPLAYED_LOSS_RTOL = 1e-5
"""How far a step's loss logged twice may differ: a step replayed after a rollback may run in another layout,
whose float32 sums round differently (the engine's documented tolerance, runtime/train/engine.py; seen: one
ulp, 4.1373949 against 4.1373944). A replay from a wrong state differs far more."""


def _same_loss(first: float, again: float) -> bool:
    # NaN never equals itself: a non-finite step's loss is the same on every rank that logged it.
    if _nan(first) or _nan(again):
        return _nan(first) and _nan(again)
    return math.isclose(first, again, rel_tol=REPLAYED_LOSS_RTOL, abs_tol=0.0)


def _nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)

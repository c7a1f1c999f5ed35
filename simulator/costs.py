"""Every cost a policy pays, as explicit inputs with their sources (README "Simulating goodput" has the table).

Where a paper gives no number we can carry over, the default is ours and says so; such defaults lean
towards the baselines (cheaper restarts than a real cluster shows), so a goodput gap is not our
assumption's doing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class OobleckCosts:
    """Our runtime's in-place reconfiguration, calibrated on bench/recovery.py (tiny GPT, 4 processes).

    A reconfiguration pauses training for detection + plan + rendezvous + copy, where copy is the busiest
    node's layer-copy bytes / inter-node bandwidth (the planner's copy plan), and loses the iteration in
    flight. The measured rendezvous part (0.17 s) also moved the tiny GPT's layers: under 1 MB over
    loopback, a few ms, so it is taken as a fixed cost and the copy is priced separately at scale.
    """

    detection_s: float = 0.04
    """failure -> known to every survivor: TCP EOF of a collective (bench/recovery.py: 0.04 s; 1.5 s when only heartbeats see it)"""
    plan_s: float = 0.11
    """failure known -> next generation published (bench/recovery.py: 0.11 s; the planner alone is 8 ms at 1024 nodes)"""
    rendezvous_s: float = 0.17
    """process groups rebuilt + holdings exchanged (bench/recovery.py: 0.17 s, tiny GPT's copies included)"""
    snapshot_interval_steps: int = 10
    """steps between in-memory snapshots (runtime default snapshot.interval_steps); bounds the work a rollback loses"""

    def pause_s(self, copy_s: float) -> float:
        return self.detection_s + self.plan_s + self.rendezvous_s + copy_s


@dataclass(frozen=True)
class CheckpointCosts:
    """Checkpoint + restart (Varuna EuroSys'22 job morphing; torchrun elastic restarts).

    Every node stalls while it writes its layers' state; a failure stops the whole job, which restarts on
    the nodes up (re-planned for their count), reloads the last checkpoint and loses the work since it.
    A node joining also means a restart (Varuna morphs the job by checkpoint + restart), without lost work.
    """

    interval_s: float | None = None
    """seconds of training between checkpoints; None: Young's optimum sqrt(2 * checkpoint time * MTBF)
    (J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 1974), with the MTBF
    read from the trace: the interval most favourable to this policy"""
    storage_bandwidth: float = 2e9
    """bytes/s each node writes and reads checkpoints at (our assumption: local NVMe / a parallel file system)"""
    restart_s: float = 4.75
    """fixed cost of a restart: processes, rendezvous, framework start (bench/recovery.py's torchrun restart of
    the tiny GPT, 4.75 s; real clusters take minutes: a default that favours this policy)"""

    def checkpoint_s(self, state_bytes_per_node: int) -> float:
        return state_bytes_per_node / self.storage_bandwidth

    def restart_cost_s(self, state_bytes_per_node: int) -> float:
        return self.restart_s + state_bytes_per_node / self.storage_bandwidth


@dataclass(frozen=True)
class BambooCosts:
    """Redundant computation (Bamboo NSDI'23): each node also keeps its successor's layers and runs their
    forward pass eagerly; a lost node's successor-side work continues on its predecessor after a short
    failover, and pipelines are then re-formed. Losing two neighbours of one pipeline at once loses the
    redundancy: fallback to a checkpoint restart (CheckpointCosts)."""

    slowdown: float | None = None
    """steady-state iteration time / plain iteration time; None: derived with our planner from a profile where
    every layer carries a neighbour's forward pass and state (2 x forward time, 2 x state bytes), which also
    makes memory push pipelines deeper, as the Oobleck paper reports for Bamboo on larger models"""
    failover_s: float = 1.0
    """lost node -> training again on the re-formed pipelines (our assumption; Bamboo reconfigures without
    restarting processes)"""


@dataclass(frozen=True)
class ReplicaCosts:
    """Replica dropping (torchft): data-parallel replicas (the plan's pipelines) that never reshape. A
    replica that loses a node leaves the quorum and idles until replacement nodes make it whole; it then
    heals by fetching its state from a live replica."""

    quorum_s: float = 1.0
    """pause of the surviving replicas while the quorum changes (our assumption; torchft's per-step quorum is
    sub-second when the lighthouse answers at once)"""

    def heal_s(self, state_bytes_per_node: int, bandwidth: float) -> float:
        return self.quorum_s + state_bytes_per_node / bandwidth


@dataclass(frozen=True)
class Costs:
    oobleck: OobleckCosts = OobleckCosts()
    checkpoint: CheckpointCosts = CheckpointCosts()
    bamboo: BambooCosts = BambooCosts()
    replicas: ReplicaCosts = ReplicaCosts()


def describe(costs: Costs) -> dict[str, dict[str, float | int | None]]:
    """Every cost parameter and its value, for the JSON output."""
    return {
        part.name: {f.name: getattr(getattr(costs, part.name), f.name) for f in fields(getattr(costs, part.name))}
        for part in fields(costs)
    }

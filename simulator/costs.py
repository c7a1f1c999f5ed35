"""Every cost a policy pays, as explicit inputs with their sources (README "Simulating goodput" has the table).

Where a paper gives no number we can carry over, the default is ours and says so; such defaults lean
towards the baselines (cheaper restarts than a real cluster shows), so a goodput gap is not our
assumption's doing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


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
    straggler_window_steps: int = 20
    """steps a node's speed change takes to be known (issue #22's detection target: within 20 steps); the job
    runs at the unmitigated pace meanwhile"""
    horizon_steps: int = 100
    """iterations a straggler mitigation is priced over: copy time + horizon x Z, the cheapest wins (the
    planner's reconfiguration horizon, oobleck.planner.reconfigure.DEFAULT_HORIZON)"""

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
    interval_steps: int | None = None
    """checkpoint every this many iterations instead (the artifact's Varuna: every 10); overrides interval_s"""
    checkpoint_time_s: float | None = None
    """a fixed checkpoint write time instead of state bytes / storage_bandwidth (the artifact's published ones)"""
    restart_includes_reload: bool = False
    """restart_s already includes reading the checkpoint back (the artifact's restart times are end to end)"""

    def checkpoint_s(self, state_bytes_per_node: int) -> float:
        if self.checkpoint_time_s is not None:
            return self.checkpoint_time_s
        return state_bytes_per_node / self.storage_bandwidth

    def restart_cost_s(self, state_bytes_per_node: int) -> float:
        if self.restart_includes_reload:
            return self.restart_s
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
    fallback: CheckpointCosts | None = None
    """checkpoints and restarts of its fallback; None: the checkpoint-restart policy's costs"""


@dataclass(frozen=True)
class ReplicaCosts:
    """Replica dropping (torchft): data-parallel replicas (the plan's pipelines) that never reshape. A
    replica that loses a node leaves the quorum and idles until replacement nodes make it whole; it then
    heals by fetching its state from a live replica."""

    quorum_s: float = 1.0
    """pause of the surviving replicas while the quorum changes (our assumption; torchft's per-step quorum is
    sub-second when the lighthouse answers at once)"""
    timeout_s: float = 60.0
    """a replica whose step ends more than this after the fastest replica's is dropped (the allreduce the
    fastest entered first times out and the step is discarded); one within it is waited for every step.
    torchft's Manager `timeout` (default 60 s; it bounds collectives such as the allreduce)"""

    def heal_s(self, state_bytes_per_node: int, bandwidth: float) -> float:
        return self.quorum_s + state_bytes_per_node / bandwidth


@dataclass(frozen=True)
class NodeCosts:
    """What every policy pays alike for the machines themselves."""

    startup_s: float = 0.0
    """a node added to the trace is usable this much later (the artifact's simulators: 45 s, their "spot
    instance creation time"); it applies to the nodes at time 0 too, and to the ideal goodput is measured by"""
    spares: int = 0
    """warm spares: this many of the nodes up are kept started and connected but not training; a lost node is
    replaced by one after `spare_join_s` instead of waiting for a fresh node (the ideal still counts every node)"""
    spare_join_s: float = 5.0
    """a warm spare lost node -> training in its place (issue #22's target for a spare: 5 s; TrainMover reports
    about 20 s of downtime at 1,024 GPUs)"""


@dataclass(frozen=True)
class Costs:
    oobleck: OobleckCosts = OobleckCosts()
    checkpoint: CheckpointCosts = CheckpointCosts()
    bamboo: BambooCosts = BambooCosts()
    replicas: ReplicaCosts = ReplicaCosts()
    nodes: NodeCosts = NodeCosts()


# The Oobleck artifact's published parameters (SymbioticLab/Oobleck, branch sosp23-artifact, tools/simulator/),
# by the artifact's model name: Varuna's restart (`local_rendezvous_timeout_delta`) and checkpoint
# (`checkpointing_overhead`) from varuna_simulator.py; Bamboo's failover (`local_rendezvous_timeout_delta`) from
# bamboo_simulator.py. BERT-large's restart there falls with the node count, 71.3 s at 30 nodes (the value
# used here) to 97.2 s at 23 and more below.
ARTIFACT_VARUNA_RESTART_S = {
    "bert-large": 71.3,
    "gpt2-artifact": 83.0,
    "gpt3-medium": 78.7,
    "gpt3-2.7b": 515.0,
    "gpt3-6.7b": 701.0,
}
ARTIFACT_VARUNA_CHECKPOINT_S = {
    "bert-large": 15.8,
    "gpt2-artifact": 11.5,
    "gpt3-medium": 11.2,
    "gpt3-2.7b": 50.0,
    "gpt3-6.7b": 120.0,
}
ARTIFACT_BAMBOO_FAILOVER_S = {
    "bert-large": 76.0,
    "gpt2-artifact": 80.0,
    "gpt3-medium": 100.0,
    "gpt3-2.7b": 230.0,
    "gpt3-6.7b": 450.0,
}
ARTIFACT_BAMBOO_RESTART_S = 30.0
ARTIFACT_CHECKPOINT_EVERY = 10  # varuna_simulator.py: checkpoint_per_iter=10
ARTIFACT_BAMBOO_SLOWDOWN = 1 / 0.1971  # bamboo_simulator.py: redundant_ratio = 1 - 0.1971 (its 10-minute trace)
ARTIFACT_NODE_STARTUP_S = 45.0  # all three simulators: spot_instance_creation_time = 45_000 ms
ARTIFACT_ALIASES = {"gpt3-350m": "gpt3-medium"}  # the same model under our GPT-3 name

COST_SETS = ("default", "oobleck-artifact")


def named(name: str, model: str) -> Costs:
    """A named cost set for `model` (a preset name). "default": ours (Costs()); "oobleck-artifact": the
    artifact's Varuna and Bamboo parameters and node start-up delay, our own oobleck costs. ValueError
    names the set or the model when there is no such set or the artifact has no numbers for the model."""
    if name == "default":
        return Costs()
    if name != "oobleck-artifact":
        raise ValueError(f"costs: unknown cost set {name!r}; choose from {', '.join(COST_SETS)}")
    key = ARTIFACT_ALIASES.get(model, model)
    if key not in ARTIFACT_VARUNA_RESTART_S:
        raise ValueError(
            f"costs: the artifact publishes costs for {', '.join(ARTIFACT_VARUNA_RESTART_S)} only, not {model!r}"
        )
    return Costs(
        checkpoint=CheckpointCosts(
            interval_steps=ARTIFACT_CHECKPOINT_EVERY,
            checkpoint_time_s=ARTIFACT_VARUNA_CHECKPOINT_S[key],
            restart_s=ARTIFACT_VARUNA_RESTART_S[key],
            restart_includes_reload=True,
        ),
        bamboo=BambooCosts(
            slowdown=ARTIFACT_BAMBOO_SLOWDOWN,
            failover_s=ARTIFACT_BAMBOO_FAILOVER_S[key],
            # bamboo_simulator.py: a fallback loses the iteration in flight only and restarts in 30 s
            # (`global_rendezvous_timeout_delta`); it writes no checkpoints.
            fallback=CheckpointCosts(
                interval_steps=1,
                checkpoint_time_s=0.0,
                restart_s=ARTIFACT_BAMBOO_RESTART_S,
                restart_includes_reload=True,
            ),
        ),
        nodes=NodeCosts(startup_s=ARTIFACT_NODE_STARTUP_S),
    )


def describe(costs: Costs) -> dict[str, dict[str, Any]]:
    """Every cost parameter and its value, for the JSON output."""
    return {part.name: asdict(getattr(costs, part.name)) for part in fields(costs)}

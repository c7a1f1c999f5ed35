"""Helpers for runtime tests: hand-built plans and a local multi-process run of real workers.

Plans are built by hand (the planner is tested on its own); workers are real `python -m
oobleck.runtime worker` processes (forked from one that imported torch already: oobleck_dev.preforked)
talking gloo through a TCPStore hosted by the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.api.plan import LayerCopy, Pipeline, Plan, Stage, Template, TemplateStage
from oobleck.runtime.train.config import WorkerConfig
from oobleck_dev import preforked
from tests.runtime.sizes import PIPELINED_MEMORY


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lasts until something reaps it)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@dataclass
class PipelineSpec:
    """A pipeline by hand: stages as (start, end, node index within the pipeline, gpus), optionally with a
    fifth item, the stage's tensor-parallel degree t (default 1)."""

    stages: list[tuple[int, ...]]
    microbatches: int


def make_plan(
    specs: list[PipelineSpec],
    num_layers: int,
    gpus_per_node: int = 1,
    generation: int = 0,
    job: str = "test",
    f: int = 1,
    copies: list[dict] | None = None,
    node_names: list[list[str]] | None = None,
) -> Plan:
    """A valid Plan: ranks numbered pipeline by pipeline, stage by stage, GPU by GPU."""
    pipelines, templates = [], {}
    offset, rank, node_counter = 0, 0, 0
    for index, spec in enumerate(specs):
        count = max(stage[2] for stage in spec.stages) + 1
        names = node_names[index] if node_names else [f"n{node_counter + i}" for i in range(count)]
        node_counter += count
        used = [0] * count
        stages, template_stages = [], []
        for start, end, node, gpus, *rest in spec.stages:
            t = rest[0] if rest else 1
            stage_ranks = list(range(rank, rank + gpus))
            rank += gpus
            gpu_ids = list(range(used[node], used[node] + gpus))
            template_stages.append(
                TemplateStage(
                    start=start,
                    end=end,
                    node=node,
                    gpus=gpus,
                    gpu_offset=used[node],
                    forward_ms=1,
                    backward_ms=2,
                    tensor_parallel=t,
                )
            )
            used[node] += gpus
            stages.append(
                Stage(start=start, end=end, node=names[node], gpus=gpu_ids, ranks=stage_ranks, tensor_parallel=t)
            )
        templates.setdefault(
            count, Template(nodes=count, stages=template_stages, iteration_ms=1, m_ref=spec.microbatches)
        )
        pipelines.append(
            Pipeline(
                index=index,
                template_nodes=count,
                nodes=names,
                microbatches=spec.microbatches,
                microbatch_offset=offset,
                stages=stages,
                iteration_ms=1,
            )
        )
        offset += spec.microbatches
    return Plan(
        job=job,
        generation=generation,
        num_layers=num_layers,
        gpus_per_node=gpus_per_node,
        f=f,
        global_microbatches=offset,
        templates=list(templates.values()),
        pipelines=pipelines,
        copies=[LayerCopy(**c) for c in copies or []],
        iteration_ms=1,
    )


@dataclass
class RunResult:
    losses: list[dict]
    layers: dict[int, dict[str, torch.Tensor]]
    """final parameters, merged over all workers (first holder wins; replicas are compared separately)"""
    per_rank: dict[int, dict[int, dict[str, torch.Tensor]]]
    seconds: float


def run_workers(tmp: Path, config: WorkerConfig, plan: Plan, timeout: float = 300) -> RunResult:
    """Run every rank of `plan` as a real worker process; return losses and final parameters."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (tmp / "config.json").write_text(config.model_dump_json())
    (tmp / "plan.json").write_text(plan.to_json())
    losses = tmp / "losses.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    processes = []
    for assignment in plan.ranks:
        # `python -m oobleck.runtime worker ...`, forked from a server that imported torch once (see
        # oobleck_dev.preforked: the same CLI entry, ~2 s of CPU less per rank on the 2-core CI host).
        argv = [
            "-m",
            "oobleck.runtime",
            "worker",
            "--config",
            str(tmp / "config.json"),
            "--plan",
            str(tmp / "plan.json"),
        ]
        argv += ["--store", f"127.0.0.1:{store.port}", "--node", assignment.node, "--gpu", str(assignment.gpu)]
        argv += ["--losses", str(losses), "--dump", str(tmp / f"rank{assignment.rank}.pt")]
        log = tmp / f"rank{assignment.rank}.log"
        processes.append((assignment.rank, preforked.start(argv, log, env)))
    deadline = time.monotonic() + timeout
    failures = []
    for rank, process in processes:
        try:
            code: int | str = process.wait(max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            process.kill()
            code = "timeout"
        if code != 0:
            failures.append(f"rank {rank} exited {code}:\n{(tmp / f'rank{rank}.log').read_text()[-3000:]}")
    if failures:
        for _, process in processes:
            process.kill()
        pytest.fail("\n".join(failures))
    seconds = time.perf_counter() - started
    per_rank = {a.rank: torch.load(tmp / f"rank{a.rank}.pt") for a in plan.ranks}
    merged: dict[int, dict[str, torch.Tensor]] = {}
    for rank in sorted(per_rank):
        for layer, params in per_rank[rank].items():
            merged.setdefault(layer, params)
    records = [json.loads(line) for line in losses.read_text().splitlines()]
    return RunResult(losses=records, layers=merged, per_rank=per_rank, seconds=seconds)


@pytest.fixture
def plan_builder():
    return make_plan, PipelineSpec


@pytest.fixture
def workers():
    return run_workers


# -- whole jobs through `oobleck launch` (the launcher tests' shared helpers, served by the `kit` fixture) --

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
LAUNCH_ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


class LaunchKit:
    """Run `oobleck launch` and check what it did: every loss and final parameter against the reference."""

    LOSS_RTOL = LOSS_RTOL
    PARAM_ATOL = PARAM_ATOL
    PIPELINED_MEMORY = PIPELINED_MEMORY
    ENV = LAUNCH_ENV

    @staticmethod
    def flags(**options: object) -> list[str]:
        """`oobleck launch` flags from keywords, in order: `gpu_memory=5` -> --gpu-memory 5, a list repeats
        the flag (kill_node=["node0", "node2"]), True is a bare flag (heartbeats_only=True)."""
        argv: list[str] = []
        for key, value in options.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
                continue
            for item in value if isinstance(value, (list, tuple)) else [value]:
                argv += [flag, str(item)]
        return argv

    @classmethod
    def pipelined(cls, **options: object) -> list[str]:
        """`flags` of the usual job: 4 nodes, f = 1, 10 steps of 8 microbatches, memory for tiny-gpt
        pipelines of 2-3 nodes; `options` add flags or override these."""
        usual = {"nodes": 4, "f": 1, "steps": 10, "microbatches": 8, "gpu_memory": cls.PIPELINED_MEMORY}
        return cls.flags(**{**usual, **options})

    @staticmethod
    def launch(
        workdir: Path, *args: str, timeout: float = 400, env: dict[str, str] | None = None
    ) -> tuple[int, dict, str]:
        summary = workdir / "summary.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "oobleck.cli",
                "launch",
                "--workdir",
                str(workdir),
                "--summary",
                str(summary),
                "--timeout",
                str(timeout - 30),
                # Compared with the single-process reference to 1e-5: the exact float64 sums.
                *([] if "--gradient-sum-dtype" in args else ["--gradient-sum-dtype", "float64"]),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**LAUNCH_ENV, **(env or {})},
        )
        data = json.loads(summary.read_text()) if summary.exists() else {}
        return proc.returncode, data, proc.stdout + proc.stderr[-4000:]

    @staticmethod
    def leftovers(workdir: Path, exclude: int | None = None) -> list[str]:
        """Running processes (zombies aside) of the run in `workdir`, but `exclude`: a command line that
        mentions it, or an output (fd 1) inside it. A worker forked from the launcher's server keeps the
        server's command line; its output is its log in `workdir`."""
        inside = str(workdir).rstrip("/") + "/"
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in (exclude, os.getpid()):
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                output = os.readlink(entry / "fd" / "1") if (entry / "fd" / "1").exists() else ""
            except OSError:
                continue
            if _running(int(entry.name)) and (str(workdir) in cmdline or output.startswith(inside)):
                found.append(f"{entry.name}: {cmdline[:200]} > {output}")
        return found

    @staticmethod
    def descendants(pid: int) -> set[int]:
        """Every running process below `pid` (the launcher's forkserver, resource tracker and workers)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(parent, []).append(int(entry.name))
        found, frontier = set(), [pid]
        while frontier:
            for child in children.get(frontier.pop(), []):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
        return {p for p in found if _running(p)}

    @staticmethod
    def descendants_left(pids: set[int]) -> set[int]:
        """Those of `pids` still running."""
        return {p for p in pids if _running(p)}

    @staticmethod
    def check_against_reference(workdir: Path, summary: dict, microbatches: int) -> float:
        """Every step's loss and the final generation's parameters against single-process training;
        returns the worst relative loss difference."""
        from oobleck.runtime.train.config import load_config
        from oobleck.runtime.train.reference import train_reference

        config = load_config(workdir / "config.json")
        reference = train_reference(config, microbatches)
        losses = {int(k): v for k, v in summary["losses"].items()}
        assert sorted(losses) == list(range(config.steps)), f"steps logged: {sorted(losses)}"
        worst = 0.0
        for step, expected in enumerate(reference.losses):
            relative = abs(losses[step] - expected) / abs(expected)
            worst = max(worst, relative)
            assert relative <= LOSS_RTOL, f"step {step}: loss {losses[step]} vs reference {expected}"
        plan = json.loads((workdir / "plan.json").read_text())
        seen = set()
        for node, gpu in {(s["node"], g) for p in plan["pipelines"] for s in p["stages"] for g in s["gpus"]}:
            for layer, params in torch.load(workdir / f"{node}-gpu{gpu}.pt").items():
                seen.add(layer)
                for name, value in params.items():
                    difference = (value - reference.layers[layer][name]).abs().max().item()
                    assert difference <= PARAM_ATOL, f"layer {layer} {name}: {difference}"
        assert seen == set(range(plan["num_layers"]))
        return worst


@pytest.fixture
def kit() -> type[LaunchKit]:
    return LaunchKit


@pytest.fixture(scope="session")
def uniform_profile_model():
    """tiny-gpt's measured bytes with equal per-layer times: the planner's choices become deterministic."""
    from oobleck.api.profile import ModelProfile
    from oobleck.runtime.train.config import build_model
    from oobleck.runtime.train.profiler import profile_model

    measured = profile_model(build_model(WorkerConfig()), 4, torch.device("cpu"), 1, 1)
    layers = [layer.model_dump() | {"forward_ms": 1.0, "backward_ms": 2.0} for layer in measured.layers]
    return ModelProfile.model_validate(measured.model_dump() | {"layers": layers})


@pytest.fixture(scope="session")
def uniform_profile(uniform_profile_model, tmp_path_factory) -> Path:
    """`uniform_profile_model` as a profile file (`oobleck launch --profile`)."""
    path = tmp_path_factory.mktemp("profile") / "uniform.json"
    path.write_text(uniform_profile_model.model_dump_json())
    return path

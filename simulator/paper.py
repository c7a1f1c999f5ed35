"""`make paper-figures`: our versions of the figures the Oobleck artifact's simulator draws (SOSP'23 Figs. 1, 9,
10, 12-15), as PNGs, from `oobleck simulate`'s engine with the artifact's traces, models and published costs.

    python -m oobleck.simulate.paper --out docs            # every figure (about a minute on 2 cores)
    python -m oobleck.simulate.paper --out /tmp/f --quick  # two models, two traces: seconds (the tests run it)

Every run: 30 nodes of one A100 40 GB (125 TFLOP/s sustained, 50 Gb/s between nodes; the CLI's defaults),
f = 1, the artifact's global batch per model (its `samples_per_step`), `--costs oobleck-artifact` (Varuna's and
Bamboo's published costs, 45 s node start-up; our own oobleck costs). README, "Simulating goodput", says where
and why the figures differ from the paper's.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from oobleck.planner.synthetic import PRESETS, gpt_profile

from . import traces
from .costs import named
from .engine import EFFECTIVE, LOST, REDUNDANT, Job, Result, simulate
from .report import COLORS, binned_throughput

# The artifact's models and global batches (varuna_simulator.py's samples_per_step, 8192 // 10 for GPT-3
# medium rounded down as there).
MODELS = {
    "bert-large": 8192,
    "gpt2-artifact": 1024,
    "gpt3-medium": 819,
    "gpt3-2.7b": 512,
    "gpt3-6.7b": 1024,
}
LABELS = {
    "bert-large": "BERT-large",
    "gpt2-artifact": "GPT-2 (artifact)",
    "gpt3-medium": "GPT-3 medium (350M)",
    "gpt3-2.7b": "GPT-3 2.7B",
    "gpt3-6.7b": "GPT-3 6.7B",
}
FREQUENCIES = ("6h", "3h", "1h", "30m", "10m")  # Figs. 9 and 13, least frequent failures first
PEERS = ("oobleck", "checkpoint-restart", "redundant-computation")  # the paper's three systems
NAMES = {"oobleck": "Oobleck", "checkpoint-restart": "Varuna", "redundant-computation": "Bamboo"}
# The artifact's published effective-time shares (tools/simulator/README.md, branch sosp23-artifact):
# BERT-large on its 10-minute trace.
ARTIFACT_SHARES = {"oobleck": 95.52, "checkpoint-restart": 54.45, "redundant-computation": 14.98}


def job_of(model: str) -> Job:
    shape = PRESETS[model]
    profile = gpt_profile(
        shape, seq_len=shape.seq_len, microbatch_size=1, gpu_flops=125e12, hbm_bandwidth=1.5e12, name=model
    )
    return Job(profile, 1, 40 << 30, 300e9, 6.25e9, f=1, global_batch=MODELS[model])


def run(model: str, trace: traces.Trace, *, no_checkpoint: bool = False) -> Result:
    costs = named("oobleck-artifact", model)
    policies: tuple[str, ...] = PEERS
    if no_checkpoint:  # Fig. 13: Varuna without its checkpoint overhead
        costs = replace(costs, checkpoint=replace(costs.checkpoint, checkpoint_time_s=0.0))
        policies = ("checkpoint-restart",)
    return simulate(trace, job_of(model), costs, policies)


def mean_rate(result: Result, policy: str) -> float:
    return result.summaries[policy].samples / result.ready.duration_s


def throughput_vs_frequency(models: list[str], frequencies: tuple[str, ...], out: Path) -> dict[str, dict]:
    """Figs. 9 and 13: mean throughput on each failure-frequency trace, per model and system."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(models), figsize=(3.4 * len(models), 3.7), constrained_layout=True)
    axes = [axes] if len(models) == 1 else list(axes)
    numbers: dict[str, dict] = {}
    for ax, model in zip(axes, models):
        rows: dict[str, list[float]] = {name: [] for name in (*PEERS, "ideal", "no-checkpoint")}
        for frequency in frequencies:
            trace = traces.load(f"artifact-30n-{frequency}")
            result = run(model, trace)
            for name in PEERS:
                rows[name].append(mean_rate(result, name))
            rows["ideal"].append(result.ideal_samples / result.ready.duration_s)
            if model == "gpt3-6.7b":
                rows["no-checkpoint"].append(mean_rate(run(model, trace, no_checkpoint=True), "checkpoint-restart"))
        xs = range(len(frequencies))
        width = 0.27
        for k, name in enumerate(PEERS):
            ax.bar([x + (k - 1) * width for x in xs], rows[name], width, color=COLORS[name], label=NAMES[name])
        ax.plot(list(xs), rows["ideal"], color="#999999", ls=":", marker="_", label="ideal (every node up)")
        if rows["no-checkpoint"]:
            ax.plot(list(xs), rows["no-checkpoint"], color="#aaaaaa", marker="o", ms=4, label="Varuna, no ckpt cost")
        ax.set_xticks(list(xs), frequencies)
        ax.set_xlabel("one failure every")
        ax.set_title(LABELS[model], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        numbers[model] = {name: values for name, values in rows.items() if values}
    axes[0].set_ylabel("throughput (samples/s)")
    handles, labels = axes[-1].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    figure.get_layout_engine().set(rect=(0, 0.08, 1, 0.92))  # room for the legend
    figure.suptitle("Throughput against failure frequency (Figs. 9 and 13): 30 nodes, 15 losses", fontsize=11)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return numbers


def throughput_over_time(models: list[str], pattern: str, seed: int, out: Path) -> dict[str, dict]:
    """Figs. 10, 14 and 15: throughput over time on a spot-instance availability trace, per model."""
    import matplotlib.pyplot as plt

    trace = traces.spot_pattern(pattern, seed)
    figure, axes = plt.subplots(
        len(models) + 1, 1, figsize=(9, 1.9 * len(models) + 1.6), sharex=True, constrained_layout=True
    )
    numbers: dict[str, dict] = {}
    hours = 3600.0
    for ax, model in zip(axes[1:], models):
        result = run(model, trace)
        for name in PEERS:
            xs, ys = binned_throughput(result.timelines[name], result.ready.duration_s, 120)
            summary = result.summaries[name]
            ax.plot([x / hours for x in xs], ys, color=COLORS[name], lw=1.8 if name == "oobleck" else 1.1)
            ax.plot([], [], color=COLORS[name], label=f"{NAMES[name]}: {summary.goodput * 100:.0f} % goodput")
        ideal_x = [t / hours for t, _ in result.ideal] + [result.ready.duration_s / hours]
        ideal_y = [r for _, r in result.ideal] + [result.ideal[-1][1]]
        ax.step(ideal_x, ideal_y, where="post", color="#999999", ls=":", lw=1)
        ax.set_ylim(0, max(ideal_y) * 1.4)  # room for the legend above the lines
        ax.set_ylabel("samples/s", fontsize=8)
        ax.set_title(LABELS[model], fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right", ncol=3)
        ax.grid(alpha=0.3)
        numbers[model] = {name: result.summaries[name].goodput for name in PEERS}
    counts = trace.node_counts()
    axes[0].step(
        [t / hours for t, _ in counts] + [trace.duration_s / hours],
        [n for _, n in counts] + [counts[-1][1]],
        where="post",
        color="#8a2be2",
    )
    axes[0].set_ylabel("nodes up", fontsize=8)
    axes[0].set_title(f"{trace.name}: availability (seeded, shaped like the artifact's scaled trace)", fontsize=9)
    axes[0].grid(alpha=0.3)
    axes[-1].set_xlabel("time (h)")
    title = {"gcp": "GCP (Figs. 10, 15)", "ec2-p3": "EC2 P3 (Figs. 10, 14)"}[pattern]
    figure.suptitle(f"Throughput over time on a {title} spot-instance trace", fontsize=11)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return numbers


def breakdown(models: list[str], frequency: str, out: Path) -> dict[str, dict]:
    """Figs. 1 and 12: each system's time by category on one trace, with the artifact's share beside ours."""
    import matplotlib.pyplot as plt

    order = [EFFECTIVE, REDUNDANT, LOST, "checkpointing", "restarting", "failover", "reconfiguring", "waiting"]
    colors = {
        EFFECTIVE: "#2ca02c",
        REDUNDANT: "#9edae5",
        LOST: "#d62728",
        "checkpointing": "#7f7f7f",
        "restarting": "#ff7f0e",
        "failover": "#bcbd22",
        "reconfiguring": "#1f77b4",
        "waiting": "#dddddd",
    }
    trace = traces.load(f"artifact-30n-{frequency}")
    figure, axes = plt.subplots(len(models), 1, figsize=(9, 1.7 * len(models) + 0.9), constrained_layout=True)
    axes = [axes] if len(models) == 1 else list(axes)
    numbers: dict[str, dict] = {}
    for ax, model in zip(axes, models):
        result = run(model, trace)
        numbers[model] = {}
        for row, name in enumerate(PEERS):
            summary = result.summaries[name]
            left = 0.0
            for category in order + [c for c in summary.time_by_category if c not in order]:
                share = summary.time_by_category.get(category, 0.0) / result.ready.duration_s * 100
                if share <= 0:
                    continue
                ax.barh(row, share, left=left, color=colors.get(category, "#444444"), label=category)
                left += share
            paper = f", artifact's simulator {ARTIFACT_SHARES[name]:.1f} %" if model == "bert-large" else ""
            ax.text(
                101,
                row,
                f"{summary.effective_time_share * 100:.1f} % exact, {summary.artifact_time_share * 100:.1f} % "
                f"as the artifact counts{paper}",
                va="center",
                fontsize=7,
            )
            numbers[model][name] = {
                "effective": summary.effective_time_share,
                "artifact": summary.artifact_time_share,
            }
        ax.set_yticks(range(len(PEERS)), [NAMES[n] for n in PEERS])
        ax.set_xlim(0, 175)
        ax.set_xticks([0, 25, 50, 75, 100])
        ax.set_title(f"{LABELS[model]}, one failure every {frequency}", fontsize=9, loc="left")
        ax.invert_yaxis()
    unique: dict[str, object] = {}  # one legend entry per category over every panel
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            unique.setdefault(label, handle)
    figure.legend(unique.values(), unique.keys(), loc="lower center", ncol=8, fontsize=7)
    axes[-1].set_xlabel("% of the trace length (the bars sum to 100 %)")
    figure.get_layout_engine().set(rect=(0, 0.06, 1, 0.94))  # room for the legend
    figure.suptitle("Where the time goes (Figs. 1 and 12)", fontsize=11)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return numbers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for the PNGs (default docs)")
    parser.add_argument("--quick", action="store_true", help="two models, two traces (seconds)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the spot-instance traces")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = ["bert-large", "gpt3-6.7b"] if args.quick else list(MODELS)
    frequencies = ("1h", "10m") if args.quick else FREQUENCIES
    start = time.perf_counter()
    written = {
        "paper-fig9-13-throughput-vs-failure-frequency.png": lambda p: throughput_vs_frequency(models, frequencies, p),
        "paper-fig10-15-gcp.png": lambda p: throughput_over_time(models, "gcp", args.seed, p),
        "paper-fig10-14-ec2-p3.png": lambda p: throughput_over_time(models, "ec2-p3", args.seed, p),
        "paper-fig1-12-breakdown.png": lambda p: breakdown(["bert-large", "gpt3-6.7b"], "10m", p),
    }
    for name, draw in written.items():
        numbers = draw(out / name)
        print(f"{out / name}")
        for model, values in numbers.items():
            print(f"  {model}: {values}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

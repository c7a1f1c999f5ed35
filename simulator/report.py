"""A simulation's results as a table, a JSON document and a PNG (throughput over time, node count, samples)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .costs import describe
from .engine import EFFECTIVE, LOST, REDUNDANT, Result
from .policies import Timeline

DASHED = {"replica-dropping"}  # often on top of oobleck's line: dashed so both stay visible
COLORS = {
    "oobleck": "#e8710a",
    "checkpoint-restart": "#444444",
    "redundant-computation": "#2e8b57",
    "replica-dropping": "#1f5fbf",
}


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def table(result: Result) -> str:
    trace, ready = result.trace, result.ready
    spares = result.costs.nodes.spares
    lines = [
        f"trace {trace.name}: {len(trace.initial)} nodes at start, {trace.losses()} losses, "
        f"{trace.additions()} additions"
        + (f", {trace.slowdowns()} slowdowns" if trace.slowdowns() else "")
        + f" over {_duration(trace.duration_s)}"
        + (f"; nodes usable {result.costs.nodes.startup_s:g} s after they join" if ready is not trace else "")
        + (
            f"; {spares} warm spare{'s' * (spares != 1)}, {result.costs.nodes.spare_join_s:g} s to fold one in"
            if spares
            else ""
        ),
        f"model {result.job.profile.model}: {len(result.job.profile.layers)} layers, global batch "
        f"{result.job.global_batch}, f = {result.job.f}; ideal (f = 0, every node up) "
        f"{result.ideal_samples / trace.duration_s:.2f} samples/s on average, {result.baseline_samples_per_s:.2f} "
        f"at {ready.max_nodes()} nodes (Z = {result.baseline_iteration_s * 1e3:.1f} ms)",
    ]
    if result.speed_bound < 1.0:
        lines.append(
            f"node speeds: the ideal x the mean speed of the nodes up is {result.speed_bound * 100:.1f} % of the ideal"
        )
    if result.bamboo_slowdown is not None:
        lines.append(f"redundant computation: steady-state slowdown {result.bamboo_slowdown:.3f}x")
    categories = [EFFECTIVE, LOST, REDUNDANT]
    for summary in result.summaries.values():
        categories += [c for c in summary.time_by_category if c not in categories]
    used = {c for summary in result.summaries.values() for c in summary.time_by_category}
    categories = [c for c in categories if c in used]
    header = ["policy", "samples", "goodput", "eff. share", "artifact share", *categories]
    rows = [header]
    for summary in result.summaries.values():
        rows.append(
            [
                summary.policy,
                f"{summary.samples:.4g}",
                f"{summary.goodput * 100:.1f} %",
                f"{summary.effective_time_share * 100:.1f} %",
                f"{summary.artifact_time_share * 100:.1f} %",
                *(_duration(summary.time_by_category.get(c, 0.0)) for c in categories),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for k, row in enumerate(rows):
        lines.append(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(
        "goodput: samples / the ideal's; eff. share: effective / trace length (the time columns sum to it); "
        "artifact share: all training / its categories, lost work counted twice and waiting not at all, as the "
        "Oobleck artifact computes its effective time"
    )
    for summary in result.summaries.values():
        if summary.note:
            lines.append(f"{summary.policy}: {summary.note}")
    return "\n".join(lines)


def document(result: Result, recommended: list[tuple[int, float]] | None = None) -> dict[str, Any]:
    """Everything a run produced, JSON-ready (no timestamps or host details: same inputs, same document)."""
    trace = result.trace
    out: dict[str, Any] = {
        "trace": {
            "name": trace.name,
            "initial_nodes": len(trace.initial),
            "most_nodes": trace.max_nodes(),
            "losses": trace.losses(),
            "additions": trace.additions(),
            "slowdowns": trace.slowdowns(),
            "duration_s": trace.duration_s,
        },
        "job": {
            "model": result.job.profile.model,
            "layers": len(result.job.profile.layers),
            "gpus_per_node": result.job.gpus_per_node,
            "gpu_memory_bytes": result.job.gpu_memory_bytes,
            "intra_node_bandwidth": result.job.intra_node_bandwidth,
            "inter_node_bandwidth": result.job.inter_node_bandwidth,
            "f": result.job.f,
            "global_batch": result.job.global_batch,
            "min_nodes_per_pipeline": result.job.min_nodes_per_pipeline,
            "max_tensor_parallel": result.job.max_tensor_parallel,
        },
        "costs": describe(result.costs),
        "baseline": {"samples_per_s": result.baseline_samples_per_s, "iteration_s": result.baseline_iteration_s},
        "ideal_samples": result.ideal_samples,
        "speed_bound": result.speed_bound,
        "redundant_computation_slowdown": result.bamboo_slowdown,
        "policies": {
            name: {
                "samples": s.samples,
                "goodput": s.goodput,
                "effective_time_share": s.effective_time_share,
                "artifact_time_share": s.artifact_time_share,
                "time_by_category": s.time_by_category,
                "seconds_by_state": s.seconds_by_state,
                "lost_seconds": s.lost_seconds,
                "note": s.note,
                "events": len(result.timelines[name].events),
            }
            for name, s in result.summaries.items()
        },
    }
    if recommended is not None:
        out["recommend_f"] = {"best": recommended[0][0], "goodput_by_f": {str(f): g for f, g in sorted(recommended)}}
    return out


def binned_throughput(timeline: Timeline, duration: float, bins: int) -> tuple[list[float], list[float]]:
    """Samples per second averaged over `bins` equal windows (work lost counted in its failure's window),
    as step-plot points: short stalls show as dips of the window's mean instead of a comb of spikes."""
    width = duration / bins
    trained = [0.0] * bins
    for segment in timeline.segments:
        k = int(segment.start_s // width)
        start = segment.start_s
        while start < segment.end_s and k < bins:
            end = min(segment.end_s, (k + 1) * width)
            trained[k] += (end - start) * segment.samples_per_s
            start, k = end, k + 1
    for loss in timeline.losses:
        trained[min(int(loss.time_s // width), bins - 1)] -= loss.samples
    xs, ys = [], []
    for k, samples in enumerate(trained):
        xs += [k * width, (k + 1) * width]
        ys += [max(samples, 0.0) / width] * 2
    return xs, ys


def plot(result: Result, path: str | Path, title: str | None = None, bins: int = 96) -> None:
    """Throughput per policy over time (window means) with the trace's node count underneath, and
    cumulative samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = result.trace
    duration = trace.duration_s
    scale, unit = (3600.0, "h") if duration >= 3 * 3600 else (60.0, "min")
    figure, (top, nodes, bottom) = plt.subplots(
        3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1, 2.2]}, constrained_layout=True
    )
    ideal_x = [t / scale for t, _ in result.ideal] + [duration / scale]
    ideal_y = [r for _, r in result.ideal] + [result.ideal[-1][1]]
    top.step(ideal_x, ideal_y, where="post", color="#999999", lw=1.0, ls=":", label="ideal (f = 0, every node up)")
    for name, timeline in result.timelines.items():
        color = COLORS.get(name)
        summary = result.summaries[name]
        label = f"{name} ({summary.goodput * 100:.1f} % goodput)"
        xs, ys = binned_throughput(timeline, duration, bins)
        xs = [x / scale for x in xs]
        ours = name == "oobleck"
        style = {
            "color": color,
            "lw": 2.2 if ours else 1.3,
            "zorder": 3 if ours else 2,
            "ls": "--" if name in DASHED else "-",
        }
        top.plot(xs, ys, label=label, **style)
        # Cumulative samples: training segments add; work lost is taken back at the failure's time.
        cx, cy, total = [0.0], [0.0], 0.0
        for segment in timeline.segments:
            total += (segment.end_s - segment.start_s) * segment.samples_per_s
            cx.append(segment.end_s / scale)
            cy.append(total / 1e6)
        lost_at = sorted((loss.time_s / scale, loss.samples / 1e6) for loss in timeline.losses)
        adjusted, taken, k = [], 0.0, 0
        for x, y in zip(cx, cy):
            while k < len(lost_at) and lost_at[k][0] <= x:
                taken += lost_at[k][1]
                k += 1
            adjusted.append(y - taken)
        bottom.plot(cx, adjusted, **style)
    top.set_ylabel(f"samples/s\n(mean over {_duration(duration / bins)})")
    top.set_ylim(bottom=0, top=max(ideal_y) * 1.35 if max(ideal_y) > 0 else 1)
    top.legend(loc="upper center", ncol=2, fontsize=8, framealpha=0.9)
    top.grid(alpha=0.3)
    counts = result.ready.node_counts()
    nx = [t / scale for t, _ in counts] + [duration / scale]
    ny = [n for _, n in counts] + [counts[-1][1]]
    nodes.step(nx, ny, where="post", color="#8a2be2", lw=1.2)
    nodes.set_ylabel("nodes usable")
    nodes.set_ylim(max(0, min(ny) - max(2, 0.1 * max(ny))), max(ny) + max(1, 0.05 * max(ny)))
    nodes.grid(alpha=0.3)
    bottom.set_ylabel("samples trained\n(millions)")
    bottom.set_xlabel(f"time ({unit})")
    bottom.grid(alpha=0.3)
    bottom.set_xlim(0, duration / scale)
    figure.suptitle(title or f"{result.job.profile.model} on {trace.name}", fontsize=11)
    figure.savefig(path, dpi=110)
    plt.close(figure)

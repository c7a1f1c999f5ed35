"""Stragglers from the workers' pace reports (operator/stragglers.py): pure, over real report JSON."""

from __future__ import annotations

import pytest

from oobleck.api.reports import ProgressReport
from oobleck.api.spec import StragglerPolicy
from oobleck.api.status import Straggler
from oobleck.operator.stragglers import RECOVERED, STRAGGLER, assess, relative_slowdowns

NODES = ["w-0", "w-1", "w-2", "w-3"]
POLICY = StragglerPolicy(threshold=1.5, window=10)


def reports(step: int, paces: dict[str, float], generation: int = 0) -> dict[str, ProgressReport]:
    """Each node's progress annotation as a worker writes it, parsed as observe.py does."""
    return {
        node: ProgressReport.parse(f'{{"generation": {generation}, "step": {step}, "pace": [[{step}, {pace}]]}}')  # type: ignore[misc]
        for node, pace in paces.items()
    }


def histories(steps: range, paces: dict[str, float], generation: int = 0) -> dict[str, ProgressReport]:
    """As `reports`, each node's figure the same at every one of `steps` (a report carries its last steps)."""
    return {
        node: ProgressReport.parse(  # type: ignore[misc]
            f'{{"generation": {generation}, "step": {steps[-1]}, "pace": {[[s, pace] for s in steps]}}}'
        )
        for node, pace in paces.items()
    }


def test_a_host_slow_everywhere_makes_no_straggler_and_a_lone_node_is_never_compared() -> None:
    # Every node 3x its profile (a loaded machine): each is at the others' median.
    assert relative_slowdowns({n: 3.0 for n in NODES}) == {n: pytest.approx(1.0) for n in NODES}
    assert relative_slowdowns({"w-0": 5.0}) == {}
    # Two nodes: the slow one against the fast one, not against a mean it pulls up itself.
    assert relative_slowdowns({"w-0": 2.0, "w-1": 1.0}) == {"w-0": 2.0, "w-1": 0.5}


def test_a_node_slow_for_the_window_is_confirmed_once_then_recovers() -> None:
    paces = {"w-0": 1.2, "w-1": 1.25, "w-2": 2.6, "w-3": 1.3}
    first = assess(NODES, 0, reports(40, paces), [], POLICY)
    assert first.stragglers == [Straggler(node="w-2", slowdown=2.08, since_step=40, confirmed=False)]
    assert first.events == []
    assert set(first.slowdowns) == set(NODES)
    # Still slow 9 steps later: not yet the window.
    later = assess(NODES, 0, reports(49, paces), first.stragglers, POLICY)
    assert [(s.since_step, s.confirmed) for s in later.stragglers] == [(40, False)]
    # 10 steps: confirmed, one event naming the node, its slowdown and the step it began.
    confirmed = assess(NODES, 0, reports(50, paces), later.stragglers, POLICY)
    assert [(s.since_step, s.confirmed) for s in confirmed.stragglers] == [(40, True)]
    assert [(kind, reason) for kind, reason, _ in confirmed.events] == [("Warning", STRAGGLER)]
    assert "w-2 computes 2.08x slower" in confirmed.events[0][2] and "since step 40" in confirmed.events[0][2]
    # No second event while it stays slow.
    assert assess(NODES, 0, reports(70, paces), confirmed.stragglers, POLICY).events == []
    # Back to pace: released as it was confirmed, after a window of figures under the threshold.
    under = assess(NODES, 0, reports(80, {**paces, "w-2": 1.3}), confirmed.stragglers, POLICY)
    assert [(s.slowdown, s.since_step, s.confirmed) for s in under.stragglers] == [(1.04, 40, True)]
    assert under.events == []
    back = assess(NODES, 0, histories(range(71, 81), {**paces, "w-2": 1.3}), under.stragglers, POLICY)
    assert back.stragglers == []
    assert [(kind, reason) for kind, reason, _ in back.events] == [("Normal", RECOVERED)]


def test_a_confirmed_node_wobbling_about_the_threshold_is_one_episode() -> None:
    # Seen under a CPU quota: 4.15x, then 1.63x under a re-split share, then 2.17x. One Straggler event.
    trace = {step: 4.15 for step in range(31, 45)}
    trace |= {step: 1.2 for step in range(45, 52)} | {step: 2.17 for step in range(52, 56)}
    trace |= {step: 1.3 for step in range(56, 66)}  # from step 65: its last 10 figures under the threshold

    def read(last: int) -> dict[str, ProgressReport]:
        steps = [s for s in trace if last - 24 < s <= last]
        figures = {"w-0": [[s, 1.0] for s in steps], "w-2": [[s, trace[s]] for s in steps]}
        figures |= {"w-1": figures["w-0"], "w-3": figures["w-0"]}
        return {
            n: ProgressReport.parse(f'{{"generation": 0, "step": {last}, "pace": {p}}}') for n, p in figures.items()
        }  # type: ignore[misc]

    listed: list[Straggler] = []
    events: list[str] = []
    for last in range(31, 65):
        found = assess(NODES, 0, read(last), listed, POLICY)
        listed, events = found.stragglers, [*events, *(reason for _, reason, _ in found.events)]
        episode = [(s.node, s.since_step, s.confirmed) for s in listed]
        assert episode == [("w-2", 31, last >= 41)], (last, episode)
        if last < 45 or 52 <= last < 56:
            assert found.typical == {"w-2": pytest.approx(trace[last])}
        else:  # listed under the threshold: not a figure any mitigation plans around
            assert found.typical == {} and listed[0].slowdown == pytest.approx(trace[last], abs=1e-3)
    assert events == [STRAGGLER]
    # Ten steps all under the threshold: released, one recovery event.
    released = assess(NODES, 0, read(65), listed, POLICY)
    assert released.stragglers == [] and [reason for _, reason, _ in released.events] == [RECOVERED]


def test_nodes_are_lined_up_step_by_step_however_late_the_reports_are_read() -> None:
    # The operator reads the reports 12 steps after w-2 fell behind (at step 40), each at another step;
    # the host slowed every node 3x from step 30 (no one's fault).
    def history(last: int, slow_from: int | None) -> str:
        pace = [
            [s, (3.0 if s >= 30 else 1.0) * (2.0 if slow_from is not None and s >= slow_from else 1.0)]
            for s in range(last - 23, last + 1)
        ]
        return f'{{"generation": 0, "step": {last}, "pace": {pace}}}'

    late = {
        "w-0": ProgressReport.parse(history(52, None)),
        "w-1": ProgressReport.parse(history(50, None)),
        "w-2": ProgressReport.parse(history(52, 40)),
    }
    found = assess(NODES, 0, late, [], POLICY)  # type: ignore[arg-type]
    assert [(s.node, s.since_step, s.confirmed) for s in found.stragglers] == [("w-2", 40, True)]
    assert [reason for _, reason, _ in found.events] == [STRAGGLER]
    assert found.slowdowns["w-2"] == pytest.approx(2.0) and found.slowdowns["w-0"] == pytest.approx(3 / 4.5)


def test_reports_of_another_generation_or_without_a_pace_are_left_out() -> None:
    mixed = {**reports(30, {"w-0": 1.0, "w-1": 1.0}), **reports(30, {"w-2": 4.0}, generation=1)}
    mixed["w-3"] = ProgressReport(generation=0, step=30)  # not measured yet
    found = assess(NODES, 0, mixed, [], POLICY)
    assert set(found.slowdowns) == {"w-0", "w-1"} and found.stragglers == []
    # A member not measured in this generation yet keeps its entry (no second event once it reports).
    known = Straggler(node="w-2", slowdown=3, since_step=1, confirmed=True)
    waiting = assess(NODES, 1, reports(30, {"w-0": 1.0, "w-1": 1.0}, generation=1), [known], POLICY)
    assert waiting.stragglers == [known] and waiting.events == []
    # A lost node that was confirmed leaves the list without a recovery event (the failure path owns it).
    gone = assess(
        ["w-0", "w-1"],
        0,
        reports(30, {"w-0": 1.0, "w-1": 1.0}),
        [Straggler(node="w-2", slowdown=3, since_step=1, confirmed=True)],
        POLICY,
    )
    assert gone.stragglers == [] and gone.events == []


def calibrated(steps: range, paces: dict[str, tuple[float, float]]) -> dict[str, ProgressReport]:
    """As `histories`, each node's (figure against its own pace, the calibrated pace it is over)."""
    return {
        node: ProgressReport.parse(  # type: ignore[misc]
            f'{{"generation": 0, "step": {steps[-1]}, "pace": {[[s, pace] for s in steps]}, "paceBaseline": {base}}}'
        )
        for node, (pace, base) in paces.items()
    }


# Two 2-stage pipelines of one template: w-0 and w-2 run layers 0-3, w-1 and w-3 layers 4-7.
WORK = {"w-0": (0, 4, 1, 1), "w-1": (4, 8, 1, 1), "w-2": (0, 4, 1, 1), "w-3": (4, 8, 1, 1)}


def test_a_node_slow_from_its_start_is_found_against_the_node_running_the_same_layers() -> None:
    # w-2 computed twice as long as w-0 for the same layers from its first step: against its own pace it
    # reads 1, as every node does.
    paces = {"w-0": (1.0, 1.1), "w-1": (1.0, 0.8), "w-2": (1.0, 2.2), "w-3": (1.0, 0.85)}
    found = assess(NODES, 0, calibrated(range(41, 51), paces), [], POLICY, WORK)
    assert found.slowdowns == {"w-0": 0.5, "w-1": pytest.approx(0.941, abs=1e-3), "w-2": 2.0, "w-3": 1.0625}
    assert [(s.node, s.confirmed) for s in found.stragglers] == [("w-2", False)]
    # Without the layers each runs, each node is measured against its own pace: no one is slow.
    assert assess(NODES, 0, calibrated(range(41, 51), paces), [], POLICY).stragglers == []


def test_a_node_that_calibrated_while_the_host_was_busier_makes_no_straggler_of_its_peer() -> None:
    # Two single-stage pipelines. w-2, folded in while the host was twice as busy, calibrated at 2.2; now it
    # computes as fast as w-0, which reads 1 against its own pace: by their own paces w-0 is 2x slower.
    nodes, work = ["w-0", "w-2"], {"w-0": (0, 8, 1, 1), "w-2": (0, 8, 1, 1)}
    paces = {"w-0": (1.0, 1.1), "w-2": (0.5, 2.2)}
    found = assess(nodes, 0, calibrated(range(41, 51), paces), [], POLICY, work)
    assert found.stragglers == [] and found.slowdowns == {"w-0": 1.0, "w-2": 1.0}
    assert [s.node for s in assess(nodes, 0, calibrated(range(41, 51), paces), [], POLICY).stragglers] == ["w-0"]


def test_a_node_without_a_peer_on_its_layers_is_compared_by_its_own_pace_with_all_the_others() -> None:
    # Layers moved off w-2 to w-3: no two nodes run the same layers any more. w-3 reads 2x its own pace.
    work = {**WORK, "w-2": (0, 2, 1, 1), "w-3": (2, 8, 1, 1)}
    paces = {"w-0": (1.0, 1.1), "w-1": (1.0, 0.8), "w-2": (1.0, 2.2), "w-3": (2.0, 0.85)}
    found = assess(NODES, 0, calibrated(range(41, 51), paces), [], POLICY, work)
    assert found.slowdowns == {"w-0": 1.0, "w-1": 1.0, "w-2": 1.0, "w-3": 2.0}
    # A report without its calibrated pace (an older worker) is compared the same way.
    paces = {"w-0": (1.0, 1.1), "w-1": (1.0, 0.8), "w-2": (1.0, 2.2), "w-3": (1.0, 0.85)}
    legacy = histories(range(41, 51), {"w-2": 3.0})
    found = assess(NODES, 0, {**calibrated(range(41, 51), paces), **legacy}, [], POLICY, WORK)
    assert found.slowdowns["w-2"] == 3.0 and found.slowdowns["w-0"] == pytest.approx(1 / 1.0)

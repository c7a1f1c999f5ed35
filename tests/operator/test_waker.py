"""The job daemon's wake-up signal: the batch window counts from the first event that may be a loss."""

from oobleck.operator import observe
from oobleck.operator.handlers import Waker, _only_progress_changed


def pod(**changes) -> observe.PodSummary:
    fields = {"name": "w-0", "uid": "u", "role": "worker", "node_name": "n0", "phase": "Running", "created": 1.0}
    return observe.PodSummary(**(fields | changes))


def test_a_progress_report_is_news_but_not_a_possible_loss():
    assert _only_progress_changed(pod(progress='{"step": 1}'), pod(progress='{"step": 2}'))
    assert not _only_progress_changed(pod(), pod(phase="Failed", terminated=(137, "Error")))
    assert not _only_progress_changed(pod(progress="a"), pod(progress="b", deleting=True))
    assert not _only_progress_changed(None, pod())  # a new pod
    assert not _only_progress_changed(pod(), None)  # a deleted one


def test_the_window_counts_from_the_first_possible_loss_not_from_a_progress_wake():
    waker = Waker()
    waker.wake(100.0, may_be_loss=False)  # a progress report opened the round
    assert waker.event.is_set() and waker.batch_open_for(3.0, now=103.0) == 0.0
    waker.wake(102.9)  # a worker's exit, just before a window counted from 100 would close
    waker.wake(103.5)  # the second exit of the same failure
    assert waker.loss_at == 102.9
    assert abs(waker.batch_open_for(3.0, now=103.0) - 2.9) < 1e-9
    assert waker.batch_open_for(3.0, now=106.0) == 0.0
    assert waker.take() == 100.0
    assert not waker.event.is_set() and waker.first_at is None and waker.loss_at is None
    assert waker.take() is None

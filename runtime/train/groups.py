"""The process groups one plan generation needs, and interruptible waits on their work.

Groups are built directly as backend objects (gloo on CPU, NCCL on CUDA — the same calls either
way) instead of through `torch.distributed.new_group`: only the members of a group take part in
creating it, under names we choose, in a store namespace of its own per generation
(`{job}/gen{g}/...`; reusing names across generations hangs, see notes/torch-distributed.md). This
is the one module that touches torch's private c10d classes.

Groups of a generation:
- `link/{src}-{dst}`: one per direction between two ranks that exchange tensors (consecutive
  stages of a pipeline whose microbatch rows overlap; the source and destination of a LayerCopy);
- `holders/{r1}-{r2}-...`: every distinct set of (two or more) ranks holding the same layers, for the
  per-layer gradient sum.
- `tp/{r1}-...`: the t consecutive ranks of a stage that split its layers (tensor_parallel = t > 1), for
  the split layers' own all-reduces (runtime/train/tensor_parallel.py).
Every rank creates its groups in one global order (sorted by name): creation is a rendezvous of
the members, and a common order makes it deadlock-free.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from oobleck.api.plan import Pipeline, Plan, RankAssignment, Stage

log = logging.getLogger("oobleck.runtime.train.groups")


class Interrupted(RuntimeError):
    """The control side asked this worker to abandon the current generation."""


class CommError(RuntimeError):
    """A send, receive or collective failed (typically: a peer died)."""


# Groups and threads of abandoned generations. Destroying a gloo group with an op in flight can
# block, so they are kept referenced here instead; one generation's worth is small.
GRAVEYARD: list[object] = []

# The address gloo's pairs listen on; None: gloo's default (the host name's address). A worker pod
# sets its pod IP (bind_to): on local nodes several pods share one host, each with its own IP.
_BIND_ADDRESS: str | None = None


def bind_to(address: str | None) -> None:
    """Make every gloo group created from now on listen on `address` (None: gloo's default)."""
    global _BIND_ADDRESS
    _BIND_ADDRESS = address or None


def rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) of a microbatch of `total` samples that part `index` of `parts` handles."""
    return index * total // parts, (index + 1) * total // parts


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def stage_rows(microbatch_size: int, stage: Stage, position: int) -> tuple[int, int]:
    """Rows of a microbatch that the rank at `position` of `stage.ranks` runs: the stage's len/t groups of
    t ranks split the microbatch, every rank of a group runs the group's rows."""
    t = stage.tensor_parallel
    return rows(microbatch_size, len(stage.ranks) // t, position // t)


def exchanges(sender: Stage, receiver: Stage, microbatch_size: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(sender rank, receiver rank, rows) of one tensor passed between neighbouring stages.

    Tensors between stages are whole (never TP shards): every rank of the receiving stage gets the whole
    rows it runs, each piece from the one sender whose rows overlap them and whose TP index equals the
    receiver's TP index modulo the sender's t (all TP ranks of a group hold the same tensor). With t = 1 on
    both sides: every overlapping pair, as before tensor parallelism."""
    found = []
    for j, b in enumerate(receiver.ranks):
        wanted = (j % receiver.tensor_parallel) % sender.tensor_parallel
        for i, a in enumerate(sender.ranks):
            if i % sender.tensor_parallel != wanted:
                continue
            common = overlap(stage_rows(microbatch_size, sender, i), stage_rows(microbatch_size, receiver, j))
            if common:
                found.append((a, b, common))
    return found


def tensor_parallel_groups(stage: Stage) -> list[tuple[int, ...]]:
    """The stage's groups of t consecutive ranks that split its layers ([] when t = 1)."""
    t = stage.tensor_parallel
    if t == 1:
        return []
    return [tuple(stage.ranks[i : i + t]) for i in range(0, len(stage.ranks), t)]


@dataclass(frozen=True)
class Layout:
    """What one rank does in a plan (pure data derived from the plan)."""

    rank: int
    assignment: RankAssignment
    pipeline: Pipeline
    stage_index: int
    stage: Stage
    shard: int
    """this rank's index among its stage's ranks: it runs stage_rows(mb, stage, shard)"""
    holder_sets: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    """for each distinct set of holders of this rank's layers: the layers it holds"""

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == len(self.pipeline.stages) - 1

    @property
    def layers(self) -> range:
        return range(self.stage.start, self.stage.end)

    @property
    def tensor_parallel(self) -> int:
        return self.stage.tensor_parallel

    @property
    def tp_index(self) -> int:
        """this rank's index in its tensor-parallel group (0 when t = 1)"""
        return self.shard % self.stage.tensor_parallel

    @property
    def tp_members(self) -> tuple[int, ...]:
        """the ranks of this rank's tensor-parallel group (itself alone when t = 1)"""
        t = self.stage.tensor_parallel
        first = self.shard - self.tp_index
        return tuple(self.stage.ranks[first : first + t])

    def neighbours(self, offset: int) -> list[int]:
        """Ranks of the stage `offset` away (-1 previous, +1 next), or [] past the ends."""
        index = self.stage_index + offset
        if 0 <= index < len(self.pipeline.stages):
            return list(self.pipeline.stages[index].ranks)
        return []


def layout(plan: Plan, rank: int) -> Layout:
    """This rank's part of the plan."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank: {rank} is outside the plan's 0..{plan.world_size - 1}")
    assignment = plan.ranks[rank]
    pipeline = next(p for p in plan.pipelines if p.index == assignment.pipeline)
    stage = pipeline.stages[assignment.stage]
    if rank not in stage.ranks:
        raise ValueError(f"ranks[{rank}]: pipeline {pipeline.index} stage {assignment.stage} does not list rank {rank}")
    sets: dict[tuple[int, ...], list[int]] = {}
    for layer in range(stage.start, stage.end):
        sets.setdefault(tuple(plan.holders(layer)), []).append(layer)
    return Layout(rank, assignment, pipeline, assignment.stage, stage, stage.ranks.index(rank), sets)


@dataclass(frozen=True)
class GroupSpec:
    """One group of a generation: its store name, its members (ascending) and what it carries."""

    name: str
    members: tuple[int, ...]
    key: tuple
    """("link", src, dst): one-way messages src -> dst; ("holders", *ranks): gradient sums"""


def tied_holders(plan: Plan, layers: Sequence[int]) -> tuple[int, ...]:
    """Every rank holding any of `layers` (the layers of one tied parameter), ascending."""
    return tuple(sorted({rank for layer in layers for rank in plan.holders(layer)}))


def group_specs(
    plan: Plan, microbatch_size: int, ties: Sequence[Sequence[int]] = (), everyone: bool = False
) -> list[GroupSpec]:
    """Every group of the generation, in the one creation order all ranks share. `ties`: the layers of
    each tied parameter (LayeredModel.tied_parameters), whose gradient is summed over all their holders;
    `everyone` adds a group of all ranks (the global gradient norm of clipping needs one small all-reduce)."""
    specs: dict[str, GroupSpec] = {}

    def link(src: int, dst: int) -> None:
        # One group per direction: with NCCL a group's operations queue on one stream, so a send
        # and a receive between the same two ranks in one group could wait on each other (1F1B
        # sends activations up while gradients come down).
        if src != dst:
            name = f"link/{src}-{dst}"
            specs[name] = GroupSpec(name, (min(src, dst), max(src, dst)), ("link", src, dst))

    for pipeline in plan.pipelines:
        for upper, lower in zip(pipeline.stages, pipeline.stages[1:]):
            # Only the pairs that exchange activations (down) or their gradients (up).
            for src, dst, _ in exchanges(upper, lower, microbatch_size) + exchanges(lower, upper, microbatch_size):
                link(src, dst)
        for stage in pipeline.stages:
            for members in tensor_parallel_groups(stage):
                name = "tp/" + "-".join(map(str, members))
                specs[name] = GroupSpec(name, members, ("tp", *members))
    for copy in plan.copies:
        link(copy.src_rank, copy.dst_rank)
    for layer in range(plan.num_layers):
        holders = tuple(plan.holders(layer))
        if len(holders) > 1:
            name = "holders/" + "-".join(map(str, holders))
            specs[name] = GroupSpec(name, holders, ("holders", *holders))
    for layers in ties:
        members = tied_holders(plan, layers)
        if len(members) > 1:
            name = "tied/" + "-".join(map(str, members))
            specs[name] = GroupSpec(name, members, ("tied", *members))
    if everyone and plan.world_size > 1:
        specs["everyone"] = GroupSpec("everyone", tuple(range(plan.world_size)), ("everyone",))
    return [specs[name] for name in sorted(specs)]


def _backend(store: Store, rank: int, size: int, device: torch.device, timeout: timedelta):
    if device.type == "cuda":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        # Non-blocking communicators: abort() then reliably ends kernels stuck on a dead peer.
        options.config.blocking = 0
        return ProcessGroupNCCL(store, rank, size, options)
    if _BIND_ADDRESS is None:
        return ProcessGroupGloo(store, rank, size, timeout)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's private API: the one way to bind gloo
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=_BIND_ADDRESS)]
    return ProcessGroupGloo(store, rank, size, options)


class GenerationGroups:
    """The groups of one generation that `rank` belongs to. Creating it is a rendezvous."""

    def __init__(
        self,
        store: Store,
        plan: Plan,
        rank: int,
        microbatch_size: int,
        device: torch.device,
        timeout: float,
        failed: threading.Event | None = None,
        poll: float = 0.05,
        ties: Sequence[Sequence[int]] = (),
        everyone: bool = False,
    ) -> None:
        self.plan, self.rank, self.device = plan, rank, device
        self.namespace = f"{plan.job}/gen{plan.generation}/"
        self._groups: dict[tuple, Any] = {}
        self._members: dict[tuple, tuple[int, ...]] = {}
        self.abandoned = False
        mine = [spec for spec in group_specs(plan, microbatch_size, ties, everyone) if rank in spec.members]
        # Creation blocks until every member connects; it runs in a helper thread so that a failure
        # elsewhere (the event) ends the wait instead of the connect timeout.
        done, error = threading.Event(), []

        def create() -> None:
            base = PrefixStore(self.namespace, store)
            try:
                for spec in mine:
                    self._groups[spec.key] = _backend(
                        PrefixStore(spec.name + "/", base),
                        spec.members.index(rank),
                        len(spec.members),
                        device,
                        timedelta(seconds=timeout),
                    )
                    self._members[spec.key] = spec.members
            except BaseException as exc:  # handed to the constructing thread
                error.append((spec.name, exc))
            finally:
                done.set()

        thread = threading.Thread(target=create, name=f"groups:gen{plan.generation}", daemon=True)
        thread.start()
        while not done.wait(poll):
            if failed is not None and failed.is_set():
                GRAVEYARD.append((thread, self._groups))
                self._groups = {}
                self.abandoned = True
                raise Interrupted(f"interrupted while building the groups of generation {plan.generation}")
        if error:
            name, exc = error[0]
            raise CommError(f"building group {self.namespace}{name} (rank {rank}): {exc}") from exc

    def link(self, src: int, dst: int) -> tuple[Any, int]:
        """The backend carrying messages src -> dst, and the peer's (the other end's) rank in it."""
        key = ("link", src, dst)
        if key not in self._groups:
            raise KeyError(f"no link {src} -> {dst} in generation {self.plan.generation} (rank {self.rank})")
        peer = dst if src == self.rank else src
        return self._groups[key], self._members[key].index(peer)

    def holders(self, members: tuple[int, ...]) -> Any | None:
        """The backend of a holder set; None when this rank is the only holder."""
        if len(members) == 1:
            return None
        return self._groups[("holders", *members)]

    def tensor_parallel(self, members: tuple[int, ...]) -> Any:
        """The backend of a tensor-parallel group (`Layout.tp_members`, t > 1)."""
        return self._groups[("tp", *members)]

    def tied(self, members: tuple[int, ...]) -> Any | None:
        """The backend summing a tied parameter's gradient over `members`; None when this rank is the only one."""
        if len(members) == 1:
            return None
        return self._groups[("tied", *members)]

    def everyone(self) -> Any | None:
        """The backend of all ranks (built with `everyone=True`); None in a world of one rank."""
        if self.plan.world_size == 1:
            return None
        if ("everyone",) not in self._groups:
            raise KeyError(f"generation {self.plan.generation}'s groups were built without the all-ranks group")
        return self._groups[("everyone",)]

    def abandon(self) -> None:
        """Drop every group without waiting for anything in flight.

        NCCL groups are aborted (that terminates their kernels, which would otherwise occupy the GPU
        forever); gloo has no working abort (gloo#388), its groups just stay referenced."""
        if self.device.type == "cuda":
            for key, backend in self._groups.items():
                try:
                    backend.abort()
                except RuntimeError as error:  # the group is being thrown away; say so and go on
                    log.warning("abort of group %s failed: %s", key, error)
        GRAVEYARD.append(self._groups)
        self._groups = {}
        self.abandoned = True


def wait(work, failed: threading.Event | None, poll: float, timeout: float, what: str, cuda: bool = False) -> None:
    """Wait for `work` while watching `failed`; raise Interrupted or CommError instead of hanging.

    gloo: `is_completed()` stays False for p2p until `wait()` and a timed-out p2p wait breaks the
    group, so the blocking wait runs in a daemon helper thread that is left behind if we give up.
    NCCL (`cuda=True`): `wait()` only orders streams, so poll `is_completed()` (an event query).
    """
    if cuda:
        _poll_completion(work, failed, poll, timeout, what)
        return
    if work.is_completed():  # collectives often are by now: no hand-off needed
        try:
            work.wait()
        except RuntimeError as error:
            raise CommError(f"{what}: {error}") from error
        return
    _waiter().wait([(work, what)], failed, poll, timeout)


def wait_all(
    works: list[tuple[Any, str]], failed: threading.Event | None, poll: float, timeout: float, cuda: bool = False
) -> None:
    """`wait` for each (work, what) in turn, with one hand-off to the helper thread for all of them.

    A hand-off costs two thread wake-ups (~50 us on a loaded 2-core machine); a step's sends are
    waited together at its end, when most have completed, so one hand-off replaces one per send."""
    if cuda:
        for work, what in works:
            _poll_completion(work, failed, poll, timeout, what)
        return
    pending = []
    for work, what in works:
        if work.is_completed():  # collectives often are by now: no hand-off needed
            try:
                work.wait()
            except RuntimeError as error:
                raise CommError(f"{what}: {error}") from error
        else:
            pending.append((work, what))
    if pending:
        _waiter().wait(pending, failed, poll, timeout)


class Ticket:
    """Works handed to the helper thread (`hand_off`), waited for later: the caller goes on meanwhile."""

    def __init__(self, works: list[tuple[Any, str]], waiter: _Waiter) -> None:
        self.works, self.waiter, self.thread = works, waiter, waiter.thread
        self.done, self.progress, self.error = threading.Event(), [0], []

    def wait(self, failed: threading.Event | None, poll: float, timeout: float) -> None:
        """Wait for every work of the ticket while watching `failed`; Interrupted or CommError instead of hanging."""
        deadline = time.monotonic() + timeout
        while not self.done.wait(poll):
            what = self.works[self.progress[0]][1]  # the work the helper is blocked on
            if failed is not None and failed.is_set():
                self.cancel()
                raise Interrupted(f"interrupted while waiting for {what}")
            if time.monotonic() > deadline:
                self.cancel()
                raise CommError(f"{what}: no completion within {timeout:.0f} s")
        if self.error:
            raise CommError(f"{self.works[self.progress[0]][1]}: {self.error[0]}") from self.error[0]

    def cancel(self) -> None:
        """Give up on the works: a helper still blocked on them goes to the graveyard, a fresh one takes over."""
        if not self.done.is_set() and self.waiter.thread is self.thread:
            self.waiter.replace(self.works)


class _Waiter:
    """A helper thread that blocks in `work.wait()` on behalf of one caller thread.

    Reused across waits (a thread per wait costs ~0.1 ms); when the caller gives up on a work that
    never completes, the stuck thread goes to the graveyard and a fresh one takes over.
    """

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(self._queue,), name="oobleck-wait", daemon=True)
        self.thread.start()

    @staticmethod
    def _run(requests: queue.SimpleQueue) -> None:
        while True:
            ticket = requests.get()
            try:
                for index, (work, _) in enumerate(ticket.works):
                    ticket.progress[0] = index
                    work.wait()
            except BaseException as exc:  # handed to the waiting caller
                ticket.error.append(exc)
            finally:
                ticket.done.set()

    def submit(self, works: list[tuple[Any, str]]) -> Ticket:
        """Queue `works` for the helper (waited in order, after anything queued before) and return at once."""
        ticket = Ticket(works, self)
        self._queue.put(ticket)
        return ticket

    def wait(self, works: list[tuple[Any, str]], failed: threading.Event | None, poll: float, timeout: float) -> None:
        """Wait for every (work, what) in `works`, in order, in the helper thread."""
        self.submit(works).wait(failed, poll, timeout)

    def replace(self, work) -> None:
        GRAVEYARD.append((self.thread, work))
        self._start()


_local = threading.local()


def _waiter() -> _Waiter:
    if not hasattr(_local, "waiter"):
        _local.waiter = _Waiter()
    return _local.waiter


def hand_off(works: list[tuple[Any, str]]) -> Ticket:
    """Start waiting for gloo works in this thread's helper now; `Ticket.wait` collects them later.

    A receive posted and handed off ahead of its use completes while the caller computes: gloo moves
    the data as soon as the peer sends it, and the caller's wait finds it done (no thread hand-off on
    the critical path). CPU only: NCCL works are polled (`wait`). The works are waited in the order
    handed off, so hand them off in the order they will be needed."""
    return _waiter().submit(works)


def wait_collective(work, failed: threading.Event | None, poll: float, timeout: float, what: str) -> None:
    """Wait for a collective inside a forward or backward (tensor parallelism) by polling its completion.

    Never through the helper thread: its queue may hold receives posted ahead (`hand_off`) that complete
    only after this very computation, which would deadlock. Polls at least every millisecond: these
    all-reduces sit on the critical path."""
    _poll_completion(work, failed, min(poll, 1e-3), timeout, what)


def _poll_completion(work, failed: threading.Event | None, poll: float, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    pause = 20e-6  # short first: most waits end within microseconds on a GPU
    try:
        while not work.is_completed():
            if failed is not None and failed.is_set():
                GRAVEYARD.append(work)
                raise Interrupted(f"interrupted while waiting for {what}")
            if time.monotonic() > deadline:
                GRAVEYARD.append(work)
                raise CommError(f"{what}: no completion within {timeout:.0f} s")
            time.sleep(pause)
            pause = min(poll, pause * 2)
        work.wait()  # surfaces the work's error, if any, and orders the current stream after it
    except (Interrupted, CommError):
        raise
    except RuntimeError as error:
        raise CommError(f"{what}: {error}") from error

"""The virtual device's scheduler: a discrete-event simulator with O(log n) work per event.

A pure core: no lock, no clock, no handles. The caller says what time it is (``advance``) and
what is submitted (``submit``); the scheduler keeps every item's state and the timeline.

The rules (docs/design.md, section 5):

- An item becomes ready when everything it waits for has completed: the previous item of its
  stream and the events its stream waits on. Completions count their dependents down, so
  nothing is scanned to find what became ready.
- A marker (record, wait capture) completes the moment it is ready, taking no slot.
- An operation, once ready, waits in its engine's ready queue, ordered by (stream priority,
  ready time, submission time, device, stream id, submission order), and starts when a slot is
  free and the engine is not stalled. Operations submitted at one instant thus go in stream
  order, whichever task submitted first.
- Running operations wait in one completion heap ordered by (end, device, stream id,
  submission order); operations that end at one instant complete in that order, then what
  they made ready starts.
- Starts made at an instant are provisional while the clock stays there: an operation
  submitted at that same instant and ready at once takes part in the decision again, as if it
  had been there first (nothing observable happens in zero time). Zero-length operations are
  not reopened: they have already completed.
- A failed operation fails its device: everything unfinished on it ends at that instant,
  aborted, and the device runs nothing more (errors are sticky, as CUDA's are per context).

Each submission, start and completion costs O(log n) in the number of items in flight; a
completion also visits the items it makes ready.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from ..._check import MAX_SECONDS
from .model import DONE, PENDING, RUNNING, Device, Engine, Failure, Item, Op, OpRecord, Stream

__all__ = ["TIMELINE_LIMIT", "Launch", "Scheduler", "Shape"]

_MAX_NS = round(MAX_SECONDS * 1e9)

#: The timeline keeps the last this many completed operations.
TIMELINE_LIMIT = 100_000

# A timeline entry: (start, device, stream id, seq, name, engine, submitted, end, error); an
# OpRecord is made only when someone reads the timeline. Entries sort by their first four
# items alone: no two share a seq, so a comparison never reaches the name or the error.
_Entry = tuple[int, int, int, int, str, str, int, int, "str | None"]


class Scheduler:
    """Moves the items of a set of devices through their states, in time order."""

    def __init__(self, devices: list[Device], t: int) -> None:
        self.devices = devices
        self.t = t  # the instant processed last; never goes back
        self.pending_ops = 0  # operations submitted and not completed
        # The completion heap: (end, device, stream id, seq, token, item); entries whose token
        # is no longer the item's (restarted or aborted) are stale and skipped. Read without
        # the lock by the facade's fast paths (VirtualBackend._settled).
        self.running: list[tuple[int, int, int, int, int, Item]] = []
        self._dirty: list[Engine] = []  # engines that may be able to start something
        self._seq = itertools.count(1)
        self._timeline: deque[_Entry] = deque(maxlen=TIMELINE_LIMIT)
        # When all the work submitted so far has ended, at the latest: as if every operation
        # ran after the others. Work that could end past what a device clock holds is refused
        # at its submission, rather than failing the waits once the clock gets there.
        self.horizon = t

    # ------------------------------------------------------------------ time

    def advance(self, now: int) -> None:
        """Process, in time order, every completion due by ``now``, and what it starts."""
        running = self.running
        while True:
            if self._dirty:
                self._dispatch(self.t)
            end = self.next_end()
            if end is None or end > now:
                break
            self.t = end
            while running and running[0][0] == end:
                _, _, _, _, token, item = heapq.heappop(running)
                if item.token == token and item.state == RUNNING:
                    self._finish(item)
        if now > self.t:  # pragma: no mutate (equivalent: when equal, t keeps its value)
            self.t = now

    def next_end(self) -> int | None:
        """The end of the next running operation, or None when nothing runs."""
        running = self.running
        while running:
            top = running[0]
            item = top[5]
            if item.token == top[4] and item.state == RUNNING:
                return top[0]
            heapq.heappop(running)  # stale: restarted or aborted since
        return None

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        stream: Stream,
        duration: int,
        engine: str | None,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> Item:
        """Submit an operation on ``engine`` (or a marker, ``engine`` None) at instant ``t``.

        Call :meth:`advance` to the present first. The device must not have failed.
        """
        t = self.t
        device = stream.device
        eng = None
        if engine is not None:
            eng = device.engines[engine]
            self._extend(t, duration + max(eng.launch, eng.gap))
            if device.faults:
                duration, error = _apply_faults(device, stream, engine, duration, error)
            self.pending_ops += 1
        item = Item(next(self._seq), stream, t, duration, eng, fn, error, name)
        device.live[item] = None
        if not _after_stream(stream, item, item):  # ready now
            if eng is None:
                item.start = item.end = t
                self._done(item)
            else:
                heapq.heappush(eng.ready, item.key())
        if eng is not None:  # (advance left no engine marked; this starts on its own)
            self._start_ready(eng, t)
            self._reopen(eng, t)
        return item

    def launch(self, stream: Stream, shape: Shape, streams: Sequence[Stream]) -> Item:
        """Launch a graph on ``stream`` at instant ``t``: its nodes (``shape``) run after the
        work submitted to ``stream`` so far (and whatever its ``waits`` hold), each after the
        nodes it depends on, on ``streams[member]``; the stream's next work waits for them
        all. The marker that completes with the launch, returned, is the stream's ``last``.

        A node becomes an item only once it is ready (its dependencies complete, in the
        simulation's own time): a launch costs the host one marker and the roots, whatever
        the graph's size, as a graph launch is one call on a GPU. Its operations count as
        pending from the launch. Call :meth:`advance` to the present first. The device must
        not have failed.
        """
        t = self.t
        device = stream.device
        cost = 0
        for op, member in zip(shape.ops, shape.members, strict=True):
            eng = streams[member].device.engines[op.engine]
            cost += op.duration + max(eng.launch, eng.gap)
        self._extend(t, cost)
        run = Launch(shape, streams, t)
        start = Item(next(self._seq), stream, t, 0, None, None, None, "launch")
        end = Item(next(self._seq), stream, t, 0, None, None, None, "replay")
        device.live[start] = device.live[end] = None
        start.dependents = [(run, j) for j in shape.roots]
        run.end = end
        end.deps_left = len(shape.tails)
        if not shape.tails:  # no node: the launch ends as it starts
            start.dependents.append(end)
            end.deps_left = 1
        self.pending_ops += len(shape.ops)
        if not _after_stream(stream, start, end):
            start.start = start.end = t
            self._done(start)
            dirty, self._dirty = self._dirty, []  # what the roots made busy: decided now
            for engine in dirty:
                engine.dirty = False
                self._start_ready(engine, t)
                self._reopen(engine, t)
        return end

    def _extend(self, t: int, cost: int) -> None:
        """Count ``cost`` more ns of work submitted at ``t``; refuse it (ValueError) if the
        work submitted so far could then end past what a device clock holds."""
        horizon = max(self.horizon, t) + cost
        if horizon > _MAX_NS:
            raise ValueError(
                f"the work submitted to the virtual devices could take them to "
                f"t={horizon / 1e9:g} s, past the {MAX_SECONDS:g} s (292 years) a device "
                "clock holds; submit less device time (a profile's figures count: its "
                "launch overhead and copy speeds)"
            )
        self.horizon = horizon

    def _make(self, run: Launch, j: int) -> None:
        """Node ``j`` of ``run`` is ready: make it an item, ready for its engine."""
        shape = run.shape
        stream = run.streams[shape.members[j]]
        device = stream.device
        if device.failure is not None:  # aborted with the device: never made, never run
            if run.made >= 0:
                self.pending_ops -= len(shape.ops) - run.made
                run.made = -1
            return
        op = shape.ops[j]
        eng = device.engines[op.engine]
        duration, error = op.duration, op.error
        if device.faults:
            duration, error = _apply_faults(device, stream, op.engine, duration, error)
        item = Item(next(self._seq), stream, run.t, duration, eng, op.fn, error, op.name)
        item.ready = run.ready[j]
        device.live[item] = None
        run.made += 1
        after = shape.successors[j]
        item.dependents = [(run, k) for k in after] if after else [run.end]
        heapq.heappush(eng.ready, item.key())
        self._mark(eng)
        if op.attach is not None:
            op.attach(item)

    def wait_event(self, stream: Stream, item: Item | None) -> None:
        """Make the next item on ``stream`` wait for ``item`` (an event's record)."""
        if item is not None and item.state != DONE:
            stream.waits.append(item)

    # ------------------------------------------------------------------ starts

    def _reopen(self, engine: Engine, t: int) -> None:
        """Decide again the starts made on ``engine`` at instant ``t``, with what is ready now.

        While the best operation waiting for the engine goes before the worst one started at
        ``t``, they trade places: the result is the best ``slots`` of both, as if everything
        had been there when the instant's first decision was made. A stalled engine keeps
        what it started.
        """
        if engine.provisional_t != t or engine.stalled:
            return
        started, ready = engine.provisional, engine.ready
        while started and ready:
            worst = started[0][-1]
            if worst.state != RUNNING:  # aborted since
                heapq.heappop(started)
                continue
            if ready[0] >= worst.key():
                break
            best = heapq.heappop(ready)[-1]
            heapq.heappop(started)
            worst.state = PENDING
            worst.start = worst.end = -1
            worst.token += 1  # its completion entry is stale now
            engine.busy -= 1
            heapq.heappush(ready, worst.key())
            self._start(best, engine, t)

    def set_stalled(self, engine: Engine, stalled: bool) -> None:
        """Hold one more stall on ``engine`` (or release one): it starts no operation while
        any is held; running ones go on."""
        engine.stalled += 1 if stalled else -1
        assert engine.stalled >= 0, "a stall released twice"
        self._mark(engine)

    def _mark(self, engine: Engine) -> None:
        if not engine.dirty:
            engine.dirty = True
            self._dirty.append(engine)

    def _dispatch(self, t: int) -> None:
        """Start, at ``t``, what the engines marked dirty can start."""
        dirty, self._dirty = self._dirty, []
        for engine in dirty:
            engine.dirty = False
            self._start_ready(engine, t)

    def _start_ready(self, engine: Engine, t: int) -> None:
        """Fill the free slots of ``engine`` from its ready queue, best first."""
        if engine.stalled:
            return
        ready = engine.ready
        while ready and engine.busy < engine.slots:
            item = heapq.heappop(ready)[-1]
            if item.state == PENDING:  # else aborted while it waited
                self._start(item, engine, t)

    def _start(self, item: Item, engine: Engine, t: int) -> None:
        engine.busy += 1
        item.state = RUNNING
        start = t
        if engine.launch or engine.gap:  # a profile's launch overhead, with the slot held
            start += max(engine.gap, item.submit + engine.launch - t)
        item.start = start
        item.end = end = start + item.duration
        item.token += 1
        heapq.heappush(
            self.running, (end, item.device.index, item.stream.id, item.seq, item.token, item)
        )
        if end > t:  # provisional while the clock stays at t (see _reopen)
            if engine.provisional_t != t:
                engine.provisional_t = t
                engine.provisional = []
            heapq.heappush(engine.provisional, _reversed_key(item))
        if item.on_start is not None:
            item.on_start()

    # ------------------------------------------------------------------ the core

    def _finish(self, item: Item) -> None:
        """A running operation reached its end."""
        engine = item.engine
        assert engine is not None
        engine.busy -= 1
        self._mark(engine)
        fn, item.fn = item.fn, None
        cause: BaseException | None = None
        if fn is not None and item.error is None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - it fails the device, as CUDA's would
                cause = exc
                item.error = f"its host function raised {type(exc).__name__}: {exc}"
        self._record(item)
        if item.error is not None:
            device = item.device
            self._done(item)
            if device.failure is None:
                device.failure = Failure(
                    device.name,
                    f"{device.name}: operation {item.name!r} on stream {item.stream.id} "
                    f"failed at t={item.end / 1e9:.9f}s: {item.error}",
                    cause,
                )
                self._abort(device, item.end)
            if cause is not None and not isinstance(cause, Exception):
                raise cause  # KeyboardInterrupt, SystemExit: the device is consistent first
            return
        self._done(item)

    def _record(self, item: Item) -> None:
        self.pending_ops -= 1
        self._timeline.append(
            (
                item.start,
                item.device.index,
                item.stream.id,
                item.seq,
                item.name,
                item.engine.name,  # type: ignore[union-attr]
                item.submit,
                item.end,
                item.error,
            )
        )

    def _done(self, first: Item) -> None:
        """``first`` completed (its end set): complete what that makes ready, in turn."""
        todo = [first]
        while todo:
            item = todo.pop()
            item.state = DONE
            item.fn = None
            item.on_start = None
            del item.device.live[item]
            watchers, item.watchers = item.watchers, None
            if watchers is not None:
                for watcher in watchers:
                    watcher()
            dependents, item.dependents = item.dependents, None
            if dependents is None:
                continue
            end = item.end
            for dep in dependents:
                if type(dep) is tuple:  # a node of a launch, made an item once ready
                    run, j = dep
                    if run.counted(j, end):
                        self._make(run, j)
                    continue
                if dep.state != PENDING:  # aborted meanwhile
                    continue
                if end > dep.ready:
                    dep.ready = end
                dep.deps_left -= 1
                if dep.deps_left:
                    continue
                engine = dep.engine
                if engine is None:  # a marker completes once ready
                    dep.start = dep.end = dep.ready
                    todo.append(dep)
                else:
                    heapq.heappush(engine.ready, dep.key())
                    self._mark(engine)

    def _abort(self, device: Device, t: int) -> None:
        """A failed device runs nothing more: end its unfinished work at ``t``, as aborted."""
        device.faults.clear()
        aborted = list(device.live)  # in submission order
        for engine in device.engines.values():
            engine.ready.clear()
            engine.provisional.clear()
            engine.busy = 0
        for item in aborted:  # all done first, so that none of them is started by another
            if item.state != RUNNING or item.start > t:  # not started, or in its launch lead
                item.start = t
            item.state = DONE
            item.end = t
        for item in aborted:
            if item.engine is not None:
                item.error = "aborted: the device had failed"
                self._record(item)
            self._done(item)  # and what waits on it, on other devices too

    # ------------------------------------------------------------------ inspection

    def timeline(self) -> list[OpRecord]:
        """The completed operations (up to the last 100,000), by start, device, stream, seq."""
        return [
            OpRecord(
                name=name,
                device=dev,
                stream=sid,
                engine=engine,
                submitted=submitted / 1e9,
                start=start / 1e9,
                end=end / 1e9,
                error=error,
            )
            for start, dev, sid, _, name, engine, submitted, end, error in sorted(self._timeline)
        ]

    def unfinished_ops(self) -> Iterator[Item]:
        """Operations submitted and not completed, in submission order."""
        items = [i for d in self.devices for i in d.live if i.engine is not None]
        return iter(sorted(items, key=_by_seq))


def _apply_faults(
    device: Device, stream: Stream, engine: str, duration: int, error: str | None
) -> tuple[int, str | None]:
    faults = device.faults
    for fault in faults:
        if fault.matches(stream, engine):
            fault.remaining -= 1
            if fault.message is not None and error is None:
                error = fault.message
            if fault.factor is not None:  # at most what the clock can hold: 292 years
                duration = round(min(duration * fault.factor, _MAX_NS))
    faults[:] = [f for f in faults if f.remaining > 0]
    return duration, error


def _reversed_key(item: Item) -> tuple[int, int, int, int, int, int, Item]:
    """A key whose heap gives the operation that goes last first."""
    return (
        -item.stream.priority,
        -item.ready,
        -item.submit,
        -item.device.index,
        -item.stream.id,
        -item.seq,
        item,
    )


def _by_seq(item: Item) -> int:
    return item.seq


class Shape:
    """What a graph's launch needs of it: each node's operation and captured stream, how many
    nodes it waits for, which wait for it, and the nodes none waits for (its tails)."""

    __slots__ = ("indegree", "members", "ops", "roots", "successors", "tails")

    def __init__(self, nodes: Sequence[tuple[int, tuple[int, ...], Op]]) -> None:
        self.ops = [op for _, _, op in nodes]
        self.members = [member for member, _, _ in nodes]
        # a root waits for one thing: the launch's start marker
        self.indegree = [len(deps) or 1 for _, deps, _ in nodes]
        self.successors: list[list[int]] = [[] for _ in nodes]
        for j, (_, deps, _) in enumerate(nodes):
            for d in deps:
                self.successors[d].append(j)
        self.roots = [j for j, (_, deps, _) in enumerate(nodes) if not deps]
        self.tails = [j for j, after in enumerate(self.successors) if not after]


class Launch:
    """One launch of a graph: its nodes' counts of what they still wait for, and each made an
    item once that count reaches zero."""

    __slots__ = ("end", "left", "made", "ready", "shape", "streams", "t")

    def __init__(self, shape: Shape, streams: Sequence[Stream], t: int) -> None:
        self.shape = shape
        self.streams = streams
        self.t = t
        self.left = list(shape.indegree)
        self.ready = [t] * len(shape.ops)
        self.made = 0  # nodes made items so far; -1 once the launch was aborted
        self.end: Item | None = None  # the marker that completes with the launch

    def counted(self, j: int, end: int) -> bool:
        """What node ``j`` waits for completed at ``end``: whether it is ready now."""
        if end > self.ready[j]:
            self.ready[j] = end
        self.left[j] -= 1
        return not self.left[j]


def _after_stream(stream: Stream, item: Item, last: Item) -> bool:
    """Make ``item`` wait for the work ``stream`` holds (what it was made to wait for, and its
    last item), and ``last`` the stream's last item: whether ``item`` has anything to wait
    for (if not, it is ready now)."""
    deps = [d for d in stream.waits if d.state != DONE]
    stream.waits = []
    if stream.last is not None and stream.last.state != DONE:
        deps.append(stream.last)
    stream.last = last
    if not deps:
        return False
    item.deps_left = len(deps)
    for dep in deps:
        if dep.dependents is None:
            dep.dependents = [item]
        else:
            dep.dependents.append(item)
    return True

"""The virtual device's scheduler, alone: against a small reference on random programs.

The reference below follows docs/design.md section 5 as literally as it can, scanning everything at
every step; the scheduler does the same with dependency counting, ready queues and one
completion heap. Hypothesis generates programs of streams (with priorities), operations on
engines with slots, event records and waits, stalls, faults and clock advances, and every item's
state and times, and the timeline, must agree after every step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiostream._backends.virtual.model import (
    DONE,
    ENGINES,
    PENDING,
    RUNNING,
    Device,
    Fault,
    Item,
    Stream,
)
from aiostream._backends.virtual.scheduler import Scheduler
from tests.helpers import lanes

# ---------------------------------------------------------------------- the reference


@dataclass(eq=False)
class RItem:
    seq: int
    dev: int
    sid: int
    prio: int
    engine: str | None
    duration: int
    submit: int
    error: str | None
    name: str
    deps: list[RItem]
    state: int = PENDING
    start: int = -1
    end: int = -1
    taken: int = -1  # when it took its engine's slot (its start, but for a launch overhead)

    def ready(self) -> int:
        return max([self.submit] + [d.end for d in self.deps])


@dataclass
class RStream:
    dev: int
    sid: int
    prio: int
    last: RItem | None = None
    waits: list[RItem] = field(default_factory=list)


class Reference:
    """Every rule applied by scanning every item: slow, and plain to check by eye."""

    def __init__(self, devices: int, slots: dict[str, int], lead: tuple[int, int]) -> None:
        self.slots = slots
        self.launch, self.gap = lead  # the compute engine's (a device profile's)
        self.items: list[RItem] = []
        self.t = 0
        self.stalled: Counter[tuple[int, str]] = Counter()  # stalls held, per engine
        self.failed: dict[int, bool] = {d: False for d in range(devices)}
        self.faults: dict[int, list[list[object]]] = {d: [] for d in range(devices)}
        self.timeline: list[tuple[object, ...]] = []

    def _busy(self, dev: int, engine: str) -> int:
        return sum(
            1 for i in self.items if i.state == RUNNING and i.dev == dev and i.engine == engine
        )

    def _decide(self, t: int) -> None:
        """At instant t: complete ready markers, start ready operations by their order."""
        while True:
            changed = False
            for i in self.items:
                if i.state == PENDING and i.engine is None and all(d.state == DONE for d in i.deps):
                    i.state, i.start, i.end = DONE, i.ready(), i.ready()
                    changed = True
            ready = [
                i
                for i in self.items
                if i.state == PENDING
                and i.engine is not None
                and all(d.state == DONE for d in i.deps)
                and not self.stalled[(i.dev, i.engine)]
            ]
            ready.sort(key=lambda i: (i.prio, i.ready(), i.submit, i.dev, i.sid, i.seq))
            for i in ready:
                if self._busy(i.dev, i.engine) < self.slots[i.engine]:  # type: ignore[index]
                    # a compute operation starts launch after its submission, gap after its
                    # slot was taken, whichever is later
                    lead = max(self.gap, i.submit + self.launch - t) if i.engine == "compute" else 0
                    i.state, i.taken, i.start = RUNNING, t, t + lead
                    i.end = i.start + i.duration
                    changed = True
            if not changed:
                return

    def advance(self, now: int) -> None:
        while True:
            self._decide(self.t)
            ends = [i.end for i in self.items if i.state == RUNNING]
            if not ends or min(ends) > now:
                break
            self.t = min(ends)
            due = [i for i in self.items if i.state == RUNNING and i.end == self.t]
            for i in sorted(due, key=lambda i: (i.dev, i.sid, i.seq)):
                if i.state != RUNNING:  # aborted by an earlier failure at this instant
                    continue
                i.state = DONE
                self._record(i)
                if i.error is not None and not self.failed[i.dev]:
                    self.failed[i.dev] = True
                    self._abort(i.dev, self.t)
        self.t = max(self.t, now)

    def _abort(self, dev: int, t: int) -> None:
        self.faults[dev] = []
        for i in self.items:
            if i.dev == dev and i.state != DONE:
                if i.state == PENDING or i.start > t:  # not started, or still in its lead
                    i.start = t
                i.state, i.end = DONE, t
                if i.engine is not None:
                    i.error = "aborted: the device had failed"
                    self._record(i)

    def _record(self, i: RItem) -> None:
        self.timeline.append(
            (i.start, i.dev, i.sid, i.seq, i.name, i.engine, i.submit, i.end, i.error)
        )

    def submit(
        self, s: RStream, duration: int, engine: str | None, error: str | None, name: str
    ) -> RItem:
        t = self.t
        if engine is not None:
            for fault in self.faults[s.dev]:
                stream, eng, _, message, factor = fault
                if (stream is None or stream is s) and (eng is None or eng == engine):
                    fault[2] -= 1  # type: ignore[operator]
                    if message is not None and error is None:
                        error = message  # type: ignore[assignment]
                    if factor is not None:
                        duration = round(duration * factor)  # type: ignore[operator]
            self.faults[s.dev] = [f for f in self.faults[s.dev] if f[2] > 0]  # type: ignore[operator]
            if not self.stalled[(s.dev, engine)]:  # the instant's starts are decided again
                for i in self.items:
                    if (
                        i.state == RUNNING
                        and i.dev == s.dev
                        and i.engine == engine
                        and i.taken == t
                        and i.end > t
                    ):
                        i.state, i.start, i.end, i.taken = PENDING, -1, -1, -1
        deps = [d for d in s.waits if d.state != DONE]
        if s.last is not None and s.last.state != DONE:
            deps.append(s.last)
        s.waits = []
        item = RItem(
            len(self.items) + 1, s.dev, s.sid, s.prio, engine, duration, t, error, name, deps
        )
        self.items.append(item)
        s.last = item
        self._decide(t)
        return item


# ---------------------------------------------------------------------- random programs

durations = st.sampled_from([0, 1, 2, 3, 5, 8])
op = st.tuples(st.just("op"), st.integers(0, 5), st.sampled_from(ENGINES), durations, st.booleans())
step = st.one_of(
    op,
    op,  # operations are what the scheduler is about: draw them most often
    op,
    st.tuples(st.just("record"), st.integers(0, 5), st.integers(0, 2)),
    st.tuples(st.just("wait"), st.integers(0, 5), st.integers(0, 2)),
    st.tuples(st.just("advance"), st.sampled_from([0, 1, 2, 3, 7])),
    st.tuples(st.just("stall"), st.integers(0, 1), st.sampled_from(ENGINES), st.booleans()),
    st.tuples(
        st.just("fault"),
        st.integers(0, 1),
        st.one_of(st.none(), st.integers(0, 5)),
        st.one_of(st.none(), st.sampled_from(ENGINES)),
        st.integers(1, 2),
        st.booleans(),
    ),
)
program = st.tuples(
    st.integers(1, 2),  # devices
    st.fixed_dictionaries({e: st.integers(1, 3) for e in ENGINES}),  # slots
    st.lists(st.sampled_from([0, -1, -2]), min_size=1, max_size=6),  # stream priorities
    st.lists(step, min_size=8, max_size=40),
    # the compute engine's launch overhead and gap (a device profile's); none most often
    st.one_of(st.just((0, 0)), st.tuples(st.integers(0, 3), st.integers(0, 2))),
)


def _state(item: Item | RItem) -> tuple[int, int, int]:
    return (item.state, item.start, item.end) if item.state != PENDING else (PENDING, -1, -1)


@settings(
    max_examples=lanes.examples(1000),
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(program)
@example(  # a stalled engine keeps what it started, even when better work comes at that instant
    (
        1,
        {"compute": 1, "h2d": 1, "d2h": 1},
        [0, -1],
        [
            ("op", 0, "compute", 5, False),
            ("stall", 0, "compute", True),
            ("op", 1, "compute", 5, False),
            ("advance", 7),
            ("stall", 0, "compute", False),
            ("advance", 7),
        ],
        (0, 0),
    )
)
@example(  # waiting work goes by ready time, not by submission time
    (
        1,
        {"compute": 1, "h2d": 1, "d2h": 1},
        [0, 0, 0],
        [
            ("op", 0, "compute", 8, False),  # holds the engine until 8
            ("op", 1, "h2d", 5, False),
            ("op", 1, "compute", 1, False),  # submitted first, ready at 5
            ("op", 2, "d2h", 2, False),
            ("op", 2, "compute", 1, False),  # submitted later, but ready at 2
            ("advance", 20),
        ],
        (0, 0),
    )
)
def test_scheduler_agrees_with_the_reference(prog: tuple[object, ...]) -> None:
    n_devices, slots, priorities, steps, lead = prog  # type: ignore[misc]
    devices = [Device(d, slots, lead) for d in range(n_devices)]
    sched = Scheduler(devices, 0)
    ref = Reference(n_devices, slots, lead)
    # streams spread over the devices; the reference keeps its own twins
    streams = [
        Stream(devices[i % n_devices], i // n_devices + 1, p) for i, p in enumerate(priorities)
    ]
    rstreams = [RStream(s.device.index, s.id, s.priority) for s in streams]
    events: dict[int, tuple[Item, RItem]] = {}
    pairs: list[tuple[Item, RItem]] = []
    now = 0
    for number, action in enumerate(steps):
        kind = action[0]
        if kind == "advance":
            now += action[1]
            sched.advance(now)
            ref.advance(now)
        elif kind == "stall":
            _, d, engine, stalled = action
            if d < n_devices and (stalled or ref.stalled[(d, engine)]):  # stalls nest
                sched.set_stalled(devices[d].engines[engine], stalled)
                ref.stalled[(d, engine)] += 1 if stalled else -1
                sched.advance(now)
                ref.advance(now)
        elif kind == "fault":
            _, d, si, engine, count, fail = action
            if d < n_devices and not ref.failed[d]:
                s = streams[si % len(streams)] if si is not None else None
                if s is not None and s.device.index != d:
                    s = None
                rs = rstreams[streams.index(s)] if s is not None else None
                message, factor = ("injected", None) if fail else (None, 2.0)
                devices[d].faults.append(Fault(s, engine, count, message, factor))
                ref.faults[d].append([rs, engine, count, message, factor])
        else:
            si = action[1] % len(streams)
            s, rs = streams[si], rstreams[si]
            if ref.failed[rs.dev]:
                continue  # the facade refuses work on a failed device
            sched.advance(now)
            ref.advance(now)
            if kind == "op":
                _, _, engine, duration, fail = action
                error = "boom" if fail and duration % 2 else None  # a few fail
                name = f"op{number}"
                pairs.append(
                    (
                        sched.submit(s, duration, engine, None, error, name),
                        ref.submit(rs, duration, engine, error, name),
                    )
                )
            elif kind == "record":
                pair = (
                    sched.submit(s, 0, None, None, None, "record"),
                    ref.submit(rs, 0, None, None, "record"),
                )
                events[action[2]] = pair
                pairs.append(pair)
            else:  # wait
                pair = events.get(action[2])
                if pair is not None:
                    sched.wait_event(s, pair[0])
                    if pair[1].state != DONE:
                        rs.waits.append(pair[1])
        for ours, theirs in pairs:
            assert _state(ours) == _state(theirs), (number, action, ours.name)
    sched.advance(now + 10_000)
    ref.advance(now + 10_000)
    for ours, theirs in pairs:
        assert _state(ours) == _state(theirs)
    expected = [
        (start / 1e9, dev, sid, name, engine, submitted / 1e9, end / 1e9, error)
        for start, dev, sid, _, name, engine, submitted, end, error in sorted(
            ref.timeline, key=lambda r: r[:4]
        )
    ]
    got = [
        (r.start, r.device, r.stream, r.name, r.engine, r.submitted, r.end, r.error)
        for r in sched.timeline()
    ]
    assert got == expected
    assert sched.pending_ops == sum(
        1 for i in ref.items if i.engine is not None and i.state != DONE
    )

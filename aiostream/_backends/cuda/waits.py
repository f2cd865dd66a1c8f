"""Captures on the CUDA backend: what a wait waits for, fixed when it starts.

- A stream's capture is the work submitted to it so far: a mark on the stream (see
  :mod:`.watcher`).
- Every record of an aiostream event puts a mark right after the record, which the event
  holds until it is recorded again or destroyed: an event's capture is the mark of its last
  record, however much work was submitted after it. An await that began before a re-record
  keeps the mark it took, so it still waits for the work captured when it began.
- An event whose handle is out (another library's, wrapped with ``as_event``; or one of
  aiostream's once ``event_id`` or ``ipc_handle`` handed it out, or opened from another
  process's handle) may be recorded by others unseen: it is queried itself, and a wait on it
  follows its latest record, whoever made it. Its records here take no mark.

With ``wake`` (the ``hybrid`` and ``callback`` strategies) a host function after the mark
announces it, launched when the wait is handed to the watcher (``Target.watch``: at once for
``callback``, after the loop's check budget for ``hybrid``, so that short waits cost the
stream nothing), and only while nothing of the user's was submitted to the stream after the
mark: a host function placed later would wait for that later work too. On a stream whose
handle was handed out, others may submit unseen: a stream capture's host function is launched
at once there, right before its mark (so that a stream told complete has no host function of
aiostream's left queued, and ``cuStreamQuery`` agrees), and an event's never. Other waits are polled
by the watcher, from the flags, with a back-off.

Once a wait a host function announced has ended, its stream (``idle``), and an event recorded on
it since with no work of the user's in between (``query``), are complete, though the driver may
still be running the host function, which the stream and the record follow on the device.
"""

from __future__ import annotations

from ..._errors import AiostreamError, NotReadyError, captured_event, capturing_stream
from .devices import Devices
from .driver import NOT_READY, SUCCESS, Driver
from .handles import FOREIGN, Event, Stream, describe_event, describe_stream
from .watcher import CLOSED, Mark, Target

__all__ = ["Target", "Waits"]

#: cuStreamIsCapturing's answers: CU_STREAM_CAPTURE_STATUS_NONE, and the legacy stream's
#: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (a blocking stream of its context is capturing)
_NOT_CAPTURING = 0
_IMPLICIT = 906


class Waits:
    """Captures of streams and events, and marks at event records, for every device of one
    backend."""

    def __init__(self, drv: Driver, devices: Devices) -> None:
        self.drv = drv
        self.devices = devices

    def capture_of(self, stream: Stream) -> object:
        """The capture ``stream`` is part of: aiostream's (``graphs.Capture``), another
        library's (``FOREIGN``: the driver is asked, only for a stream whose handle is
        out, since no one else can capture a private one), or None."""
        if stream.capture is not None:
            return stream.capture
        if not stream.private and self.is_capturing(stream):
            return FOREIGN
        return None

    def check_not_capturing(self, stream: Stream) -> None:
        """Raise if ``stream`` is capturing, before any call of aiostream's could add to the
        capture or break it."""
        if self.capture_of(stream) is not None:
            raise capturing_stream(describe_stream(stream))

    def is_capturing(self, stream: Stream) -> bool:
        """``cuStreamIsCapturing``: a capture is under way on ``stream`` (or invalidated and
        not yet ended), or, for the legacy stream, on a blocking stream of its context."""
        with self.devices[stream.index].pushed:
            err, status = self.drv.cu.cuStreamIsCapturing(stream.ptr)
        if int(err) == _IMPLICIT:
            return True
        # another error (a failed device's, sticky) is raised by the call that follows
        return int(err) == SUCCESS and int(status) != _NOT_CAPTURING

    def stream_target(self, stream: Stream, wake: bool) -> Target:
        dev = self.devices[stream.index]
        self.check_not_capturing(stream)
        target = Target(dev.watcher, stream.key, next(stream.seq))
        with dev.lock:
            # on a stream handed out, others may submit unseen: announced now or never
            target.mark = dev.watcher.mark(stream.ptr, wake and not stream.private)
            _reaching(stream, target.mark)
            if wake and stream.private:  # announced once watched (Watcher.announce)
                target.stream, target.at = stream, stream.ops
        return target

    def idle(self, stream: Stream) -> bool:
        """Whether everything on ``stream`` but aiostream's own has completed, when
        ``cuStreamQuery`` says it is busy: an awaited stream is done once the work before its
        mark is, and the ``sem_post`` after it, which announces the mark, is no work of the
        user's; and a stream whose last work is an event's record, then aiostream's mark
        after it, is idle once that event has completed (the mark is no work of the user's
        either), or once an event recorded after all of the user's work was seen complete
        (``query``: a later record of no more work, still to be reached, is complete too)."""
        return (
            self._reached(stream, stream.ops)
            or self._announced(stream, stream.ops)
            or self._recorded_last(stream)
        )

    def _recorded_last(self, stream: Stream) -> bool:
        dev = self.devices[stream.index]
        with dev.lock:  # a record from another thread may let the kept event go meanwhile
            recorded = stream.recorded
            if recorded is None or not stream.private:
                return False
            event, at = recorded
            if at != stream.ops or not (event.alive or event.kept) or event.at != at:
                return False  # the user's work followed, or the event moved since
            return event.stream is stream and dev.watcher.query(event.ptr)

    def keep_recorded(self, event: Event) -> bool:
        """``event`` is released by the program (lock held): keep its handle if it is its
        stream's last record, which the stream's idle check reads; True if kept. It is
        destroyed when the stream records again or goes, or at close."""
        stream = event.stream
        if stream is None or not (stream.alive and stream.owned and stream.private):
            return False  # only a private stream's idle check reads it
        recorded = stream.recorded
        if recorded is None or recorded[0] is not event or stream.doomed:
            return False
        event.kept = True
        self.devices[event.index].internal[event.ptr] = "event"
        return True

    def let_go(self, stream: Stream) -> None:
        """``stream`` records again or goes (lock held): destroy the event kept as its last
        record, if the program had released it."""
        recorded, stream.recorded = stream.recorded, None
        if recorded is not None and recorded[0].kept:
            event = recorded[0]
            event.kept = False
            dev = self.devices.by_index.get(event.index)
            if dev is not None and dev.internal.pop(event.ptr, None) is not None:
                dev.release(self.drv.cu.cuEventDestroy, event.ptr)

    def query(self, event: Event, quick: bool = False) -> bool:
        """Whether the work ``event`` captured has completed (raise if it failed): the driver's
        answer, or, where a record came after the host function announcing a mark of its
        private stream (it completes on the device only once the driver's thread has returned
        from that function), whether the user's work before that mark has. Not for an event
        whose handle was handed out: others may have recorded it since, unseen. ``quick``: the
        flag of the mark after its record answers, with no driver call (a failed device is
        told by the health check, at most a millisecond late)."""
        if event.captured is not None:
            raise captured_event(describe_event(event))
        watcher = self.devices[event.index].watcher
        stream = event.stream
        private = event.private and stream is not None and stream.private
        mark = event.mark
        if watcher.closed:  # its handle was destroyed: refused as the driver's query is
            raise AiostreamError(CLOSED)
        if quick and mark is not None and event.private and (mark.complete or mark.slot >= 0):
            # its mark's flag tells, with no driver call: the record completed right before it
            if watcher.reached(mark):
                if private and event.at > stream.done_at:  # type: ignore[union-attr]
                    stream.done_at = event.at  # type: ignore[union-attr]
                return True
            watcher.check()  # a failed device never writes it (at most a call a millisecond)
        elif watcher.query(event.ptr):
            if private and event.at > stream.done_at:  # type: ignore[union-attr]
                stream.done_at = event.at  # type: ignore[union-attr]
            return True
        if not (event.private and stream is not None):
            return False
        return (private and self._reached(stream, event.at)) or self._announced(stream, event.at)

    def _reached(self, stream: Stream, at: int) -> bool:
        """Whether the user's work submitted to the private ``stream`` before its ``at``-th
        operation is known complete: an event recorded after it was seen complete, or a mark
        made after it (``Stream.reach``) is reached, however late the device gets to the
        records made since."""
        if at <= stream.done_at:
            return True
        reach = stream.reach
        if reach is None or reach[1] < at or not stream.private:
            return False
        if self.devices[stream.index].watcher.reached(reach[0]):
            stream.done_at = max(stream.done_at, reach[1])
            return True
        return False

    def _announced(self, stream: Stream, at: int) -> bool:
        """Whether the work submitted to ``stream`` before its ``at``-th operation has
        completed, as the mark its announcing host function follows tells: False if the user
        submitted more before that mark, or if others may have submitted unseen."""
        woke = stream.woke
        if woke is None or stream.woke_at < at or not stream.private:
            return False
        return self.devices[stream.index].watcher.reached(woke)

    def elapsed_ms(self, start: Event, end: Event) -> float:
        """Milliseconds from ``start`` to ``end`` (``cuEventElapsedTime``)."""
        for event in (start, end):
            if event.captured is not None:
                raise captured_event(describe_event(event))
        cu, dev = self.drv.cu, self.devices[start.index]
        with dev.pushed:
            err, ms = cu.cuEventElapsedTime(start.ptr, end.ptr)
        if err == NOT_READY and self.query(start) and self.query(end):
            # complete but for a host function of aiostream's before them, ending: wait for it
            with dev.pushed:
                for event in (start, end):
                    self.drv.check(
                        cu.cuEventSynchronize(event.ptr), event.index, "cuEventSynchronize"
                    )
                err, ms = cu.cuEventElapsedTime(start.ptr, end.ptr)
        if err == NOT_READY:
            raise NotReadyError(
                "elapsed_time() needs both events complete; await synchronize() on the later one "
                "first"
            )
        if err != SUCCESS:
            raise self.drv.error(err, start.index, "cuEventElapsedTime")
        return float(ms)

    def record(self, event: Event, stream: Stream) -> None:
        """Record ``event`` on ``stream`` (``cuEventRecord``) and, unless its handle is out,
        mark the point right after it (the event holds the mark until its next record); note
        where it stands on the stream."""
        dev = self.devices[stream.index]
        with dev.lock, dev.pushed.around(stream.ptr):  # one push for the record and its mark
            # a record into another library's capture is a node of its graph: aiostream adds
            # nothing of its own there (its mark would be a node too, rewritten at each launch)
            captured = self.capture_of(stream)
            result = self.drv.cu.cuEventRecord(event.ptr, stream.ptr)
            self.drv.check(result, event.index, "cuEventRecord")
            old = event.mark
            event.mark = None
            event.captured = captured
            event.stream, event.at, event.seq = stream, stream.ops, next(stream.seq)
            if stream.capture is not None:
                stream.capture.recorded(event, stream)
            try:
                if dev.watcher.memops and event.private and captured is None:  # event_target
                    event.mark = dev.watcher.mark(stream.ptr, False)
                    _reaching(stream, event.mark)
                    if stream.recorded is None or stream.recorded[0] is not event:
                        dev.let_go_recorded(stream)
                    stream.recorded = (event, stream.ops)
            finally:
                if old is not None:
                    dev.watcher.unhold(old)

    def forget(self, event: Event) -> None:
        """``event`` is destroyed: it holds its mark no more."""
        dev = self.devices.by_index.get(event.index)
        if dev is None:
            return
        with dev.lock:
            if event.mark is not None:
                dev.watcher.unhold(event.mark)
                event.mark = None  # pragma: no mutate (equivalent: the event is retired next)

    def event_target(self, event: Event, wake: bool) -> Target:
        if event.captured is not None:
            raise captured_event(describe_event(event))
        dev = self.devices[event.index]
        watcher = dev.watcher
        with dev.lock:
            mark, stream = event.mark, event.stream
            if mark is None or stream is None or not event.private:
                # not recorded here, or its handle is out and others may record it unseen:
                # query the event itself, which follows its latest record, whoever made it
                target = Target(watcher, ("event", event.id), 0)
                target.event = event.ptr
                return target
            target = Target(watcher, stream.key, event.seq)  # (the stream's own tuple)
            target.mark = mark
            mark.holders += 1  # the wait holds it too (lock held)
            if wake and stream.private:  # announced once watched (Watcher.announce)
                target.stream, target.at = stream, event.at
        return target


def _reaching(stream: Stream, mark: Mark) -> None:
    """``mark`` was just made on ``stream``: the first since the user's last operation there
    stands for all of the user's work so far (``Stream.reach``)."""
    if stream.reach is None or stream.reach[1] != stream.ops:
        stream.reach = (mark, stream.ops)

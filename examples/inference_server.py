"""An async inference server: concurrent requests batched onto a device stream and awaited.

Each ``POST /infer`` request waits at most ``--max-wait-ms`` for others to join its batch (up to
``--max-batch``); the batch is copied to the device, run, copied back and awaited with
``await event.synchronize()``, which suspends the batch's task only: the loop keeps accepting
requests, filling the next batch, and answering ``/health`` meanwhile. Batches run on
``--lanes`` streams, each with its own buffers, so one batch fills while another runs.

The device part of the "model" is a timed stand-in, ``ais.delay(launch + n * per_item)``, that
leaves the data as it is: each reply carries its own request's row back through the device. On
a GPU, put your model's kernels on the lane's stream instead (PyTorch:
``torch.cuda.ExternalStream(lane.stream.__cuda_stream__()[1])``).

    python -m pip install ".[server]"   # from a checkout: aiostream-cuda is not on PyPI yet
    python examples/inference_server.py --device virtual:0 --port 8000
    curl -s localhost:8000/infer -d '{"x": [1, 2, 3, 4]}' -H 'content-type: application/json'

Endpoints: ``POST /infer`` ``{"x": [FEATURES floats]}`` -> ``{"y": [...], "batch": n}``;
``GET /health`` (503 once the device failed: device errors are sticky, so restart the process;
503 too for ``FAILING_S`` after a batch failed otherwise, unless one succeeds, and while the
oldest wait on the device is older than ``--stuck-after`` seconds, naming its stream: a hung
kernel; 200 again once it clears);
``GET /stats`` (served, dropped, abandoned, batches, queued, in flight, pending waits, the
device bound in requests/s); ``GET /metrics``: aiostream's Prometheus metrics
(``aiostream.metrics``: pending and stuck waits, wait latency, device errors, bytes copied),
where prometheus-client is installed. ``--otel-console`` prints OpenTelemetry spans: each
wait, and each batch's host and device time (``aiostream.tracing``). Each batch is a
``record_function`` region, which Nsight Systems shows as an NVTX range on CUDA. A full queue
answers 503; a malformed request (JSON nested too deeply or with an integer too long for
Python to read included), 422; a batch that failed, 500 naming the error. A request whose
client disconnects before its batch is launched is left out of it (``dropped``): nobody
computes it; once its batch is launched, the batch runs to its end and the reply is thrown
away (``abandoned``). On shutdown (SIGINT or SIGTERM) queued requests answer 503 at once and
only the batches already running finish; a second SIGINT answers those 503 too, without
waiting for the device.

Bad flags are usage errors (exit status 2) before the server listens: among them a full
batch's cost (``--launch-ms`` + ``--max-batch`` x ``--per-item-ms``) over ``MAX_BATCH_S``,
``--max-batch`` over ``MAX_BATCH``, ``--lanes`` over ``MAX_LANES``, and an address that cannot
be listened on (a port in use, an unknown ``--host``).

Limits: a number that is not finite as float32 (JSON ``NaN``, ``Infinity``, ``1e400``,
``"nan"``, ``3.5e38``) answers 422 naming its place in ``x``; a 422 shows at most
``ECHO_CHARS`` characters of each rejected input (marked ``"input_truncated": true``) and at
most ``MAX_ERRORS`` errors (``"errors_omitted": n``); a request body over ``--max-body-bytes``
(default 1 MiB) answers 413, refused by its Content-Length before it is read, or, streamed
without one, as soon as the bytes read pass the limit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel
from pydantic_core import PydanticCustomError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import aiostream as ais


@dataclass(frozen=True)
class Model:
    """What a batch costs on the device: a fixed launch plus a cost per item.

    The defaults (160 ms for a full batch of 32: a device bound of 200 requests/s) are a bound
    a laptop's HTTP stack can reach, so the example shows the device as the limit; a GPU
    model's figures go in ``--launch-ms`` and ``--per-item-ms``.
    """

    features: int = 4
    launch_s: float = 0.080
    per_item_s: float = 0.0025

    def cost(self, n: int) -> float:
        return self.launch_s + n * self.per_item_s

    def bound(self, max_batch: int) -> float:
        """Requests per second when every batch is full: the device's limit."""
        return max_batch / self.cost(max_batch)


#: how long /health says 503 after a batch failed for a reason not the device's, unless a
#: batch succeeds first
FAILING_S = 30.0

#: the most a full batch may cost on the device (``Model.cost(max_batch)``, seconds): past a
#: minute, HTTP clients give up first (and past ~9.2e9 s, ``ais.delay`` refuses it)
MAX_BATCH_S = 60.0
#: the most requests a batch may hold: each lane's three buffers hold ``max_batch`` rows
MAX_BATCH = 65536
#: the most lanes (streams): past 32, a GPU runs no more streams at once (its hardware queues,
#: ``CUDA_DEVICE_MAX_CONNECTIONS``, are at most 32)
MAX_LANES = 32


class Busy(Exception):
    """The queue is full: the client should retry later (HTTP 503)."""


class ShuttingDown(Busy):
    """The server is shutting down: the request was not run (HTTP 503)."""


# where a request is: its state changes in this order
QUEUED = "queued"  # in the queue
GATHERING = "gathering"  # taken into the batch being gathered, not yet launched
RUNNING = "running"  # its batch is launched
ENDED = "ended"  # answered: its batch ended, or the batcher closed


class _Request:
    __slots__ = ("x", "y", "batch", "error", "done", "state", "gone")

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.y: np.ndarray | None = None
        self.batch = 0
        self.error: BaseException | None = None
        self.done = anyio.Event()
        self.state = QUEUED
        self.gone = False  # its client went away: a batch not yet launched leaves it out


class _Lane:
    """A stream and the buffers of one batch in flight."""

    def __init__(self, device: ais.Device, max_batch: int, features: int) -> None:
        nbytes = max_batch * features * 4
        self.stream = ais.Stream(device)
        self.host_in = ais.HostBuffer(nbytes, device=device)
        self.dev = ais.DeviceBuffer(nbytes, device)
        self.host_out = ais.HostBuffer(nbytes, device=device)
        self.shape = (max_batch, features)


class Batcher:
    """Gathers concurrent requests into batches and runs them on the device.

    Call :meth:`infer` from request handlers while :meth:`run` runs in a task (the app's
    lifespan). A batch starts when a lane is free and a request is queued; it takes the
    requests that arrive within ``max_wait_s`` of the first, up to ``max_batch``. Cancelling a
    request (its client disconnected) before its batch is launched takes it out of the queue,
    or out of the batch being gathered (counted as ``dropped``): nobody computes it. Once its
    batch is launched, the batch runs to its end and its reply is thrown away (counted as
    ``abandoned``). ``served`` counts the replies handed back to callers still waiting for
    them. :meth:`close` stops it (shutdown).

    The lanes (a stream and buffers each) are built here: construct it where a failure to
    allocate them should show, before serving.
    """

    def __init__(
        self,
        model: Model,
        device: ais.Device,
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.002,
        lanes: int = 2,
        max_queue: int = 4096,
        blocking: bool = False,
        stuck_after_s: float = 10.0,
    ) -> None:
        if max_batch < 1 or lanes < 1 or max_queue < 1:
            raise ValueError("max_batch, lanes and max_queue must be at least 1")
        if max_batch > MAX_BATCH or lanes > MAX_LANES:
            raise ValueError(
                f"max_batch must be at most {MAX_BATCH} and lanes at most {MAX_LANES}, "
                f"got {max_batch} and {lanes}"
            )
        if not (0.0 <= max_wait_s < math.inf):
            raise ValueError(f"max_wait_s must be a finite number >= 0, got {max_wait_s!r}")
        if not (0.0 < stuck_after_s < math.inf):
            raise ValueError(f"stuck_after_s must be a finite number > 0, got {stuck_after_s!r}")
        self.stuck_after_s = stuck_after_s
        self.model, self.device = model, device
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self.blocking = blocking  # the anti-pattern, for comparison: block the loop per batch
        self._lanes = [_Lane(device, max_batch, model.features) for _ in range(lanes)]
        # in arrival order; a request whose client leaves is taken out at once
        self._queue: collections.OrderedDict[_Request, None] = collections.OrderedDict()
        self._gathering: list[_Request] = []  # the batch being gathered
        self._left_gathering = 0  # of those, the ones whose clients have left since the last look
        self._running: list[list[_Request]] = []  # the batches launched, not yet ended
        self._arrived = anyio.Event()
        self._lane_free = anyio.Event()
        self.closing = False  # close() was called: no more batches
        self.served = 0  # replies handed back to callers still waiting for them
        self.dropped = 0  # requests whose clients went away before their batch was launched
        self.abandoned = 0  # requests computed (or being computed) whose clients went away
        self.batches = self.in_flight = 0
        self.computed = 0  # requests in the batches that succeeded
        self.failed: str | None = None  # the device error that failed a batch, if one did
        self.failing: str | None = None  # why the last batch failed, if not the device
        self._failed_at = 0.0  # when (time.monotonic()): /health says so for FAILING_S

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (those whose clients left are no longer queued)."""
        return len(self._queue)

    async def infer(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """The model's output for one input row, and the size of the batch it ran in."""
        x = np.asarray(x, np.float32)
        if x.shape != (self.model.features,):
            raise ValueError(f"x must hold {self.model.features} numbers, got shape {x.shape}")
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        if len(self._queue) >= self.max_queue:
            raise Busy(f"{len(self._queue)} requests queued; retry later")
        request = _Request(x)
        self._queue[request] = None
        self._arrived.set()
        taken = False
        try:
            await request.done.wait()
            taken = True
        finally:
            if not taken:  # cancelled: its client went away
                self._leave(request)
        if request.error is not None:
            raise request.error
        assert request.y is not None
        self.served += 1
        return request.y, request.batch

    def _leave(self, request: _Request) -> None:
        request.gone = True
        if request.state == QUEUED:  # out of the queue at once: nobody computes it
            del self._queue[request]
            self.dropped += 1
        elif request.state == GATHERING:  # its batch, when launched, leaves it out
            self._left_gathering += 1
            self.dropped += 1
        elif request.error is None:  # its batch is launched: computed for nobody
            self.abandoned += 1

    async def run(self) -> None:
        """Form and launch batches until cancelled, or until :meth:`close`; then return once
        the batches running have ended."""
        free = list(self._lanes)
        async with anyio.create_task_group() as tg:
            while not self.closing:
                while not free and not self.closing:
                    self._lane_free = anyio.Event()
                    await self._lane_free.wait()
                batch = await self._gather()
                if self.closing:  # close() answered the batch gathered
                    break
                for request in batch:
                    request.state = RUNNING
                lane = free.pop()
                tg.start_soon(self._run_batch, lane, batch, free)

    async def _gather(self) -> list[_Request]:
        """The next batch: the requests that arrive within ``max_wait_s`` of the first, up to
        ``max_batch``, less those whose clients left meanwhile (if all left, it waits for a
        new first request). Returns at once when :meth:`close` is called."""
        batch = self._gathering = []
        self._left_gathering = 0
        deadline = math.inf
        while not self.closing:
            # a look over the batch only when someone left: not at each arrival, which
            # would cost max_batch looks per batch
            if self._left_gathering:
                batch[:] = [request for request in batch if not request.gone]  # counted: dropped
                self._left_gathering = 0
            while self._queue and len(batch) < self.max_batch:
                request, _ = self._queue.popitem(last=False)
                request.state = GATHERING
                batch.append(request)
            if len(batch) >= self.max_batch:
                break
            now = anyio.current_time()
            if not batch:
                deadline = math.inf
            elif deadline == math.inf:
                deadline = now + self.max_wait_s
            if deadline - now <= 0:
                break
            self._arrived = anyio.Event()
            with anyio.move_on_after(deadline - now):
                await self._arrived.wait()
        self._gathering = []
        return batch

    def close(self, *, running: bool = False) -> None:
        """Stop serving: answer the requests queued, and those of the batch being gathered,
        with :class:`ShuttingDown` at once, refuse new ones with it, and launch no more
        batches (:meth:`run` returns once the batches running have ended). With
        ``running``, answer the requests of the batches running too, without waiting for
        the device (their work goes on there, unseen)."""
        self.closing = True
        answered = [*self._queue, *self._gathering]
        if running:
            answered += [request for batch in self._running for request in batch]
        self._queue.clear()
        self._gathering = []
        for request in answered:
            if request.state != ENDED:
                request.state = ENDED
                request.error = ShuttingDown("the server is shutting down")
                request.done.set()
        self._arrived.set()
        self._lane_free.set()

    async def _run_batch(self, lane: _Lane, batch: list[_Request], free: list[_Lane]) -> None:
        self.in_flight += 1
        self._running.append(batch)
        settled = False  # the lane's work is over: its buffers may take the next batch
        try:
            n = len(batch)
            x = lane.host_in.numpy(np.float32, lane.shape)
            for i, request in enumerate(batch):
                x[i] = request.x
            # a region: an NVTX range in Nsight Systems (CUDA, with nvtx installed), and with
            # tracing on, a span of the batch's device time beside the host's
            with ais.record_function("batch", stream=lane.stream, n=n):
                ais.copy_async(lane.dev, lane.host_in, stream=lane.stream)
                ais.delay(self.model.cost(n), stream=lane.stream)  # the model's kernels
                ais.copy_async(lane.host_out, lane.dev, stream=lane.stream)
            done = lane.stream.record_event()
            if self.blocking:
                # What a blocking sync in a handler does (torch.cuda.synchronize(), say): every
                # task on the loop stalls until the batch is done. aiostream's own
                # synchronize_blocking() refuses to run on a loop's thread.
                while not done.query():
                    time.sleep(0.0002)
            else:
                await done.synchronize()  # suspends this batch only
            settled = True
            y = lane.host_out.numpy(np.float32, lane.shape)
            for i, request in enumerate(batch):
                if request.state != ENDED:  # not answered by close(running=True)
                    request.y, request.batch = y[i].copy(), n
            self.computed += n
            self.batches += 1
            self.failing = None
        except Exception as exc:  # every request of the batch gets the error
            settled = True
            if isinstance(exc, ais.DeviceError):  # sticky: the device runs nothing more
                self.failed = f"{type(exc).__name__}: {exc}"
            else:  # until a batch succeeds, or for FAILING_S
                self.failing = f"{type(exc).__name__}: {exc}"
                self._failed_at = time.monotonic()
            for request in batch:
                if request.state != ENDED:
                    request.error = exc
        except BaseException:  # cancelled: the server shuts down
            for request in batch:
                if request.state != ENDED:
                    request.error = ShuttingDown("the server is shutting down")
            raise
        finally:
            for request in batch:
                if request.state != ENDED:
                    request.state = ENDED
                    request.done.set()
            self._running.remove(batch)
            self.in_flight -= 1
            if settled:  # cancelled mid-batch (shutdown): the device may still use its buffers
                free.append(lane)
                self._lane_free.set()

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for ``/health``: 503 once the device failed, or while the oldest
        wait on the device, or on another library's handle (``ais.wait``: a transfer, a
        collective), is older than ``stuck_after_s`` (a kernel or a transfer that does not
        end: the wait names what it waits on, its kind and its task); else 200."""
        if self.failed is not None:  # device errors are sticky: restart the process
            return 503, {"ok": False, "error": self.failed}
        if self.failing is not None and time.monotonic() - self._failed_at < FAILING_S:
            # the last batch failed, lately; the next may not (and with no traffic, which a
            # load balancer that heeds the 503 would cause, none comes to clear it)
            return 503, {"ok": False, "error": self.failing, "sticky": False}
        device = str(self.device)
        waits = [  # longest first
            w for w in ais.pending_waits() if w.device == device or not _a_device(w.device)
        ]
        if waits and waits[0].waited > self.stuck_after_s:
            oldest = waits[0]
            return 503, {
                "ok": False,
                "stuck": oldest.subject,
                "on": oldest.device,  # the device, or the kind of a foreign handle
                "task": oldest.task,
                "waited_s": round(oldest.waited, 3),
            }
        return 200, {"ok": True}

    def stats(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "served": self.served,
            "dropped": self.dropped,
            "abandoned": self.abandoned,
            "batches": self.batches,
            "mean_batch": self.computed / self.batches if self.batches else 0.0,
            "queued": self.queued,
            "in_flight": self.in_flight,
            "pending_waits": len(ais.pending_waits()),
            "bound_rps": self.model.bound(self.max_batch),
            "blocking": self.blocking,
            "failed": self.failed,
        }


def _a_device(name: str) -> bool:
    """Whether a pending wait's ``device`` names a device (``cuda:0``, ``virtual:1``), not the
    kind of another library's handle awaited with ``ais.wait`` (``concurrent.futures``)."""
    kind, _, index = name.partition(":")
    return kind in ("cuda", "virtual") and index.isdigit()


MAX_BODY_BYTES = 1 << 20  # a request body's limit by default: ~40,000 numbers as JSON
ECHO_CHARS = 200  # a 422 shows at most this much of each rejected input
MAX_ERRORS = 10  # and at most this many errors
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _finite_float32(v: float) -> float:
    """A number the model can take: finite, and finite as float32 too (the device's type)."""
    if math.isfinite(v) and abs(v) <= FLOAT32_MAX:
        return v
    if math.isnan(v):
        got = "NaN"
    elif math.isinf(v):  # JSON's 1e400 reads as Infinity too
        got = f"{'-' if v < 0 else ''}Infinity (or a number past float64's range)"
    else:
        got = f"{v:g}"
    raise PydanticCustomError(
        "finite_number",
        f"Input should be a finite number within float32 range (|x| <= {FLOAT32_MAX:.7g}), "
        f"got {got}",
    )


class Item(BaseModel):
    x: list[Annotated[float, AfterValidator(_finite_float32)]]


_LAX_JSON = json.JSONEncoder(ensure_ascii=False, default=repr)  # NaN and Infinity as in JS
_STRICT_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def excerpt(value: Any, limit: int = ECHO_CHARS) -> tuple[Any, bool]:
    """What a 422 shows of a rejected input, and whether it was cut: the value itself when its
    JSON is at most ``limit`` characters and standard, else (a string) at most ``limit``
    characters of it. Encodes no more of a long input than it shows."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value[: limit + 1]).decode("utf-8", "replace")
    if isinstance(value, str):
        return (value, False) if len(value) <= limit else (value[:limit], True)
    chunks: list[str] = []
    size = 0
    try:
        for chunk in _LAX_JSON.iterencode(value):  # lazy: stops once past the limit
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return "".join(chunks)[:limit], True
    except ValueError:  # an int too long to print, say
        return f"<{type(value).__name__} too long to show>", True
    try:
        _STRICT_JSON.encode(value)  # short: check that the reply can carry it as it is
    except (TypeError, ValueError):  # NaN or Infinity in it: its text, NaN as JavaScript's
        return "".join(chunks), False
    return value, False


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 reply (``loc``, ``msg``, ``type``, ``input``, ``ctx``), bounded: each input
    shown by :func:`excerpt`, and the first ``MAX_ERRORS`` errors only. FastAPI's own handler
    sends the whole input back: a 1 MB string in, a 1 MB reply out."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    detail = []
    for error in errors[:MAX_ERRORS]:
        shown: dict[str, Any] = {
            "type": error["type"],
            "loc": [p if isinstance(p, int) else excerpt(str(p))[0] for p in error["loc"]],
            "msg": excerpt(str(error["msg"]))[0],
        }
        if "input" in error:
            shown["input"], cut = excerpt(error["input"])
            if cut:
                shown["input_truncated"] = True
        if error.get("ctx"):
            shown["ctx"] = {
                str(k): excerpt(v if isinstance(v, str | int | float | bool) else str(v))[0]
                for k, v in error["ctx"].items()
            }
        detail.append(shown)
    content: dict[str, Any] = {"detail": detail}
    if len(errors) > MAX_ERRORS:
        content["errors_omitted"] = len(errors) - MAX_ERRORS
    return JSONResponse(content, status_code=422)


class _BodyTooLarge(Exception):
    """Raised to the app by its ``receive`` once the body read passes the limit."""


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``.

    A declared size (Content-Length) over the limit is refused before the app runs, so nothing
    of the body is read; a body without one (chunked) is counted as the app reads it, and the
    read that passes the limit raises in the app instead of returning: the app's own answer to
    that (FastAPI: a 400) is dropped and the 413 goes out instead. Requests without a body
    (``/health``) pass through untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"the request body ({declared} bytes)")
            return
        read = 0
        over = started = False

        async def receive_within_limit() -> Message:
            nonlocal read, over
            if over:
                raise _BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_bytes:
                    over = True
                    raise _BodyTooLarge
            return message

        async def send_unless_over(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the app's answer to a body it could not read: the 413 replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_within_limit, send_unless_over)
        except _BodyTooLarge:
            if started:  # too late for a 413: the server drops the connection
                raise
        if over and not started:
            await self._refuse(scope, receive, send, "the request body")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        detail = f"{what} exceeds the limit of {self.max_bytes} bytes"
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses it (uvicorn: 400); else counted as read
    return None


class _JSONRequest(Request):
    """A request whose JSON body, where Python's parser fails on it other than as malformed
    JSON (nested past the recursion limit, an integer of more than
    ``sys.get_int_max_str_digits()`` digits, bytes that are not UTF-8), raises
    ``JSONDecodeError`` all the same: FastAPI then answers 422 ``json_invalid``, as for any
    malformed JSON, where it would answer 400 "There was an error parsing the body"."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body)
            except json.JSONDecodeError:
                raise
            except RecursionError:
                raise json.JSONDecodeError("nested too deeply", "", 0) from None
            except UnicodeDecodeError as exc:
                why = f"not UTF-8 ({exc.reason} at byte {exc.start})"
                raise json.JSONDecodeError(why, "", 0) from None
            except ValueError as exc:  # an integer too long to convert, say
                raise json.JSONDecodeError(str(exc).split(";")[0], "", 0) from None
        return self._json


class _JSONRoute(APIRoute):
    """A route that hands its handler a :class:`_JSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def parse_json_strictly(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return parse_json_strictly


async def _disconnected(request: Request) -> None:
    """Return once the client has gone: with the body read, the server's next message for
    the request is ``http.disconnect``, sent when the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    model: Model | None = None,
    device: str | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    tracer_provider: Any = None,
    batcher: Batcher | None = None,
    **batcher_options: Any,
) -> FastAPI:
    """The FastAPI app; its lifespan builds the batcher (``Batcher(model, device,
    **batcher_options)``) and runs its task. A request body over ``max_body_bytes`` answers
    413. ``/metrics`` serves aiostream's Prometheus metrics (where prometheus-client is
    installed); with an OpenTelemetry ``tracer_provider``, every wait and batch is a span
    (``aiostream.tracing``). A ``batcher`` built beforehand (as :func:`main` does, so that its
    lanes exist before the server listens) is used instead, in place of ``model``, ``device``
    and the options; it serves one lifespan."""
    if batcher is not None:
        if model is not None or device is not None or batcher_options:
            raise ValueError("give a batcher, or what to build one from, not both")
        model = batcher.model
    model = model or Model()
    if not (isinstance(max_body_bytes, int) and max_body_bytes >= 1):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    given = batcher

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher = given or Batcher(model, ais.device(device), **batcher_options)
        app.state.batcher = batcher
        with contextlib.ExitStack() as telemetry:
            app.state.metrics = _metrics(batcher, telemetry)
            if tracer_provider is not None:  # spans of every wait and batch
                import aiostream.tracing

                telemetry.enter_context(aiostream.tracing.instrument(tracer_provider))
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(batcher.run)
                    yield
                    tg.cancel_scope.cancel()
            finally:
                del app.state.batcher  # its streams and buffers go with it, not with the app

    app = FastAPI(title="aiostream inference server", lifespan=lifespan)
    app.router.route_class = _JSONRoute
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.post("/infer")
    async def infer(item: Item, request: Request) -> Any:
        if len(item.x) != model.features:
            raise HTTPException(422, f"x must hold {model.features} numbers, got {len(item.x)}")
        x = np.asarray(item.x, np.float32)
        outcome: list[Any] = []

        async def answer(scope: anyio.CancelScope) -> None:
            try:
                outcome.append(await app.state.batcher.infer(x))
            except Exception as exc:  # answered with it below, not as the task group's group
                outcome.append(exc)
            scope.cancel()  # answered: stop watching the connection

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer, tg.cancel_scope)
            await _disconnected(request)
            # the client gave up: its request leaves the queue (or its batch's reply is dropped)
            tg.cancel_scope.cancel()
        if not outcome:
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(outcome[0], Busy):  # the queue is full, or the server shuts down
            raise HTTPException(503, str(outcome[0]))
        if isinstance(outcome[0], Exception):  # its batch failed (the device, or the model)
            raise HTTPException(500, f"{type(outcome[0]).__name__}: {outcome[0]}")
        y, n = outcome[0]
        return {"y": y.tolist(), "batch": n}

    @app.get("/health")
    async def health() -> Any:
        status, body = app.state.batcher.health()
        return JSONResponse(body, status_code=status)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return app.state.batcher.stats()  # type: ignore[no-any-return]

    @app.get("/metrics")
    async def metrics() -> Response:
        if app.state.metrics is None:
            raise HTTPException(404, f"no Prometheus client here: {_PROMETHEUS}")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(app.state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


_PROMETHEUS = 'pip install prometheus-client (from a checkout: pip install ".[server]")'


def _metrics(batcher: Batcher, stack: contextlib.ExitStack) -> Any:
    """aiostream's Prometheus metrics on a registry of the app's own, their stuck waits by
    the server's threshold; None where prometheus-client is not installed."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        return None
    import aiostream.metrics

    registry = CollectorRegistry()
    made = aiostream.metrics.PrometheusMetrics(registry, stuck_after=batcher.stuck_after_s)
    return stack.enter_context(made)


def _number(kind: type, low: float, high: float = math.inf, *, low_ok: bool = True) -> Any:
    """An argparse type: a finite ``kind`` from ``low`` (or above it) to ``high``, else a usage
    error that says the range."""

    a = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {a}") from None
        above = value >= low if low_ok else value > low
        if not (math.isfinite(value) and above and value <= high):
            bound = f"{'at least' if low_ok else 'more than'} {low:g}"
            if math.isfinite(high):
                bound += f" and at most {high:g}"
            finite = a if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {finite} {bound}, got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--device", default=None, help="cuda:0, virtual:0; None: aiostream's default device"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=_number(int, 0, 65535), default=8000, help="0: any free port"
    )
    parser.add_argument(
        "--max-batch",
        type=_number(int, 1, MAX_BATCH),
        default=32,
        help="requests per batch, at most",
    )
    parser.add_argument(
        "--max-wait-ms",
        type=_number(float, 0),
        default=2.0,
        help="how long a batch waits for others",
    )
    parser.add_argument(
        "--lanes", type=_number(int, 1, MAX_LANES), default=2, help="streams running batches"
    )
    parser.add_argument("--max-queue", type=_number(int, 1), default=4096, help="more queued: 503")
    parser.add_argument(
        "--launch-ms",
        type=_number(float, 0),
        default=Model.launch_s * 1e3,
        help="the device's fixed cost per batch (with --per-item-ms: the device bound; a full "
        f"batch may cost at most {MAX_BATCH_S:g} s)",
    )
    parser.add_argument(
        "--per-item-ms",
        type=_number(float, 0),
        default=Model.per_item_s * 1e3,
        help="its cost per item",
    )
    parser.add_argument(
        "--blocking", action="store_true", help="block the loop on each batch (for comparison)"
    )
    parser.add_argument(
        "--stuck-after",
        type=_number(float, 0, low_ok=False),
        default=10.0,
        help="/health answers 503 while a device wait is older than this (seconds)",
    )
    parser.add_argument(
        "--otel-console",
        action="store_true",
        help="print OpenTelemetry spans (each wait, each batch's host and device time)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="a request body larger than this answers 413 (1 MiB)",
    )
    args = parser.parse_args(argv)
    if args.max_body_bytes < 1:
        parser.error(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}")
    try:  # checked before serving, not when the app starts
        ais.device(args.device)
    except (ValueError, ais.AiostreamError) as exc:
        parser.error(f"--device {args.device}: {exc}")
    model = Model(launch_s=args.launch_ms / 1e3, per_item_s=args.per_item_ms / 1e3)
    cost = model.cost(args.max_batch)
    if not cost <= MAX_BATCH_S:  # else a server whose batches all fail (or time out clients)
        parser.error(
            f"a full batch (--launch-ms {args.launch_ms:g} + --max-batch {args.max_batch} x "
            f"--per-item-ms {args.per_item_ms:g}) would take {cost:g} s on the device; "
            f"at most {MAX_BATCH_S:g} s"
        )
    provider = None
    if args.otel_console:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError:
            parser.error('--otel-console needs the OpenTelemetry SDK: pip install ".[server]"')
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    try:  # its lanes (streams and buffers) exist before the server listens
        batcher = Batcher(
            model,
            ais.device(args.device),
            max_batch=args.max_batch,
            max_wait_s=args.max_wait_ms / 1e3,
            lanes=args.lanes,
            max_queue=args.max_queue,
            blocking=args.blocking,
            stuck_after_s=args.stuck_after,
        )
    except (ais.AiostreamError, MemoryError) as exc:  # out of device or pinned memory, say
        parser.error(f"--lanes {args.lanes} --max-batch {args.max_batch}: {exc}")
    app = create_app(max_body_bytes=args.max_body_bytes, tracer_provider=provider, batcher=batcher)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:  # the port in use, an unknown host
        why = str(exc.strerror or exc).partition(" (while attempting to bind")[0]
        parser.error(f"--host {args.host} --port {args.port}: {why}")
    host, port = sock.getsockname()[:2]
    print(f"serving on http://{host}:{port} (device bound {model.bound(args.max_batch):.0f} req/s)")
    print(flush=True, end="")
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C once it has shut down
        _server(config, batcher).run(sockets=[sock])


#: on a second Ctrl-C, how long the requests answered 503 have to send their replies
FORCED_EXIT_S = 1.0


def _server(config: Any, batcher: Batcher) -> Any:
    """A uvicorn server whose shutdown (SIGINT, SIGTERM) closes the batcher first: queued
    requests answer 503 at once and only the batches running finish, rather than uvicorn
    waiting for every queued request to be computed. A second SIGINT (uvicorn's forced exit,
    which skips the app's lifespan shutdown) answers the requests of those batches 503 too
    and shuts the lifespan down, so that no task is left to be cancelled as the loop closes
    (uvicorn logs a traceback for each)."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            batcher.close()
            await super().shutdown(sockets)
            if self.force_exit:
                batcher.close(running=True)
                deadline = time.monotonic() + FORCED_EXIT_S
                while self.server_state.tasks and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.lifespan.shutdown(), FORCED_EXIT_S)

    return Server(config)


if __name__ == "__main__":
    main()

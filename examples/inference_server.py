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
``GET /stats`` (served, dropped, batches, queued, in flight, pending waits, the device
bound in requests/s); ``GET /metrics``: aiostream's Prometheus metrics (``aiostream.metrics``:
pending and stuck waits, wait latency, device errors, bytes copied), where prometheus-client
is installed. ``--otel-console`` prints OpenTelemetry spans: each wait, and each batch's
host and device time (``aiostream.tracing``). Each batch is a ``record_function`` region,
which Nsight Systems shows as an NVTX range on CUDA. A full queue answers 503; a malformed
request, 422. A request whose client disconnects leaves the queue (``dropped``): nobody
computes it.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
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


class Busy(Exception):
    """The queue is full: the client should retry later (HTTP 503)."""


class _Request:
    __slots__ = ("x", "y", "batch", "error", "done", "abandoned", "queued")

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.y: np.ndarray | None = None
        self.batch = 0
        self.error: BaseException | None = None
        self.done = anyio.Event()
        self.abandoned = False  # its client went away: the batcher skips it
        self.queued = False  # in the queue, not yet taken into a batch


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
    request (its client disconnected) takes it out of the queue (counted as ``dropped``), or,
    once its batch runs, drops its reply.
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
        if not (0.0 <= max_wait_s < math.inf):
            raise ValueError(f"max_wait_s must be a finite number >= 0, got {max_wait_s!r}")
        if not (0.0 < stuck_after_s < math.inf):
            raise ValueError(f"stuck_after_s must be a finite number > 0, got {stuck_after_s!r}")
        self.stuck_after_s = stuck_after_s
        self.model, self.device = model, device
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self.blocking = blocking  # the anti-pattern, for comparison: block the loop per batch
        self._lanes = [_Lane(device, max_batch, model.features) for _ in range(lanes)]
        self._queue: collections.deque[_Request] = collections.deque()
        self._arrived = anyio.Event()
        self._lane_free = anyio.Event()
        self.served = self.batches = self.in_flight = 0
        self.dropped = 0  # requests whose clients went away before a batch took them
        self._gone = 0  # of those, the ones still in the deque
        self.failed: str | None = None  # the device error that failed a batch, if one did
        self.failing: str | None = None  # why the last batch failed, if not the device
        self._failed_at = 0.0  # when (time.monotonic()): /health says so for FAILING_S

    @property
    def queued(self) -> int:
        """Requests waiting for a batch: those whose clients left do not count (they leave
        the deque when a batch next forms, skipped)."""
        return len(self._queue) - self._gone

    async def infer(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """The model's output for one input row, and the size of the batch it ran in."""
        x = np.asarray(x, np.float32)
        if x.shape != (self.model.features,):
            raise ValueError(f"x must hold {self.model.features} numbers, got shape {x.shape}")
        if self.queued >= self.max_queue:
            raise Busy(f"{self.queued} requests queued; retry later")
        request = _Request(x)
        self._queue.append(request)
        request.queued = True
        self._arrived.set()
        try:
            await request.done.wait()
        finally:
            request.abandoned = True  # the batch, if it still runs, need not answer
            if request.queued:  # its client left before a batch took it: nobody computes it
                self._gone += 1
                self.dropped += 1
        if request.error is not None:
            raise request.error
        assert request.y is not None
        return request.y, request.batch

    async def run(self) -> None:
        """Form and launch batches until cancelled."""
        free = list(self._lanes)
        async with anyio.create_task_group() as tg:
            while True:
                while not free:
                    self._lane_free = anyio.Event()
                    await self._lane_free.wait()
                batch = await self._gather()
                lane = free.pop()
                tg.start_soon(self._run_batch, lane, batch, free)

    async def _gather(self) -> list[_Request]:
        batch: list[_Request] = []
        deadline = math.inf
        while len(batch) < self.max_batch:
            while self._queue and len(batch) < self.max_batch:
                request = self._queue.popleft()
                request.queued = False
                if request.abandoned:
                    self._gone -= 1  # counted as dropped when its client left
                else:
                    batch.append(request)
            if len(batch) >= self.max_batch:
                break
            if batch and deadline == math.inf:
                deadline = anyio.current_time() + self.max_wait_s
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            self._arrived = anyio.Event()
            with anyio.move_on_after(remaining):
                await self._arrived.wait()
        return batch

    async def _run_batch(self, lane: _Lane, batch: list[_Request], free: list[_Lane]) -> None:
        self.in_flight += 1
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
                request.y, request.batch = y[i].copy(), n
            self.served += n
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
                request.error = exc
        except BaseException:  # cancelled: the server shuts down
            for request in batch:
                request.error = ais.AiostreamError("the server is shutting down")
            raise
        finally:
            for request in batch:
                request.done.set()
            self.in_flight -= 1
            if settled:  # cancelled mid-batch (shutdown): the device may still use its buffers
                free.append(lane)
                self._lane_free.set()

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for ``/health``: 503 once the device failed, or while the oldest
        wait on the device is older than ``stuck_after_s`` (a kernel that does not end: the
        wait names its stream and task); else 200."""
        if self.failed is not None:  # device errors are sticky: restart the process
            return 503, {"ok": False, "error": self.failed}
        if self.failing is not None and time.monotonic() - self._failed_at < FAILING_S:
            # the last batch failed, lately; the next may not (and with no traffic, which a
            # load balancer that heeds the 503 would cause, none comes to clear it)
            return 503, {"ok": False, "error": self.failing, "sticky": False}
        device = str(self.device)
        waits = [w for w in ais.pending_waits() if w.device == device]  # longest first
        if waits and waits[0].waited > self.stuck_after_s:
            oldest = waits[0]
            return 503, {
                "ok": False,
                "stuck": oldest.subject,
                "task": oldest.task,
                "waited_s": round(oldest.waited, 3),
            }
        return 200, {"ok": True}

    def stats(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "served": self.served,
            "dropped": self.dropped,
            "batches": self.batches,
            "mean_batch": self.served / self.batches if self.batches else 0.0,
            "queued": self.queued,
            "in_flight": self.in_flight,
            "pending_waits": len(ais.pending_waits()),
            "bound_rps": self.model.bound(self.max_batch),
            "blocking": self.blocking,
            "failed": self.failed,
        }


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
    **batcher_options: Any,
) -> FastAPI:
    """The FastAPI app; its lifespan owns the batcher and its task. A request body over
    ``max_body_bytes`` answers 413. ``/metrics`` serves aiostream's Prometheus metrics (where
    prometheus-client is installed); with an OpenTelemetry ``tracer_provider``, every wait
    and batch is a span (``aiostream.tracing``)."""
    model = model or Model()
    if not (isinstance(max_body_bytes, int) and max_body_bytes >= 1):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher = Batcher(model, ais.device(device), **batcher_options)
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
        if isinstance(outcome[0], Busy):
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

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value >= low if low_ok else value > low
        if not (math.isfinite(value) and above and value <= high):
            bound = f"{'at least' if low_ok else 'more than'} {low:g}"
            if math.isfinite(high):
                bound += f" and at most {high:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
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
        "--max-batch", type=_number(int, 1), default=32, help="requests per batch, at most"
    )
    parser.add_argument(
        "--max-wait-ms",
        type=_number(float, 0),
        default=2.0,
        help="how long a batch waits for others",
    )
    parser.add_argument("--lanes", type=_number(int, 1), default=2, help="streams running batches")
    parser.add_argument("--max-queue", type=_number(int, 1), default=4096, help="more queued: 503")
    parser.add_argument(
        "--launch-ms",
        type=_number(float, 0),
        default=Model.launch_s * 1e3,
        help="the device's fixed cost per batch (with --per-item-ms: the device bound)",
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
    provider = None
    if args.otel_console:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError:
            parser.error('--otel-console needs the OpenTelemetry SDK: pip install ".[server]"')
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    app = create_app(
        model,
        args.device,
        max_batch=args.max_batch,
        max_wait_s=args.max_wait_ms / 1e3,
        lanes=args.lanes,
        max_queue=args.max_queue,
        blocking=args.blocking,
        stuck_after_s=args.stuck_after,
        max_body_bytes=args.max_body_bytes,
        tracer_provider=provider,
    )
    sock = socket.create_server((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"serving on http://{host}:{port} (device bound {model.bound(args.max_batch):.0f} req/s)")
    print(flush=True, end="")
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C once it has shut down
        uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()

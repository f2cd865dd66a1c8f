"""examples/inference_server.py: its batcher in virtual time on every loop, and the real server
(uvicorn on a loopback port, in a subprocess) driven by httpx clients in real time."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers.deadlines import until
from tests.helpers.process import ROOT, import_example, run_python

for _dist in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_dist, reason='the server example needs pip install -e ".[server]"')

pytestmark = pytest.mark.anyio


server = import_example("inference_server")
client = import_example("inference_client")

MODEL = server.Model(features=4, launch_s=0.040, per_item_s=0.00125)  # 80 ms per 32: 400 req/s
# A batch's upload and download each take the virtual device's copy time (its defaults:
# 10 us + bytes / 25 GB/s); the lanes' buffers hold 32 rows of 4 float32.
COPY_S = 10e-6 + 32 * 4 * 4 / 25e9


# ---------------------------------------------------------------------- the batcher, in-process


async def _requests(batcher: object, rows: list[np.ndarray]) -> list[tuple[np.ndarray, int]]:
    out: list[tuple[np.ndarray, int]] = [None] * len(rows)  # type: ignore[list-item]

    async def one(i: int) -> None:
        out[i] = await batcher.infer(rows[i])  # type: ignore[attr-defined]

    async with anyio.create_task_group() as tg:
        for i in range(len(rows)):
            tg.start_soon(one, i)
    return out


async def test_concurrent_requests_share_batches_and_get_their_own_rows(
    virtual_time: VirtualTime,
) -> None:
    batcher = server.Batcher(MODEL, ais.device(), max_batch=32, max_wait_s=0.002, lanes=2)
    rows = [np.array([i, -i, 2 * i, 0.5], np.float32) for i in range(100)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        replies = await _requests(batcher, rows)
        tg.cancel_scope.cancel()
    for row, (y, _) in zip(rows, replies, strict=True):
        assert y.tolist() == row.tolist()
    # 100 requests at once: full batches of 32, then the rest (4), back to back on the single
    # compute engine (the next batch fills while one runs): the device never idles.
    assert sorted(n for _, n in replies) == [4] * 4 + [32] * 96
    assert (batcher.served, batcher.batches, batcher.in_flight, batcher.queued) == (100, 4, 0, 0)
    compute = [op for op in ais.virtual.timeline() if op.engine == "compute"]
    costs = [MODEL.cost(32)] * 3 + [MODEL.cost(4)]
    assert [op.end - op.start for op in compute] == pytest.approx(costs, abs=1e-9)
    assert [b.start for b in compute[1:]] == pytest.approx([a.end for a in compute[:-1]])
    # the first batch's upload and the last one's download are all the device adds
    assert virtual_time.now() == pytest.approx(sum(costs) + 2 * COPY_S, abs=1e-9)
    assert ais.pending_waits() == []


async def test_a_lone_request_waits_max_wait_for_company(virtual_time: VirtualTime) -> None:
    batcher = server.Batcher(MODEL, ais.device(), max_batch=32, max_wait_s=0.002)
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        y, n = await batcher.infer(np.ones(4, np.float32))
        tg.cancel_scope.cancel()
    assert n == 1 and y.tolist() == [1.0] * 4
    assert virtual_time.now() == pytest.approx(0.002 + 2 * COPY_S + MODEL.cost(1), abs=1e-9)


async def test_cancelled_requests_leave_their_batch_and_nothing_pending(
    virtual_time: VirtualTime,
) -> None:
    batcher = server.Batcher(MODEL, ais.device(), max_batch=8, max_wait_s=0.002, lanes=1)
    answered = []

    async def impatient(i: int) -> None:
        with anyio.move_on_after(0.010):  # gives up while its batch runs on the device
            answered.append(await batcher.infer(np.full(4, i, np.float32)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        async with anyio.create_task_group() as clients:
            for i in range(20):
                clients.start_soon(impatient, i)
        assert answered == []
        # the 12 behind the running batch left the queue as their clients gave up: they count
        # neither as queued nor against max_queue
        assert (batcher.queued, batcher.dropped) == (0, 12)
        # The requests still queued were dropped unrun; the one batch launched completed, its
        # replies for nobody: served counts only the replies taken
        await anyio.sleep(1.0)
        assert (batcher.in_flight, batcher.queued) == (0, 0)
        assert (batcher.batches, batcher.served, batcher.abandoned) == (1, 0, 8)
        assert batcher.stats()["mean_batch"] == 8
        y, n = await batcher.infer(np.ones(4, np.float32))  # the server still serves
        assert n == 1 and y.tolist() == [1.0] * 4
        tg.cancel_scope.cancel()
    assert ais.pending_waits() == []


async def test_requests_whose_clients_leave_while_their_batch_gathers_are_not_computed(
    virtual_time: VirtualTime,
) -> None:
    """A batch waits up to 5 s for company; its clients leave after 1 s: the batch is never
    launched, and they count as dropped. One that stays is computed alone."""
    batcher = server.Batcher(MODEL, ais.device(), max_batch=8, max_wait_s=5.0, lanes=1)
    answered = []

    async def leaves_after(seconds: float) -> None:
        with anyio.move_on_after(seconds):
            answered.append(await batcher.infer(np.ones(4, np.float32)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        async with anyio.create_task_group() as clients:
            for _ in range(3):
                clients.start_soon(leaves_after, 1.0)
            clients.start_soon(leaves_after, 100.0)  # stays: its batch launches at 5 s
        tg.cancel_scope.cancel()
    assert [n for _, n in answered] == [1]
    assert (batcher.dropped, batcher.served, batcher.abandoned, batcher.batches) == (3, 1, 0, 1)
    [compute] = [op for op in ais.virtual.timeline() if op.engine == "compute"]
    assert compute.end - compute.start == pytest.approx(MODEL.cost(1))
    assert compute.start == pytest.approx(5.0 + COPY_S)


async def test_requests_whose_clients_left_leave_the_queue_at_once() -> None:
    """While no lane is free (the device stalled), clients come and go: each request leaves
    the queue as its client goes (nothing holds its row any more), so the queue never holds
    more than max_queue requests, and one is refused only when max_queue live ones wait."""
    ais.virtual.reset()
    stall = ais.virtual.stall("compute")
    batcher = server.Batcher(
        MODEL, ais.device("virtual:0"), max_batch=1, max_wait_s=0.0, max_queue=2
    )
    rows: list[weakref.ref[np.ndarray]] = []

    async def leaves(row: np.ndarray) -> None:
        await batcher.infer(row)

    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        for _ in range(2):  # both lanes busy, on the stalled device
            tg.start_soon(batcher.infer, np.ones(4, np.float32))
        await until(lambda: batcher.in_flight == 2, "both lanes to run a batch")
        for _ in range(50):
            async with anyio.create_task_group() as clients:
                for _ in range(2):
                    row = np.ones(4, np.float32)
                    rows.append(weakref.ref(row))
                    clients.start_soon(leaves, row)
                    del row
                await anyio.wait_all_tasks_blocked()
                assert batcher.queued == 2
                clients.cancel_scope.cancel()
        gc.collect()
        assert [ref for ref in rows if ref() is not None] == []
        assert (batcher.queued, batcher.dropped) == (0, 100)
        await _refuses_a_third(batcher)  # the queue has room for 2 again
        stall.release()
        tg.cancel_scope.cancel()


async def _outcome(batcher: Any, i: int, outcomes: dict[int, object]) -> None:
    """Request row ``i``: its batch's size, or ShuttingDown's message and when it came."""
    try:
        outcomes[i] = (await batcher.infer(np.full(4, i, np.float32)))[1]
    except server.ShuttingDown as exc:
        outcomes[i] = (str(exc), anyio.current_time())


@pytest.mark.parametrize("lanes", [1, 2], ids=["queued", "gathering"])
async def test_close_answers_the_waiting_at_once_and_lets_running_batches_finish(
    virtual_time: VirtualTime, lanes: int
) -> None:
    """Shutdown: the requests queued (one lane: busy), or in the batch gathering (two lanes),
    get ShuttingDown at once, new ones too; the batch running finishes and is answered; then
    run() returns by itself."""
    batcher = server.Batcher(MODEL, ais.device(), max_batch=4, max_wait_s=1.0, lanes=lanes)
    outcomes: dict[int, object] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        for i in range(6):  # a full batch of 4 runs; 2 wait
            tg.start_soon(_outcome, batcher, i, outcomes)
        await anyio.sleep(0.010)
        assert batcher.in_flight == 1 and outcomes == {}
        assert batcher.queued == (2 if lanes == 1 else 0)
        batcher.close()
        with pytest.raises(server.ShuttingDown):
            await batcher.infer(np.ones(4, np.float32))
    shut = ("the server is shutting down", 0.010)  # at once (trio starts tasks in any order)
    assert sorted(outcomes.values(), key=str) == [shut] * 2 + [4] * 4
    assert virtual_time.now() == pytest.approx(MODEL.cost(4) + 2 * COPY_S)
    assert (batcher.served, batcher.batches, batcher.queued, batcher.in_flight) == (4, 1, 0, 0)
    assert ais.pending_waits() == []


async def test_close_with_running_answers_the_running_batches_too(
    virtual_device: ais.Device,
) -> None:
    """A forced shutdown: requests whose batch waits on a stalled device get ShuttingDown."""
    stall = ais.virtual.stall("compute")
    batcher = server.Batcher(MODEL, ais.device(), max_batch=2, max_wait_s=0.0, lanes=1)
    outcomes: dict[int, object] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        async with anyio.create_task_group() as clients:
            clients.start_soon(_outcome, batcher, 0, outcomes)
            await until(lambda: batcher.in_flight == 1, "the batch to run")
            batcher.close(running=True)
        assert outcomes[0][0] == "the server is shutting down"  # type: ignore[index]
        stall.release()
    assert (batcher.served, batcher.in_flight) == (0, 0)


async def test_a_device_fault_reaches_every_request_and_the_batcher_says_so(
    virtual_time: VirtualTime,
) -> None:
    batcher = server.Batcher(MODEL, ais.device(), max_batch=4, max_wait_s=0.002, lanes=1)
    ais.virtual.fail_next(engine="compute", message="ECC error")
    outcomes: list[object] = []

    async def one(i: int) -> None:
        try:
            outcomes.append((await batcher.infer(np.full(4, i, np.float32)))[1])
        except ais.DeviceError as exc:
            outcomes.append(str(exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        async with anyio.create_task_group() as clients:
            for i in range(4):
                clients.start_soon(one, i)
        assert len(outcomes) == 4 and all("ECC error" in str(o) for o in outcomes)
        assert (batcher.in_flight, batcher.queued, batcher.served) == (0, 0, 0)
        assert batcher.failed is not None and "ECC error" in batcher.failed  # /health: 503
        with pytest.raises(ais.DeviceError, match="ECC error"):  # sticky, as on CUDA
            await batcher.infer(np.ones(4, np.float32))
        tg.cancel_scope.cancel()
    assert ais.pending_waits() == []


class _Flaky(server.Model):  # type: ignore[misc,name-defined]
    """A model whose batches fail (not on the device: in the program) while ``broken``."""

    broken = True

    def cost(self, n: int) -> float:
        if _Flaky.broken:
            raise RuntimeError("the model's weights are not loaded")
        return float(super().cost(n))


async def test_a_failing_batch_shows_in_health_until_a_batch_succeeds(
    virtual_time: VirtualTime,
) -> None:
    """A batch that fails for the program's own reason answers its requests with the error,
    and /health says 503 with it, not sticky: the next batch that succeeds clears it."""
    _Flaky.broken = True
    batcher = server.Batcher(_Flaky(), ais.device(), max_batch=4, max_wait_s=0.002, lanes=1)
    assert batcher.health() == (200, {"ok": True})
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        with pytest.raises(RuntimeError, match="weights are not loaded"):
            await batcher.infer(np.ones(4, np.float32))
        status, body = batcher.health()
        assert status == 503 and body["sticky"] is False, body
        assert body["error"] == "RuntimeError: the model's weights are not loaded"
        _Flaky.broken = False
        y, n = await batcher.infer(np.ones(4, np.float32))
        assert n == 1 and (y == 1).all()
        assert batcher.health() == (200, {"ok": True})
        tg.cancel_scope.cancel()


async def test_a_failing_batch_shows_in_health_for_a_while_without_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no batch to clear it (a load balancer heeding the 503 sends none), /health says
    the failure for FAILING_S, then 200 again; through HTTP the request got a 500 naming the
    error, not a server error page."""
    import httpx

    monkeypatch.setattr(server, "FAILING_S", 0.2)
    _Flaky.broken = True
    app = server.create_app(_Flaky(), "virtual:0")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            reply = await http.post("/infer", json={"x": [1, 2, 3, 4]})
            assert reply.status_code == 500
            assert reply.json() == {"detail": "RuntimeError: the model's weights are not loaded"}
            assert (await http.get("/health")).status_code == 503
            await anyio.sleep(0.3)
            assert (await http.get("/health")).status_code == 200


async def _refuses_a_third(batcher: Any) -> None:
    """Two requests queue (``max_queue=2``); a third is refused at once."""
    async with anyio.create_task_group() as clients:
        for _ in range(2):
            clients.start_soon(batcher.infer, np.ones(4, np.float32))
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(server.Busy, match="2 requests queued; retry later"):
            await batcher.infer(np.ones(4, np.float32))
        clients.cancel_scope.cancel()


async def test_a_full_queue_refuses_at_once_and_bad_options_are_named() -> None:
    ais.virtual.reset()
    batcher = server.Batcher(MODEL, ais.device("virtual:0"), max_queue=2)
    await _refuses_a_third(batcher)
    with pytest.raises(ValueError, match=r"x must hold 4 numbers, got shape \(3,\)"):
        await batcher.infer(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="at least 1"):
        server.Batcher(MODEL, ais.device("virtual:0"), lanes=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        server.Batcher(MODEL, ais.device("virtual:0"), max_wait_s=float("nan"))
    with pytest.raises(ValueError, match="lanes at most 32, got 32 and 33"):
        server.Batcher(MODEL, ais.device("virtual:0"), lanes=33)
    with pytest.raises(ValueError, match="max_batch must be at most 65536"):
        server.Batcher(MODEL, ais.device("virtual:0"), max_batch=65537)
    with pytest.raises(ValueError, match="give a batcher, or what to build one from"):
        server.create_app(MODEL, batcher=batcher)


# ---------------------------------------------------------------------- the app, in-process

JSON = {"content-type": "application/json"}


@contextlib.asynccontextmanager
async def _app(**options: Any) -> AsyncIterator[Any]:
    """An httpx client on ``create_app(**options)`` in this process (lifespan included): no
    sockets, and a streamed request body reaches the app chunk by chunk as it is produced."""
    import httpx

    app = server.create_app(server.Model(), "virtual:0", **options)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            yield http


# (body, index of the bad number, what the 422 shows of it)
NON_FINITE = [
    (b'{"x": [NaN, 1, 2, 3]}', 0, "NaN"),
    (b'{"x": [1, Infinity, 2, 3]}', 1, "Infinity"),
    (b'{"x": [1, 2, -Infinity, 3]}', 2, "-Infinity"),
    (b'{"x": [1, 2, 3, 1e400]}', 3, "Infinity"),  # past float64: Python's JSON reads inf
    (b'{"x": ["nan", 1, 2, 3]}', 0, "nan"),  # strings of numbers coerce to floats
    (b'{"x": [1, "-inf", 2, 3]}', 1, "-inf"),
    (b'{"x": [1, 2, "Infinity", 3]}', 2, "Infinity"),
    (b'{"x": [1, 2, 3, 3.5e38]}', 3, 3.5e38),  # a finite float64, but inf as float32
]


async def test_non_finite_numbers_get_422_naming_the_number() -> None:
    async with _app() as http:
        for body, index, shown in NON_FINITE:
            reply = await http.post("/infer", content=body, headers=JSON)
            assert reply.status_code == 422, (body, reply.text)
            [error] = reply.json()["detail"]
            assert error["type"] == "finite_number", body
            assert error["loc"] == ["body", "x", index], body
            assert error["input"] == shown, body
            assert error["msg"].startswith("Input should be a finite number"), body
            assert "float32" in error["msg"], body
        # the extremes of float32 and its denormals still pass, and come back as sent
        edge = [3.4e38, -3.4e38, 1e-45, -0.0]
        reply = await http.post("/infer", json={"x": edge})
        assert reply.status_code == 200, reply.text
        assert reply.json()["y"] == np.asarray(edge, np.float32).tolist()


async def test_a_422_echoes_a_bounded_excerpt_of_the_input() -> None:
    echo = server.ECHO_CHARS
    async with _app() as http:
        # a 500 kB string where a list should be: the reply shows its first ECHO_CHARS only
        reply = await http.post("/infer", json={"x": "a" * 500_000})
        assert reply.status_code == 422
        assert reply.json() == {
            "detail": [
                {
                    "type": "list_type",
                    "loc": ["body", "x"],
                    "msg": "Input should be a valid list",
                    "input": "a" * echo,
                    "input_truncated": True,
                }
            ]
        }
        assert len(reply.content) < echo + 200
        # a body that is not an object: its excerpt is cut the same way
        reply = await http.post("/infer", content=b"z" * 500_000)
        assert reply.status_code == 422
        [error] = reply.json()["detail"]
        assert (error["loc"], error["input"], error["input_truncated"]) == (
            ["body"],
            "z" * echo,
            True,
        )
        assert len(reply.content) < echo + 300
        # a list too long to show: the excerpt is the start of its JSON text
        reply = await http.post("/infer", json=[1.5] * 100_000)
        assert reply.status_code == 422
        [error] = reply.json()["detail"]
        assert error["input"] == json.dumps([1.5] * 100_000)[:echo]
        assert error["input_truncated"] is True
        assert len(reply.content) < echo + 300
        # 100,000 bad numbers: the first few errors, and how many more there were
        reply = await http.post("/infer", json={"x": ["a"] * 100_000})
        assert reply.status_code == 422
        body = reply.json()
        assert len(body["detail"]) == server.MAX_ERRORS
        assert body["errors_omitted"] == 100_000 - server.MAX_ERRORS
        assert body["detail"][0] == {
            "type": "float_parsing",
            "loc": ["body", "x", 0],
            "msg": "Input should be a valid number, unable to parse string as a number",
            "input": "a",
        }
        assert len(reply.content) < 2_000
        # a short input comes back whole, unmarked
        reply = await http.post("/infer", json={"x": "abc"})
        assert reply.status_code == 422
        assert reply.json()["detail"][0]["input"] == "abc"
        assert "input_truncated" not in reply.json()["detail"][0]


def _padded(size: int) -> bytes:
    """A valid request of exactly ``size`` bytes (JSON allows the spaces)."""
    body = b'{"x": [1, 2, 3, 4]}'
    return body + b" " * (size - len(body))


async def test_a_body_past_the_limit_gets_413_before_it_is_read() -> None:
    import httpx

    class Chunks(httpx.AsyncByteStream):
        """``n`` chunks of 100 spaces, counting those taken (an iterator, not an async
        generator: one left unfinished would warn when collected)."""

        def __init__(self, n: int) -> None:
            self.n, self.sent = n, 0

        def __aiter__(self) -> Chunks:
            return self

        async def __anext__(self) -> bytes:
            if self.sent == self.n:
                raise StopAsyncIteration
            self.sent += 1
            return b" " * 100

    def streamed(body: Chunks, **headers: str) -> httpx.Request:
        return httpx.Request("POST", "http://app/infer", headers={**JSON, **headers}, stream=body)

    limit = 1024
    async with _app(max_body_bytes=limit) as http:
        # at the limit: served
        reply = await http.post("/infer", content=_padded(limit), headers=JSON)
        assert reply.status_code == 200, reply.text
        # one byte past it, by Content-Length: refused before a byte of the body is read
        reply = await http.post("/infer", content=_padded(limit + 1), headers=JSON)
        assert reply.status_code == 413
        assert reply.json() == {
            "detail": f"the request body ({limit + 1} bytes) exceeds the limit of {limit} bytes"
        }
        body = Chunks(1000)
        reply = await http.send(streamed(body, **{"content-length": "100000"}))
        assert (reply.status_code, body.sent) == (413, 0)
        # chunked, no Content-Length: refused once the bytes read pass the limit; the rest of
        # the 100 kB is never read (11 chunks of 100 bytes pass 1024)
        body = Chunks(1000)
        reply = await http.send(streamed(body, **{"transfer-encoding": "chunked"}))
        assert "content-length" not in reply.request.headers
        assert reply.status_code == 413
        assert reply.json() == {"detail": f"the request body exceeds the limit of {limit} bytes"}
        assert body.sent == 11
        # the same body within a larger limit is read to its end (and is no JSON: 422)
        async with _app(max_body_bytes=100_000) as roomy:
            body = Chunks(1000)
            reply = await roomy.send(streamed(body, **{"transfer-encoding": "chunked"}))
            assert (reply.status_code, body.sent) == (422, 1000)
        # /health is untouched, and the next request is served
        assert (await http.get("/health")).status_code == 200
        reply = await http.post("/infer", json={"x": [1, 2, 3, 4]})
        assert reply.status_code == 200 and reply.json()["y"] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_body_bytes"):
        server.create_app(max_body_bytes=0)


async def test_the_default_body_limit_is_max_body_bytes() -> None:
    limit = server.MAX_BODY_BYTES
    assert limit == 1 << 20
    async with _app() as http:
        reply = await http.post("/infer", content=_padded(limit), headers=JSON)
        assert reply.status_code == 200, reply.text
        reply = await http.post("/infer", content=_padded(limit + 1), headers=JSON)
        assert reply.status_code == 413


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (
            b'{"x": [' + b"1" * 5000 + b", 1, 2, 3]}",
            "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits",
        ),
        (b'{"x": [1, 2, 3, 4]}\xff', "not UTF-8 (invalid start byte at byte 19)"),
    ],
    ids=["nested", "long-integer", "not-utf8"],
)
async def test_json_python_cannot_parse_is_a_422_like_any_malformed_json(
    body: bytes, error: str
) -> None:
    """Bodies on which Python's JSON parser fails other than with JSONDecodeError answer 422
    ``json_invalid`` (FastAPI alone answers them 400), naming why."""
    async with _app() as http:
        reply = await http.post("/infer", content=body, headers=JSON)
        assert reply.status_code == 422, reply.text
        assert reply.json() == {
            "detail": [
                {
                    "type": "json_invalid",
                    "loc": ["body", 0],
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": error},
                }
            ]
        }
        # nesting within the limit parses, and is a wrong type
        reply = await http.post("/infer", content=b'{"x": [[1], 2, 3, 4]}', headers=JSON)
        assert reply.status_code == 422 and reply.json()["detail"][0]["type"] == "float_type"


async def _post_and_leave(app: Any, leave_after_s: float) -> list[Any]:
    """POST /infer to the ASGI ``app`` directly, as a client that sends its whole request and
    disconnects ``leave_after_s`` later (its server's next message is ``http.disconnect``);
    return what the app sent."""
    body = b'{"x": [1, 2, 3, 4]}'
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/infer",
        "raw_path": b"/infer",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"19")],
        "client": ("127.0.0.1", 50000),
        "server": ("app", 80),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Any] = []

    async def receive() -> Any:
        if messages:
            return messages.pop()
        await anyio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_a_client_that_disconnects_before_its_batch_launches_is_not_computed(
    virtual_time: VirtualTime,
) -> None:
    """Through the app (no server): 3 clients leave after 1 s while their batch gathers for
    up to 5 s, one stays. The batch launches with the one only; /stats counts the 3 dropped
    and the 1 served."""
    import httpx

    app = server.create_app(MODEL, "virtual:0", max_wait_s=5.0, max_batch=8, lanes=1)
    replies: list[list[Any]] = []

    async def client(leave_after_s: float) -> None:
        replies.append(await _post_and_leave(app, leave_after_s))

    async with app.router.lifespan_context(app):
        async with anyio.create_task_group() as tg:
            for leave_after_s in (1.0, 1.0, 1.0, 100.0):
                tg.start_soon(client, leave_after_s)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            stats = (await http.get("/stats")).json()
    statuses = sorted(sent[0]["status"] for sent in replies)
    assert statuses == [200, 499, 499, 499]
    [answer] = [sent for sent in replies if sent[0]["status"] == 200]
    assert json.loads(answer[1]["body"]) == {"y": [1, 2, 3, 4], "batch": 1}
    assert {k: stats[k] for k in ("served", "dropped", "abandoned", "batches")} == {
        "served": 1,
        "dropped": 3,
        "abandoned": 0,
        "batches": 1,
    }
    [compute] = [op for op in ais.virtual.timeline() if op.engine == "compute"]
    assert compute.end - compute.start == pytest.approx(MODEL.cost(1))


# ---------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    args = ["--device", "virtual:0", "--launch-ms", "40", "--per-item-ms", "1.25"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(ROOT))  # the server runs this checkout's aiostream
        with client.serving(*args, "--max-batch", "32") as url:
            yield url


def test_bad_requests_get_422(url: str) -> None:
    import httpx

    short = httpx.post(url + "/infer", json={"x": [1.0, 2.0]})
    assert short.status_code == 422 and "x must hold 4 numbers, got 2" in short.text
    assert httpx.post(url + "/infer", content=b"not json").status_code == 422
    assert httpx.post(url + "/infer", json={"x": ["a", 1, 2, 3]}).status_code == 422
    nan = httpx.post(url + "/infer", content=b'{"x": [1, NaN, 2, 3]}', headers=JSON)
    assert nan.status_code == 422 and nan.json()["detail"][0]["loc"] == ["body", "x", 1]
    big = httpx.post(url + "/infer", json={"x": "a" * 200_000})
    assert big.status_code == 422 and len(big.content) < server.ECHO_CHARS + 200


def test_the_server_refuses_a_body_past_max_body_bytes(url: str) -> None:
    """Through uvicorn, at the default limit (1 MiB): a 2 MiB body gets 413 whether it says its
    size (Content-Length) or streams it (chunked); the connection and the server serve on."""
    import httpx

    def chunked(n: int) -> Iterator[bytes]:
        for _ in range(n):
            yield b" " * 65536

    with httpx.Client(base_url=url, timeout=30.0) as http:
        reply = http.post("/infer", content=b" " * (2 << 20), headers=JSON)
        assert reply.status_code == 413
        assert "exceeds the limit of 1048576 bytes" in reply.json()["detail"]
        reply = http.post("/infer", content=chunked(32), headers=JSON)
        assert reply.request.headers["transfer-encoding"] == "chunked"
        assert reply.status_code == 413
        assert http.get("/health").status_code == 200
        reply = http.post("/infer", json={"x": [1, 2, 3, 4]})
        assert reply.status_code == 200 and reply.json()["y"] == [1, 2, 3, 4]


def test_max_body_bytes_is_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    args = ["--device", "virtual:0", "--max-body-bytes", "64"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(ROOT))
        with client.serving(*args) as url:
            assert httpx.post(url + "/infer", content=_padded(64), headers=JSON).status_code == 200
            assert httpx.post(url + "/infer", content=_padded(65), headers=JSON).status_code == 413
    with pytest.raises(SystemExit) as exit:
        server.main(["--max-body-bytes", "0"])
    assert exit.value.code == 2
    assert "--max-body-bytes must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_the_server_under_load_batches_and_leaves_nothing_behind(url: str) -> None:
    """128 clients for 2 s (real time) against a device bound of 400 requests/s: every request
    answered, in batches, never faster than the device allows, /health answered throughout,
    and nothing left queued or pending. How close it comes to the bound, and /health's
    latency, are speed figures: benchmarks/bench_server.py measures them against baselines."""
    result = client.measure(url, clients=128, seconds=2.0)
    assert result["errors"] == []
    assert result["requests"] > 0
    assert result["of_bound"] <= 1.05, result  # the device is the limit: never above it
    assert result["mean_batch"] >= 2, result  # 128 clients at once: requests share batches
    assert result["health"]["p50_ms"] >= 0  # answered: it raises with no answer at all
    stats = client.stats(url)
    assert stats["served"] >= result["requests"]
    assert (stats["queued"], stats["in_flight"], stats["pending_waits"]) == (0, 0, 0)


def test_metrics_are_served_for_prometheus(url: str) -> None:
    """/metrics over loopback, as Prometheus scrapes it: every batch's wait in the latency
    histogram, the bytes the batches copied each way, no wait pending between requests."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(3):
        assert httpx.post(url + "/infer", json={"x": [1, 2, 3, 4]}).status_code == 200
    scrape = httpx.get(url + "/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape.text)
        for s in family.samples
    }

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= set(ls))

    assert total("aiostream_wait_seconds_count", device="virtual:0", outcome="completed") >= 3
    assert total("aiostream_copied_bytes_total", device="virtual:0", direction="h2d") > 0
    assert total("aiostream_copied_bytes_total", device="virtual:0", direction="d2h") > 0
    assert total("aiostream_stuck_waits") == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_health_answers_while_a_batch_waits_on_the_device(
    virtual_device: ais.Device,
) -> None:
    """/health never waits out a batch: with the device stalled, a request's batch stays
    pending, and /health answers 200 meanwhile, from the same loop."""
    stall = ais.virtual.stall("compute")
    async with _app() as http:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(http.post, "/infer", json={"x": [1, 2, 3, 4]}))
            await until(lambda: ais.pending_waits() != [], "the batch to wait on the device")
            for _ in range(3):
                assert (await http.get("/health")).status_code == 200
            assert ais.pending_waits() != []  # the batch is still waiting
            stall.release()
    assert ais.pending_waits() == []


@pytest.mark.slow
def test_server_benchmark_smoke_run() -> None:
    """bench_server.py runs end to end, --json included (its figures are not judged here)."""
    proc = run_python("benchmarks/bench_server.py", "--quick", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["bound_rps"] for r in report["rows"]] == [100.0, 400.0]
    assert all(r["errors"] == 0 and r["rps"] > 0 for r in [*report["rows"], report["blocking"]])
    assert report["blocking"]["blocking"] and report["http_ceiling_rps"] > 0


def test_the_clients_report_fits_100_columns() -> None:
    summary = {
        "requests": 123_456_789, "seconds": 12_345.6, "rps": 1_234_567.0, "of_bound": 0.99,
        "bound_rps": 1_250_000.0, "mean_batch": 31.9,
        "health": {"p50_ms": 1_234.5, "p99_ms": 98_765.4}, "errors": ["x"] * 1000,
    }  # fmt: skip
    text = client.report(summary, 100_000)
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert "1234567 req/s" in text and "1000 errors" in text

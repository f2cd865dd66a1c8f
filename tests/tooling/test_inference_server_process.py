"""examples/inference_server.py as a program: its flags checked before it serves, the
addresses it cannot listen on, clients that give up, and its shutdown (real servers on
loopback ports, in subprocesses)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import aiostream as ais
from tests.helpers.process import ROOT, import_example

for _dist in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_dist, reason='the server example needs pip install -e ".[server]"')

server = import_example("inference_server")
client = import_example("inference_client")


# ---------------------------------------------------------------------- flags and addresses


@pytest.mark.parametrize(
    "flags",
    [
        ["--launch-ms", "-5"],
        ["--launch-ms", "nan"],
        ["--per-item-ms", "inf"],
        ["--max-wait-ms", "nan"],
        ["--max-wait-ms", "-1"],
        ["--lanes", "0"],
        ["--max-batch", "0"],
        ["--max-queue", "0"],
        ["--stuck-after", "0"],
        ["--stuck-after", "nan"],
        ["--port", "-1"],
        ["--port", "70000"],
        ["--device", "virtual:5"],
        ["--device", "cuda:7"],
        # a full batch past MAX_BATCH_S on the device (past ~9.2e9 s, every batch failed)
        ["--launch-ms", "1e300"],
        ["--launch-ms", "1e15"],
        ["--per-item-ms", "1e12"],
        ["--launch-ms", "60001", "--per-item-ms", "0"],
        ["--per-item-ms", "62.5", "--max-batch", "961", "--launch-ms", "0"],
        ["--max-batch", "10000000000"],
        ["--max-batch", "65537"],
        ["--lanes", "100000000"],
        ["--lanes", "33"],
    ],
    ids=" ".join,
)
def test_a_bad_flag_is_a_usage_error_before_serving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    """Each bad value is refused at start, with exit status 2 and the flag named, rather
    than a server whose every answer is 500, a failed startup or a traceback."""
    monkeypatch.setattr("uvicorn.Server.run", _never_serve)
    with pytest.raises(SystemExit) as exit:
        server.main([*flags, "--port", "0"])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert f"{flags[0]}" in err and "error:" in err, err
    assert "Traceback" not in err and "serving on" not in out


def _never_serve(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the server started serving")


@pytest.mark.parametrize(
    "flags",
    [
        ["--launch-ms", "60000", "--per-item-ms", "0"],  # a full batch of MAX_BATCH_S
        ["--per-item-ms", "62.5", "--max-batch", "960", "--launch-ms", "0"],
        ["--max-batch", "65536", "--per-item-ms", "0.5"],  # MAX_BATCH
        ["--lanes", "32"],  # MAX_LANES
    ],
    ids=" ".join,
)
def test_flags_at_their_bounds_serve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    served = []
    monkeypatch.setattr("uvicorn.Server.run", lambda self, sockets: served.append(sockets))
    server.main([*flags, "--device", "virtual:0", "--port", "0"])
    assert len(served) == 1 and capsys.readouterr().out.startswith("serving on http://")
    served[0][0].close()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-batch", "1e3"], "argument --max-batch: '1e3' is not an integer"),
        (["--lanes", "2.5"], "argument --lanes: '2.5' is not an integer"),
        (["--max-wait-ms", "x"], "argument --max-wait-ms: 'x' is not a number"),
        (["--lanes", "33"], "--lanes: must be an integer at least 1 and at most 32, got 33"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_bad_number_says_what_kind_it_must_be(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    says: str,
) -> None:
    monkeypatch.setattr("uvicorn.Server.run", _never_serve)
    with pytest.raises(SystemExit) as exit:
        server.main([*flags, "--port", "0"])
    assert exit.value.code == 2
    assert says in capsys.readouterr().err


def test_the_lanes_are_built_before_the_server_listens(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Allocating the lanes' buffers fails (out of memory, say): a usage error naming the
    flags that size them, before "serving on", not a failed startup once serving."""

    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise ais.AiostreamError("out of pinned memory")

    monkeypatch.setattr(server, "Batcher", no_memory)
    monkeypatch.setattr("uvicorn.Server.run", _never_serve)
    with pytest.raises(SystemExit) as exit:
        server.main(["--device", "virtual:0", "--port", "0", "--lanes", "3"])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert "--lanes 3 --max-batch 32: out of pinned memory" in err, err
    assert "serving on" not in out


def test_an_address_that_cannot_be_listened_on_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("uvicorn.Server.run", _never_serve)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit:
            server.main(["--device", "virtual:0", "--port", str(port)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --host 127.0.0.1 --port {port}: Address already in use" in err, err
    with pytest.raises(SystemExit) as exit:
        server.main(["--device", "virtual:0", "--port", "0", "--host", "no-such-host.invalid"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "error: --host no-such-host.invalid --port 0: " in err and "Traceback" not in err


def _give_up(url: str, count: int) -> list[socket.socket]:
    """``count`` clients that each send a whole /infer request (and will not wait for it)."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"x": [1, 2, 3, 4]}'
    head = (
        f"POST /infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    clients = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(head + body)
        clients.append(sock)
    return clients


@pytest.mark.slow
def test_requests_whose_clients_gave_up_are_not_computed() -> None:
    """Clients that send a request and disconnect while it is queued (a slow device): the
    server drops their requests instead of computing each, so a new client is served next.
    One lane of batches of 4, each 2 s on the device: 20 clients queue 16 behind the first
    batch, then leave."""
    args = ["--device", "virtual:0", "--launch-ms", "2000", "--per-item-ms", "0"]
    args += ["--max-batch", "4", "--lanes", "1", "--max-wait-ms", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(ROOT))
        with client.serving(*args) as url:
            gone = _give_up(url, 20)
            deadline = time.monotonic() + 30
            while client.stats(url)["queued"] < 16:  # every request read and queued
                assert time.monotonic() < deadline, client.stats(url)
                time.sleep(0.01)
            for sock in gone:
                sock.close()
            reply = client.httpx.post(url + "/infer", json={"x": [5, 6, 7, 8]}, timeout=60)
            assert reply.status_code == 200 and reply.json()["y"] == [5, 6, 7, 8]
            stats = client.stats(url)
    # the first batch (4, on the device as they left) ran for nobody; the 16 queued were
    # dropped, but for a batch that a busy machine let start before their disconnects were
    # seen; served counts the one reply taken
    assert stats["served"] == 1, stats
    assert stats["served"] + stats["dropped"] + stats["abandoned"] == 21, stats
    assert stats["dropped"] >= 12, stats
    assert (stats["queued"], stats["in_flight"]) == (0, 0), stats


def _free_port() -> int:
    """A port from 18000-19999 that nothing listens on now."""
    for port in random.Random().sample(range(18000, 20000), 200):
        with contextlib.suppress(OSError), socket.create_server(("127.0.0.1", port)):
            return port
    raise RuntimeError("no free port in 18000-19999")


def _status(sock: socket.socket) -> int:
    """The status of the reply on ``sock`` (HTTP/1.1), once it comes."""
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, f"the connection closed without a reply: {head!r}"
        head += chunk
    return int(head.split()[1])


@contextlib.contextmanager
def _slow_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The server in a subprocess (one lane of batches of 4, each 4 s on the device, a batch
    waiting up to 300 ms to fill) on a port of 18000-19999: its process and URL."""
    args = ["--device", "virtual:0", "--launch-ms", "4000", "--per-item-ms", "0"]
    args += ["--max-batch", "4", "--lanes", "1", "--max-wait-ms", "300"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(client.SERVER), *args, "--port", str(_free_port())]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving on "), (line, proc.stderr and proc.stderr.read())
        url = line.split()[2]
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(client.httpx.TransportError):
                client.httpx.get(url + "/health", timeout=5.0).raise_for_status()
                break
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@contextlib.contextmanager
def _queue_17(url: str) -> Iterator[tuple[list[socket.socket], list[socket.socket]]]:
    """17 clients: 4 whose batch runs, then 13 queued behind it (their sockets)."""
    running, queued = _give_up(url, 4), []
    try:
        deadline = time.monotonic() + 30
        while client.stats(url)["in_flight"] < 1:
            assert time.monotonic() < deadline, client.stats(url)
            time.sleep(0.01)
        queued = _give_up(url, 13)
        while client.stats(url)["queued"] < 13:
            assert time.monotonic() < deadline, client.stats(url)
            time.sleep(0.01)
        yield running, queued
    finally:
        for sock in running + queued:
            sock.close()


@pytest.mark.slow
def test_shutdown_answers_the_queued_503_at_once_and_finishes_the_running_batch() -> None:
    """SIGINT with 13 requests queued behind a running batch of 4 (4 s a batch): the 13 get
    503 at once, the batch's 4 get their replies, and the server exits cleanly once it ends
    (not after computing every queued request: 4 more batches, 16 s)."""
    with _slow_server() as (proc, url), _queue_17(url) as (running, queued):
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert [_status(sock) for sock in queued] == [503] * 13
        assert time.monotonic() - signalled < 3.0
        assert [_status(sock) for sock in running] == [200] * 4
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - signalled < 8.0
        assert proc.returncode == 0 and err == "", err


@pytest.mark.slow
def test_a_second_sigint_answers_the_running_batch_503_without_tracebacks() -> None:
    """A second SIGINT (uvicorn's forced exit) while the batch runs: its requests get 503
    too, at once, and the server exits with nothing on stderr (no traceback per request)."""
    with _slow_server() as (proc, url), _queue_17(url) as (running, queued):
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert [_status(sock) for sock in queued] == [503] * 13
        proc.send_signal(signal.SIGINT)
        assert [_status(sock) for sock in running] == [503] * 4
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - signalled < 3.5  # before the running batch's 4 s were up
        assert proc.returncode == 0 and err == "", err

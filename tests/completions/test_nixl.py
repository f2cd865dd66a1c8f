"""``aiostream.wait()`` of NIXL transfer handles, with NIXL's CPU backends (no GPU, no driver):
POSIX moves host memory to and from a file in ``tmp_path``, UCX writes between two agents of
this process. The handle is asked (its agent's transfer state) until DONE; a cancelled wait
releases it, which aborts the transfer; a failed one raises NIXL's error."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.deadlines import deadline

np = pytest.importorskip("numpy", reason="needs numpy: pip install numpy")
nixl = pytest.importorskip("nixl_cu12._api", reason="needs NIXL: pip install nixl-cu12")

pytestmark = pytest.mark.anyio

MB = 1 << 20
_names = itertools.count()


def _agent(backend: str) -> Any:
    """A fresh agent per test: one whose transfer was aborted is not used again."""
    config = nixl.nixl_agent_config(backends=[backend])
    return nixl.nixl_agent(f"{backend.lower()}-{next(_names)}", config)


class _File:
    """Host memory and a file, registered with a POSIX agent, moved in ``pieces``."""

    def __init__(self, path: Path, size: int, *, file_size: int | None = None) -> None:
        self.agent = _agent("POSIX")
        self.size = size
        self.memory = np.zeros(size, np.uint8)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, size if file_size is None else file_size)
        address = self.memory.ctypes.data
        self.agent.register_memory(self.agent.get_reg_descs([(address, size, 0, "")], "DRAM"))
        self.agent.register_memory(self.agent.get_reg_descs([(0, size, self.fd, "")], "FILE"))

    def transfer(self, operation: str, pieces: int = 1) -> Any:
        step, address = self.size // pieces, self.memory.ctypes.data
        memory = [(address + i * step, step, 0) for i in range(pieces)]
        file = [(i * step, step, self.fd) for i in range(pieces)]
        handle = self.agent.initialize_xfer(
            operation,
            self.agent.get_xfer_descs(memory, "DRAM"),
            self.agent.get_xfer_descs(file, "FILE"),
            self.agent.name,
        )
        self.agent.transfer(handle)
        return handle

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def file(tmp_path: Path) -> Iterator[_File]:
    made = _File(tmp_path / "shard.bin", 8 * MB)
    yield made
    made.close()


async def test_a_posix_write_and_read_are_awaited_until_done(file: _File) -> None:
    written = np.arange(file.size, dtype=np.uint64).astype(np.uint8)
    file.memory[:] = written
    with deadline(30, "a NIXL POSIX write"):
        handle = file.transfer("WRITE", pieces=64)
        await ais.wait(handle, what="shard 0 to disk")
        assert file.agent.check_xfer_state(handle) == "DONE"
        handle.release()
    file.memory[:] = 0
    with deadline(30, "a NIXL POSIX read"):
        handle = file.transfer("READ", pieces=64)
        await ais.wait(handle)
        handle.release()
    assert np.array_equal(file.memory, written)


async def test_a_pending_transfer_is_polled_and_listed(tmp_path: Path) -> None:
    file = _File(tmp_path / "big.bin", 64 * MB)
    try:
        with deadline(60, "a 64 MB NIXL POSIX write"):
            handle = file.transfer("WRITE", pieces=256)
            listed = []

            async def look() -> None:
                listed.extend(ais.pending_waits())

            async with anyio.create_task_group() as tg:
                tg.start_soon(look)
                await ais.wait(handle, what="the KV cache")
            assert file.agent.check_xfer_state(handle) == "DONE"
            handle.release()
    finally:
        file.close()
    for wait in listed:  # empty where the write was done when it was first asked
        assert (wait.device, wait.strategy) == ("nixl", "poll")
        assert wait.subject.startswith("the KV cache: nixl transfer 0x")


async def test_a_cancelled_wait_releases_the_transfer_at_once(tmp_path: Path) -> None:
    file = _File(tmp_path / "big.bin", 64 * MB)
    try:
        handle = file.transfer("WRITE", pieces=256)
        if file.agent.check_xfer_state(handle) == "DONE":  # pragma: no cover - a fast disk
            pytest.fail("the 64 MB write was done before it could be cancelled")
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="cancelled by its adapter"):
            await ais.wait(handle, timeout=0.001)
        assert time.monotonic() - start < 1.0
        assert "released=True" in repr(handle)  # NIXL aborted it
    finally:
        file.close()


async def test_a_failed_transfer_raises_nixls_error(tmp_path: Path) -> None:
    file = _File(tmp_path / "short.bin", 4 * MB, file_size=MB)  # reads past its end
    try:
        handle = file.transfer("READ")
        with pytest.raises(ais.CompletionError) as raised, deadline(30, "a failing read"):
            await ais.wait(handle, what="a short read")
        assert raised.value.kind == "nixl"
        assert type(raised.value.__cause__).__name__ == "nixlBackendError"
        assert "NIXL_ERR_BACKEND" in str(raised.value)
        handle.release()
    finally:
        file.close()


async def test_a_handle_not_yet_posted_raises_nixls_error(file: _File) -> None:
    handle = file.agent.initialize_xfer(
        "WRITE",
        file.agent.get_xfer_descs([(file.memory.ctypes.data, MB, 0)], "DRAM"),
        file.agent.get_xfer_descs([(0, MB, file.fd)], "FILE"),
        file.agent.name,
    )
    with pytest.raises(ais.CompletionError, match="NIXL_ERR_NOT_POSTED") as raised:
        await ais.wait(handle)
    assert type(raised.value.__cause__).__name__ == "nixlNotPostedError"
    handle.release()


async def test_a_released_handle_is_refused_not_asked(file: _File) -> None:
    handle = file.transfer("WRITE")
    while file.agent.check_xfer_state(handle) != "DONE":
        await anyio.sleep(0.001)
    handle.release()
    with pytest.raises(ais.CompletionError, match="was released") as raised:
        await ais.wait(handle)
    assert isinstance(raised.value.__cause__, ValueError)


async def test_a_remote_write_is_awaited_by_both_agents_over_ucx() -> None:
    """The initiator awaits its handle (DONE: written); the target awaits the notification
    the write carries, through an object whose ``done()`` looks for it."""
    initiator, target = _agent("UCX"), _agent("UCX")
    size = 4 * MB
    source = np.arange(size, dtype=np.uint64).astype(np.uint8)
    sink = np.zeros(size, np.uint8)
    initiator.register_memory(initiator.get_reg_descs([(source.ctypes.data, size, 0, "")], "DRAM"))
    target.register_memory(target.get_reg_descs([(sink.ctypes.data, size, 0, "")], "DRAM"))
    initiator.add_remote_agent(target.get_agent_metadata())
    target.add_remote_agent(initiator.get_agent_metadata())

    class Notified:
        def done(self) -> bool:
            return bool(target.check_remote_xfer_done(initiator.name, b"layer 7"))

    async def write() -> None:
        handle = initiator.initialize_xfer(
            "WRITE",
            initiator.get_xfer_descs([(source.ctypes.data, size, 0)], "DRAM"),
            target.get_xfer_descs([(sink.ctypes.data, size, 0)], "DRAM"),
            target.name,
            b"layer 7 of the KV cache",
        )
        initiator.transfer(handle)
        await ais.wait(handle, what="layer 7 to the decoder")
        handle.release()

    with deadline(30, "a NIXL UCX write and its notification"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await ais.wait(Notified(), what="layer 7 from the prefill")
    assert np.array_equal(sink, source)

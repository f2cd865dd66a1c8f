"""``aiostream.wait()`` of JAX arrays (``is_ready()``, asked by the loop's poller): a result
still being computed is awaited without blocking the loop."""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from tests.helpers.deadlines import deadline

jnp = pytest.importorskip("jax.numpy", reason="needs JAX: pip install jax")

pytestmark = pytest.mark.anyio


async def test_an_array_being_computed_is_awaited() -> None:
    a = jnp.ones((1500, 1500), dtype=jnp.float32)
    product = a
    for _ in range(4):  # a few hundred milliseconds of a CPU's time: pending when awaited
        product = product @ a / 1500
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.sleep(0)

    with deadline(60, "a JAX array"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(count_turns)
            await ais.wait(product, what="the logits")
            tg.cancel_scope.cancel()
    assert turns >= 1  # the loop ran while the array was computed
    assert product.is_ready()
    assert float(product[0, 0]) == pytest.approx(1.0)


async def test_a_pending_array_is_listed_with_its_shape() -> None:
    a = jnp.ones((1500, 1500), dtype=jnp.float32)
    product = a @ a @ a @ a
    listed = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: ais.wait(product, what="logits"))
        await anyio.sleep(0)
        listed = ais.pending_waits()
        tg.cancel_scope.cancel()
    product.block_until_ready()
    if listed:  # else the CPU was quicker than one loop turn
        [wait] = listed
        assert wait.device == "jax"
        assert wait.subject == "logits: array float32[1500, 1500]"

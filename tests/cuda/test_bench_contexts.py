"""The CUDA bench's baselines retain cuda:0's primary context themselves (as a program of its
own would) around aiostream's first use: the driver is initialised first, and their release
takes only their own reference, so aiostream's context, with its streams, events and
completion flags, stays alive (a release before ``cuInit``'s retain reset it: a later
finalizer read flag memory already unmapped, and crashed)."""

from __future__ import annotations

import pytest

from tests.helpers.cuda import program

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


def test_a_baselines_context_around_the_first_use_leaves_aiostreams_alone() -> None:
    result = program(
        """
        import gc, anyio, aiostream as ais
        from aiostream._bench.cuda import primary_context

        async def main():
            with primary_context():  # the process's first use of the driver
                s = ais.Stream("cuda:0")
                from tests.helpers.stand_in import FAKE  # (its hooks, loaded only now)

                def refs():  # the stand-in counts a context's references; a GPU's driver not
                    return FAKE.fake_cuda_context_refs(0) if FAKE is not None else None

                e = ais.Event("cuda:0")
                ais.delay(0.001, stream=s)
                e.record(s)
                await e.synchronize()
                assert refs() in (2, None)
            assert refs() in (1, None)  # aiostream's
            for _ in range(3):
                ais.delay(0.001, stream=s)
                e.record(s)
                await e.synchronize()
            del e
            events = [s.record_event() for _ in range(10)]
            await events[-1].synchronize()
            del events
            gc.collect()
            print("ok", flush=True)

        anyio.run(main)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]

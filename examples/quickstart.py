"""README's quick start (this file is its code block, but for the output line the docs tests
check): time 20 ms of device work and await it without blocking the loop."""

import anyio

import aiostream as ais


async def main():
    s = ais.Stream()  # on the default device: virtual:0 without a GPU
    ais.delay(0.005, stream=s)  # 5 ms of device work: what follows queues behind it
    start = s.record_event(ais.Event(enable_timing=True))  # timed when the stream reaches it
    ais.delay(0.020, stream=s)  # 20 ms of device work
    end = s.record_event(ais.Event(enable_timing=True))
    await end  # the same as await end.synchronize(): suspends this task only
    print(f"{start.elapsed_time(end):.1f} ms")  # exact on a virtual device, about that on a GPU


anyio.run(main)  # or backend="trio" (the [trio] extra), or asyncio with uvloop ([uvloop]):
# anyio.run(main, backend_options={"use_uvloop": True})

"""README's quick start: time 20 ms of device work and await it without blocking the loop."""

import anyio

import aiostream as ais


async def main() -> None:
    s = ais.Stream()  # on the default device: virtual:0 without a GPU
    start = s.record_event(ais.Event(enable_timing=True))
    ais.delay(0.020, stream=s)  # 20 ms of device work
    end = s.record_event(ais.Event(enable_timing=True))
    await end.synchronize()  # suspends this task only
    print(f"{start.elapsed_time(end):.1f} ms")  # about 20.0


if __name__ == "__main__":
    anyio.run(main)

"""Overlap copies with compute on two streams.

Chunk k is copied on the copy stream while chunk k-1 is computed on the compute stream; the
compute stream waits for each copy on the device (the host never blocks), and the copy stream
waits for compute to be done with a buffer before copying into it again.
"""

import anyio
import numpy as np

import aiostream as ais

CHUNKS, NBYTES = 8, 4 << 20


async def main() -> None:
    device = ais.device()
    copy, compute = ais.Stream(device), ais.Stream(device)
    host = [ais.HostBuffer(NBYTES) for _ in range(2)]
    dev = [ais.DeviceBuffer(NBYTES, device) for _ in range(2)]
    freed = [ais.Event(device), ais.Event(device)]  # compute is done with dev[i]
    start = ais.Event(device, enable_timing=True)
    end = ais.Event(device, enable_timing=True)
    start.record(copy)
    for k in range(CHUNKS):
        i = k % 2
        await freed[i].synchronize()  # host[i] may be refilled (its last copy is long done)
        host[i].numpy(np.float32)[:] = k
        copy.wait_event(freed[i])  # don't overwrite dev[i] while compute still reads it
        ais.copy_async(dev[i], host[i], stream=copy)
        compute.wait_event(copy.record_event())  # compute chunk k once it has landed
        ais.delay(0.005, stream=compute)
        freed[i].record(compute)
    compute.wait_stream(copy)
    end.record(compute)
    await end.synchronize()
    print(
        f"{CHUNKS} chunks of {NBYTES >> 20} MiB copied and computed in "
        f"{start.elapsed_time(end):.1f} ms of device time on {device}"
    )


if __name__ == "__main__":
    anyio.run(main)

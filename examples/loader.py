"""Feed a device from async Python with the DataLoader.

Host preparation, host-to-device copies and compute run at once: while the device computes on
one batch, the next ones are being prepared and copied. Runs on the default device.
"""

import anyio
import numpy as np

import aiostream as ais


def samples(n: int):
    for i in range(n):
        yield {"image": np.full((64, 64), i, np.float32), "label": np.array([i % 10])}


def normalise(item: dict) -> dict:
    return {"image": item["image"] / 255.0, "label": item["label"]}


async def main() -> None:
    model = ais.Stream()  # the stream your kernels run on
    with ais.use_stream(model):
        async with ais.DataLoader(samples(32), transform=normalise, prefetch=2) as loader:
            async for batch in loader:
                image = batch.data["image"]  # a DeviceBuffer, float32 (64, 64)
                ais.delay(0.002)  # stand-in for the model; it runs after the copy landed
        await model.synchronize()
    stats = loader.stats
    print(
        f"{stats.batches} batches; at most {stats.peak_in_use} of the loader's "
        f"{stats.pool_size} slots in use,\nwhose {stats.allocations} device buffers (an image "
        f"and a label per slot) were each allocated once;\nlast: {image}"
    )


if __name__ == "__main__":
    anyio.run(main)

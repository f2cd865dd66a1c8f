"""examples/ray_actors.py and examples/ray_transfers.py on one local Ray instance (two CPUs,
started and shut down here, once for the module: Ray takes seconds to start)."""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.process import ROOT, import_example, run_python

pytestmark = pytest.mark.slow  # a Ray instance of its own: seconds to start

ray = pytest.importorskip("ray", reason='the Ray example needs pip install -e ".[ray]"')


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # Ray's workers import the actor's module by name, and inherit the environment of the
    # processes ray.init() starts: they get the checkout and examples/.
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "examples")]))
        # JAX, where an earlier test imported it, warns at each fork that ray.init() makes
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def example(cluster: None) -> ModuleType:
    return import_example("ray_actors")


@pytest.fixture(scope="module")
def transfers(cluster: None) -> ModuleType:
    return import_example("ray_transfers")


@pytest.fixture(scope="module")
def store(transfers: ModuleType) -> Any:
    return transfers.Store.remote()


def test_actors_run_their_jobs_and_their_traces_merge(example: ModuleType) -> None:
    actors = example.start_actors(2, gpus=False)
    assert ray.get([a.ready.remote() for a in actors]) == ["virtual:0", "virtual:1"]
    results, trace = asyncio.run(example.fan_out(actors, jobs=6, items=256, item_ms=0.05))
    assert results == [example.expected(j, 256) for j in range(6)]

    events: list[dict[str, Any]] = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(n.split(": ", 1)[1] for n in names.values()) == [
        "host tasks",
        "host tasks",
        "virtual:0",
        "virtual:1",
    ]
    assert len({n.split(":", 1)[0] for n in names.values()}) == 2  # actor 0, actor 1
    spans = [e for e in events if e.get("ph") == "B"]
    # each job's host span, on the actor that ran it (jobs go round-robin)
    for j in range(6):
        (span,) = [e for e in spans if e["name"] == f"job {j}"]
        assert names[span["pid"]].startswith(f"actor {j % 2} ")
    # device work of both actors, on one time axis that starts at the earliest profile
    device_pids = [pid for pid, n in names.items() if "virtual:" in n]
    for pid in device_pids:
        assert any(e["pid"] == pid for e in spans)
    assert min(e["ts"] for e in events if "ts" in e) >= 0.0


def test_an_actor_on_a_device_that_does_not_exist_says_so(example: ModuleType) -> None:
    actor = example.DeviceActor.remote("cuda:7")
    # the actor's constructor failed: its error, whole, is the reason every call gets
    with pytest.raises(ray.exceptions.RayActorError, match=r"'cuda' backend is unavailable|cuda:7"):
        ray.get(actor.ready.remote(), timeout=60)


def test_gpus_the_cluster_lacks_are_said_at_once(example: ModuleType) -> None:
    have = int(ray.cluster_resources().get("GPU", 0))
    assert example.missing_gpus(have) is None
    assert example.missing_gpus(have + 1) == (
        f"--gpus --actors {have + 1} needs {have + 1} GPUs (one per actor), and this Ray "
        f"cluster has {have}: "
        + (f"give --actors {have} or fewer, " if have else "")
        + "or leave out --gpus (each actor then simulates a virtual device)"
    )


def test_the_command_exits_instead_of_waiting_for_gpus() -> None:
    proc = run_python("examples/ray_actors.py", "--gpus", "--actors", "64", timeout=180)
    assert proc.returncode == 1
    assert "--gpus --actors 64 needs 64 GPUs (one per actor)" in proc.stderr


def test_an_async_actor_answers_while_it_awaits_a_transfer_and_device_work(
    transfers: ModuleType, store: Any
) -> None:
    worker = transfers.Worker.remote("virtual:0", store)
    assert ray.get(worker.ready.remote(), timeout=120) == "virtual:0"
    step, pings = asyncio.run(transfers.actor_demo(worker, n=256, transfer_s=0.2, ms=200.0))
    assert step["sum"] == 2 * sum(range(256))  # the features, through the device and back
    assert step["arrived"] - step["began"] >= 0.2  # the transfer took its time
    assert step["ended"] - step["arrived"] >= 0.2  # so did the device work
    # the loop answered during each of them, and saw the step's wait on each
    seen = {
        stage: {tuple(w) for p in pings if lo < p["at"] < hi for w in p["waits"]}
        for stage, lo, hi in (
            ("transfer", step["began"], step["arrived"]),
            ("device", step["arrived"], step["ended"]),
        )
    }
    assert ("concurrent.futures", "callback") in seen["transfer"]
    assert any(device == "virtual:0" for device, _ in seen["device"])


# Ray Data 2.60's DataContext.get_current() sets deprecated options of its own, and warns
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_a_ray_data_callable_class_overlaps_its_batches_awaits(
    transfers: ModuleType, store: Any
) -> None:
    pytest.importorskip("ray.data", reason='Ray Data needs pip install -e ".[ray]"')
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = transfers.data_demo(store, gpus=False, rows=32, batch=4, transfer_s=0.1, ms=20.0)
    assert list(rows["id"]) == list(range(32))
    assert (rows["y"] == rows["id"] * 2).all()  # fetched, through the device and back
    spans = sorted(set(zip(rows["began"], rows["ended"], strict=True)))
    assert len(spans) == 8
    assert all(end - began >= 0.1 for began, end in spans)  # each awaited its transfer
    # a loop blocked by its awaits would run the batches one at a time
    assert transfers.overlapped(spans) >= 2

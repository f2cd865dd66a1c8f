"""The adapter of ``torch.distributed``'s ``Work``: imported only once a ``Work`` is awaited,
so PyTorch is imported already (this module never imports it itself).

A ``Work`` calls back through its future (``get_future()``: gloo completes it from its worker
thread), else it is asked (``is_completed()``). It names its operation (``ALLREDUCE``), and
the default process group its backend, rank and size; the tensors' shapes and the group of a
sub-group's work are not kept by a ``Work``: give them as ``what=``.

NCCL's work is "completed" once queued on its stream: await an event recorded on that stream
after it (``aiostream.as_event``) for the device's completion, as ``docs/completions.md`` says.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ._adapters import Adapter

__all__ = ["WORK", "describe"]


def _call_back(work: Any, fn: Callable[[], None]) -> object:
    try:
        future = work.get_future()
    except RuntimeError:  # a backend or operation without futures: asked instead
        return False
    future.add_done_callback(lambda _: fn())
    return None


def describe(work: Any) -> str:
    """``ALLREDUCE (torch.distributed gloo, rank 0 of 2)``: what a ``Work`` says of itself."""
    op = "collective"
    get_op = getattr(work, "_get_op_type", None)  # the one place PyTorch keeps it
    if get_op is not None:
        try:
            code = get_op()
            c10d = sys.modules.get("torch._C._distributed_c10d")
            kind = getattr(c10d, "OpType", None)
            op = kind(code).name if kind is not None else f"op {code}"
        except Exception:  # an older or newer PyTorch: the operation stays unnamed
            pass
    dist = sys.modules.get("torch.distributed")
    where = "torch.distributed"
    try:
        if dist is not None and dist.is_initialized():
            where = (
                f"torch.distributed {dist.get_backend()}, rank {dist.get_rank()} of "
                f"{dist.get_world_size()}"
            )
    except Exception:  # the default group is being torn down
        pass
    return f"{op} ({where})"


WORK = Adapter(
    "torch.distributed",
    done="is_completed",
    call_back=_call_back,
    result=lambda work: work.wait(),
    describe=describe,
)

"""How ``aiostream.wait()`` learns that a foreign handle's work is done: one :class:`Adapter`
per kind of handle, found by the handle's type (its module's name, never an import: a library
that is not installed costs nothing), else by duck typing.

=====================================  ==========================  ============================
handle                                 how its completion is seen  what a failure raises
=====================================  ==========================  ============================
``concurrent.futures.Future``          ``add_done_callback``       the future's exception
``torch.distributed`` ``Work``         ``get_future()``'s callback  its future's error (else
                                       (else ``is_completed()``)  ``Work.wait()``'s, asked)
``torch.futures.Future``               ``add_done_callback``       ``value()``'s exception
Dask ``distributed.Future``            ``add_done_callback``       ``exception()``: never
                                                                   the task's value
``jax.Array``                          ``is_ready()``              ``block_until_ready()``'s
``aiostream.virtual.Transfer``         ``done()``, on the clock    its ``error``
NIXL ``nixl_xfer_handle``              its agent's transfer state  ``CompletionError``, NIXL's
                                       (``"DONE"``), asked         error its ``__cause__``
anything with ``add_done_callback``    the callback                ``result()``'s exception
and ``done()`` (a future)
anything with ``done()``,              asked by the loop's poller  nothing more
``is_completed()`` or ``is_ready()``
=====================================  ==========================  ============================

It imports nothing of the package: ``waits`` builds on it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

__all__ = ["Adapter", "find", "register_adapter"]


@dataclass(frozen=True)
class Adapter:
    """How ``aiostream.wait()`` learns that one kind of handle is done.

    Give ``done`` (the handle can only be asked: the loop's one poller asks it), or
    ``call_back`` (the handle calls back: nothing polls), or both (``call_back`` is used; a
    handle whose ``call_back`` returns ``False`` is asked with ``done`` instead).

    Args:
        kind: what ``pending_waits()``, the metrics and the spans call these handles, such as
            ``"nixl"``: keep it to a few values (it is a metric label).
        done: ``done(handle) -> bool``, or the name of the handle's method that says it
            (``"done"``): whether its work is done. It must not block.
        call_back: ``call_back(handle, fn)`` has ``fn()`` called once the work is done, from
            any thread, or at once; it may return ``False`` to say this handle cannot call
            back (then ``done`` is asked).
        result: ``result(handle)``, called in the waiting task once the work is done, raises
            the work's error, if it failed, as the library's own exception; what it returns
            is ignored. It must not block. Every hook is a plain function (a coroutine
            function is refused: nothing awaits what the hooks return).
        describe: ``describe(handle) -> str``: what the handle is, for ``pending_waits()``
            and the watchdog (``what=`` is put before it). It must be cheap and never block.
        on_cancel: ``on_cancel(handle)``, called when a wait on it is cancelled or times out,
            if that should cancel or release the work (NIXL's ``release_xfer_handle``,
            ``ray.cancel``); without it the work goes on, and a polled handle is kept alive
            until it is done.
        eta: ``eta(handle) -> float | None``: seconds until the work is done, where the
            handle knows it (a simulated transfer); the poller then wakes at that moment.
        accepts: ``accepts(handle) -> bool``, for :func:`register_adapter`: which handles it
            serves.
    """

    kind: str
    done: Callable[[Any], bool] | str | None = None
    call_back: Callable[[Any, Callable[[], None]], object] | None = None
    result: Callable[[Any], object] | None = None
    describe: Callable[[Any], str] | None = None
    on_cancel: Callable[[Any], object] | None = None
    eta: Callable[[Any], float | None] | None = None
    accepts: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise TypeError(f"kind must be a non-empty str, got {self.kind!r}")
        if self.done is None and self.call_back is None:
            raise TypeError(f"Adapter {self.kind!r} needs done= or call_back= (or both)")
        if isinstance(self.done, str):
            if not self.done.isidentifier():
                raise ValueError(f"done must name a method, got {self.done!r}")
        elif self.done is not None and not callable(self.done):
            raise TypeError(f"done must be a callable or a method's name, got {self.done!r}")
        for name in ("call_back", "result", "describe", "on_cancel", "eta", "accepts"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {value!r}")
            if inspect.iscoroutinefunction(value):
                raise TypeError(
                    f"{name} must be a plain function, not a coroutine function ({value!r}): "
                    "aiostream calls it in the loop's thread and never awaits what it returns"
                )


def asker(adapter: Adapter, handle: Any) -> Callable[[], bool] | None:
    """What the poller calls, without arguments, to ask ``handle``; None if it cannot."""
    done = adapter.done
    if done is None:
        return None
    if isinstance(done, str):
        method: Callable[[], bool] = getattr(handle, done)
        return method
    return lambda: done(handle)


_registered: list[Adapter] = []  # the program's own, newest first
_by_type: dict[type, Adapter | None] = {}  # the built-in choice for each type seen


def register_adapter(adapter: Adapter) -> Callable[[], None]:
    """Have ``aiostream.wait()`` use ``adapter`` for every handle its ``accepts`` takes,
    before the built-in adapters (the last registered is asked first). Returns the function
    that unregisters it.

    Example:
        >>> import aiostream as ais
        >>> class Transfer:  # a library's handle, asked through a status call
        ...     def state(self):
        ...         return "DONE"
        >>> unregister = ais.register_adapter(ais.Adapter(
        ...     kind="transfer", done=lambda h: h.state() == "DONE",
        ...     accepts=lambda h: isinstance(h, Transfer)))
        >>> unregister()
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an aiostream.Adapter, got {adapter!r}")
    if adapter.accepts is None:
        raise ValueError(f"Adapter {adapter.kind!r} needs accepts= to be registered")
    _registered.insert(0, adapter)

    def unregister() -> None:
        if adapter in _registered:
            _registered.remove(adapter)

    return unregister


def find(handle: object) -> Adapter:
    """The adapter for ``handle``: a registered one that accepts it, else the built-in one for
    its type, else a duck-typed one; TypeError if nothing says when it is done."""
    for adapter in _registered:
        if adapter.accepts is not None and adapter.accepts(handle):
            return adapter
    kind = type(handle)
    try:
        found = _by_type[kind]
    except KeyError:
        found = _by_type[kind] = _builtin(kind)
    except TypeError:  # an unhashable type: not cached
        found = _builtin(kind)
    if found is None:
        raise TypeError(
            f"aiostream.wait() cannot tell when {kind.__module__}.{kind.__qualname__} is done: "
            "it needs a handle with done(), is_completed(), is_ready() or add_done_callback(), "
            "an aiostream Event or Stream, or a CUDA event; for anything else pass "
            "adapter=aiostream.Adapter(...) or register one (aiostream.register_adapter)"
        )
    return found


# ---------------------------------------------------------------------- the built-in adapters


def _is_a(kind: type, module: str, name: str) -> bool:
    """Whether ``kind`` or a base of it is ``module``'s (or a submodule's) class ``name``."""
    for base in kind.__mro__:
        owner = base.__module__ or ""
        if base.__name__ == name and (owner == module or owner.startswith(module + ".")):
            return True
    return False


def _short(kind: type) -> str:
    return f"{kind.__module__.partition('.')[0]}.{kind.__name__}"


def _identity(handle: object) -> str:
    """A handle named without ``repr()``, which may be slow, huge or blocking (a JAX array's
    prints its values)."""
    return f"{_short(type(handle))} at 0x{id(handle):x}"


def _future_result(future: Any) -> None:
    future.result(0)  # done: never blocks; raises its error or CancelledError


def _torch_value(future: Any) -> None:
    future.value()  # raises its error


def _subscribe(handle: Any, fn: Callable[[], None]) -> None:
    handle.add_done_callback(lambda *_: fn())


def _describe_dask(future: Any) -> str:
    return f"dask task {getattr(future, 'key', '?')}"


def _describe_array(array: Any) -> str:
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    dims = ", ".join(str(d) for d in shape) if shape is not None else "?"
    return f"array {dtype}[{dims}]"


def _raise_error(handle: Any) -> None:
    result = getattr(handle, "result", None)
    if callable(result):
        result()


CONCURRENT = Adapter(
    "concurrent.futures",
    done="done",
    call_back=_subscribe,
    result=_future_result,
    describe=_identity,
)
TORCH_FUTURE = Adapter(
    "torch.futures",
    done="done",
    call_back=_subscribe,
    result=_torch_value,
    describe=_identity,
)


class Deferred:
    """What a built-in ``result`` returns where learning how the work ended takes a wait:
    ``learn(seconds)`` gives the awaitable that raises the work's error, given the seconds
    left until the wait's deadline (None: no deadline); the waiting task awaits it, until the
    deadline at most."""

    __slots__ = ("learn",)

    def __init__(self, learn: Callable[[float | None], Awaitable[object]]) -> None:
        self.learn = learn


def _dask_raise(future: Any, seconds: float | None) -> None:
    """In a worker thread: raise the task's own exception. ``exception()`` waits for Dask's
    loop thread (and a lost task's rerun), never for the value; given the wait's deadline and
    a second more, so that an abandoned thread ends too."""
    timeout = None if seconds is None else seconds + 1.0
    error = future.exception(timeout=timeout)
    if error is not None:
        raise error.with_traceback(future.traceback(timeout=timeout))
    if future.cancelled():
        future.result(timeout=timeout)  # Dask's own FutureCancelledError; no value to fetch


async def _dask_raise_async(future: Any) -> None:
    """:func:`_dask_raise`, with an asynchronous client on this loop."""
    error = await future.exception()
    if error is not None:
        raise error.with_traceback(await future.traceback())
    if future.cancelled():
        await future.result()


def _dask_error(future: Any) -> Deferred | None:
    """Nothing for a finished task; for any other, its own exception, learned by the waiting
    task (a lost task's rerun awaited first). Never ``result()`` in the loop's thread: it
    fetches the task's value and, with a synchronous client, waits for Dask's own loop thread
    to answer (measured: 47-282 ms for a 64 MB value from a worker process; the round trip
    alone, in-process, 0.6 ms). ``status`` is read where the future is."""
    if future.status == "finished":
        return None
    if future.client.asynchronous:  # the client runs on this loop
        return Deferred(lambda _: _dask_raise_async(future))
    return Deferred(
        lambda seconds: anyio.to_thread.run_sync(
            _dask_raise, future, seconds, abandon_on_cancel=True
        )
    )


DASK = Adapter(
    "dask",
    done="done",
    call_back=_subscribe,
    result=_dask_error,
    describe=_describe_dask,
)
JAX = Adapter(
    "jax", done="is_ready", result=lambda a: a.block_until_ready(), describe=_describe_array
)


# torch.distributed's Work: it calls back through its future (``get_future()``: gloo completes
# it from its worker thread), else it is asked (``is_completed()``). It names its operation
# (``ALLREDUCE``), and the default process group its backend, rank and size; the tensors'
# shapes and the group of a sub-group's work are not kept by a Work: give them as ``what=``.
# NCCL's work is "completed" once queued on its stream: await an event recorded on that stream
# after it (``aiostream.as_event``) for the device's completion (docs/completions.md). Only
# read once a Work exists, so PyTorch is imported already; never imported here.


def _work_call_back(work: Any, fn: Callable[[], None]) -> object:
    try:
        future = work.get_future()
    except RuntimeError:  # a backend or operation without futures: asked instead
        return False
    future.add_done_callback(lambda _: fn())
    return None


def _work_error(work: Any) -> None:
    """Raise the work's error without blocking: from its future, done once it called back
    (``Work.wait()`` waits for gloo's thread to run the future's other callbacks first, the
    event loop blocked meanwhile), else from ``wait()``, once ``is_completed()`` says so."""
    try:
        future = work.get_future()
    except RuntimeError:  # no future: asked, so completed already
        future = None
    if future is not None and future.done():
        future.value()
    else:
        work.wait()


def _describe_work(work: Any) -> str:
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


TORCH_WORK = Adapter(
    "torch.distributed",
    done="is_completed",
    call_back=_work_call_back,
    result=_work_error,
    describe=_describe_work,
)


def _transfer() -> Adapter:
    return Adapter(
        "virtual.transfer",
        done="done",
        result=lambda t: t.result(),
        describe=lambda t: t.describe(),
        eta=lambda t: t.remaining(),
    )


def _nixl_request(handle: Any) -> tuple[Any, int, bool]:
    """A NIXL handle's agent (the C++ one, which it releases itself with), its request, and
    whether it is released: NIXL 1.x keeps no public way from a handle to its state."""
    return handle._agent, handle._handle, handle._released  # noqa: SLF001 (NIXL's own)


def _describe_nixl(handle: Any) -> str:
    return f"nixl transfer 0x{_nixl_request(handle)[1]:x}"


def _release(handle: Any) -> None:
    handle.release()


def _nixl(kind: type) -> Adapter | None:
    """NIXL's transfer handle is asked as its agent's ``check_xfer_state()`` asks, done once
    DONE; a failed transfer's status raises NIXL's error (``NIXL_ERR_BACKEND``). A cancelled
    wait releases it, which aborts the transfer."""
    bindings = sys.modules.get(kind.__module__.rpartition(".")[0] + "._bindings")
    success = getattr(bindings, "NIXL_SUCCESS", None)
    in_progress = getattr(bindings, "NIXL_IN_PROG", None)
    fields = ("_agent", "_handle", "_released", "release")
    if success is None or in_progress is None or not all(hasattr(kind, f) for f in fields):
        return _duck(kind)  # not the NIXL this knows: an Adapter says how (docs/completions.md)

    def done(handle: Any) -> bool:
        agent, request, released = _nixl_request(handle)
        if released:  # its request is freed: asking would read freed memory
            raise ValueError(f"{handle!r} was released: its transfer cannot be asked")
        status = agent.getXferStatus(request)
        if status == success:
            return True
        if status == in_progress:
            return False
        raise RuntimeError(f"NIXL transfer 0x{request:x} failed: {status}")

    return Adapter("nixl", done=done, describe=_describe_nixl, on_cancel=_release)


def _builtin(kind: type) -> Adapter | None:
    futures = sys.modules.get("concurrent.futures")
    if futures is not None and issubclass(kind, futures.Future):
        return CONCURRENT
    root = kind.__module__.partition(".")[0]
    if root == "torch":
        if _is_a(kind, "torch", "Work"):
            return TORCH_WORK
        if _is_a(kind, "torch", "Future"):
            return TORCH_FUTURE
    elif root == "distributed" and _is_a(kind, "distributed", "Future"):
        return DASK
    elif root in ("jax", "jaxlib") and hasattr(kind, "is_ready"):
        return JAX
    elif root.startswith("nixl") and _is_a(kind, root, "nixl_xfer_handle"):
        return _nixl(kind)
    elif kind.__module__ == "aiostream.virtual" and kind.__name__ == "Transfer":
        return _transfer()
    return _duck(kind)


def _duck(kind: type) -> Adapter | None:
    name = _short(kind)
    if callable(getattr(kind, "add_done_callback", None)) and callable(getattr(kind, "done", None)):
        return Adapter(
            name, done="done", call_back=_subscribe, result=_raise_error, describe=_identity
        )
    for method in ("done", "is_completed", "is_ready"):
        if callable(getattr(kind, method, None)):
            return Adapter(name, done=method, describe=_identity)
    return None


def is_cuda_event(handle: object) -> bool:
    """Whether ``handle`` is another library's CUDA event (``aiostream.as_event`` takes it)."""
    kind = type(handle)
    root = kind.__module__.partition(".")[0]
    return root in ("torch", "cupy", "cupy_backends", "cuda") and "Event" in kind.__name__

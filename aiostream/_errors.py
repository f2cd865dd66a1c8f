"""The exceptions aiostream raises."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AiostreamError",
    "BackendUnavailableError",
    "CudaError",
    "DeviceError",
    "NotReadyError",
    "StaleHandleError",
]


class AiostreamError(Exception):
    """Base class of every error aiostream raises on its own account.

    Every one pickles with its attributes, so it crosses processes (multiprocessing, Ray)
    whole: the subclasses' keyword-only arguments would otherwise break unpickling.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[AiostreamError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class DeviceError(AiostreamError):
    """Device work failed, or the device refused a request (such as memory it does not have).

    Errors of device work are sticky: once a device has failed, every later query, wait or
    submission on it raises again, as CUDA's asynchronous errors do for their context. A refused
    request is not: the device goes on.

    Attributes:
        device: the device that failed, as ``"kind:index"``.
    """

    def __init__(self, message: str, *, device: str) -> None:
        super().__init__(message)
        self.device = device


class CudaError(DeviceError):
    """A CUDA driver call failed.

    The message names the call, the device and the driver's own description. Errors of
    asynchronous work (a kernel that faulted) are sticky: the driver reports them from every
    later call on that device's context.

    Attributes:
        code: the driver's ``CUresult`` value, such as 719.
        name: its name, such as ``"CUDA_ERROR_LAUNCH_FAILED"``; ``""`` for a code the
            installed ``cuda-python`` does not know (a newer driver's).
    """

    def __init__(self, message: str, *, device: str, code: int, name: str) -> None:
        super().__init__(message, device=device)
        self.code = code
        self.name = name


class BackendUnavailableError(AiostreamError):
    """A backend cannot be used on this machine; the message says why and what to do.

    Attributes:
        kind: the backend's name (``"cuda"``, ``"virtual"``).
        reason: why it is unavailable.
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"the {kind!r} backend is unavailable: {reason}")
        self.kind = kind
        self.reason = reason


class NotReadyError(AiostreamError):
    """The work an operation needs has not completed yet (CUDA's ``CUDA_ERROR_NOT_READY``)."""


class StaleHandleError(AiostreamError):
    """The object belongs to a backend that was replaced (``aiostream.virtual.reset()``)."""


# Tracebacks and reprs name them as users import them: aiostream.DeviceError, not
# aiostream._errors.DeviceError (pickling still finds them: aiostream exports each one).
for _error in (
    AiostreamError,
    DeviceError,
    CudaError,
    BackendUnavailableError,
    NotReadyError,
    StaleHandleError,
):
    _error.__module__ = "aiostream"
del _error

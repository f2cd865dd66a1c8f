"""The registry of backends: created lazily by name, one instance per kind."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .._errors import BackendUnavailableError

if TYPE_CHECKING:
    from .base import AnyBackend

__all__ = ["KINDS", "get", "probe", "replace", "restore"]

KINDS = ("cuda", "virtual")

_lock = threading.Lock()
_instances: dict[str, AnyBackend] = {}
_unavailable: dict[str, str] = {}


def _create(kind: str) -> AnyBackend:
    if kind == "virtual":
        from .virtual import VirtualBackend

        return VirtualBackend()
    from .cuda.driver import check_library

    check_library()  # no driver library: said before the backend's modules (and numpy) load
    from .cuda.backend import CudaBackend

    return CudaBackend()


def get(kind: str) -> AnyBackend:
    """Return the backend of ``kind``, creating it on first use."""
    backend = _instances.get(kind)
    if backend is not None:
        return backend
    with _lock:
        backend = _instances.get(kind)
        if backend is not None:
            return backend
        if kind in _unavailable:
            raise BackendUnavailableError(kind, _unavailable[kind])
        try:
            backend = _create(kind)
        except BackendUnavailableError as exc:
            _unavailable[kind] = exc.reason
            raise
        _instances[kind] = backend
        return backend


def installed(kind: str) -> AnyBackend | None:
    """The backend of ``kind`` in use now, or None (none is created)."""
    return _instances.get(kind)


def probe(kind: str) -> tuple[bool, str]:
    """Return ``(available, reason)``; the reason is empty when available."""
    if kind in _instances:
        return True, ""
    reason = _unavailable.get(kind)
    if reason is not None:
        return False, reason
    try:
        get(kind)
    except BackendUnavailableError as exc:
        return False, exc.reason
    return True, ""


def replace(kind: str, backend: AnyBackend) -> AnyBackend | None:
    """Install ``backend`` as the instance of ``kind``; return the one it replaced."""
    with _lock:
        old = _instances.get(kind)
        _instances[kind] = backend
        _unavailable.pop(kind, None)
        return old


def restore(kind: str, backend: AnyBackend | None) -> None:
    """Put back what :func:`replace` returned (None: create afresh on next use)."""
    with _lock:
        if backend is None:
            _instances.pop(kind, None)
        else:
            _instances[kind] = backend

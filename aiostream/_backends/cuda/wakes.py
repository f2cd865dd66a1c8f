"""How the device wakes the CUDA watcher's thread: a POSIX semaphore of libc's, posted by
libc's own ``sem_post`` launched as a host function with the driver's ``cuLaunchHostFunc``
(through ctypes: no Python runs on a driver thread). Where there is no POSIX libc the watcher
polls.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

from .driver import SUCCESS

__all__ = ["LaunchHostFunc", "Semaphores", "driver_launch_host_func", "semaphores"]

LaunchHostFunc = Callable[[int, int, int], int]


class Semaphores:
    """libc's POSIX semaphores through ctypes: ``sem_post`` is the host function."""

    SIZE = 64  # bytes for one sem_t (32 on glibc x86-64 and aarch64), with room to spare

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.libc = libc
        for name in ("sem_init", "sem_post", "sem_wait", "sem_timedwait", "sem_trywait"):
            getattr(libc, name).restype = ctypes.c_int
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        self.post_address: int = ctypes.cast(libc.sem_post, ctypes.c_void_p).value or 0

    def new(self) -> int:
        """A semaphore at 0, in memory that is never freed (a late host function may post
        it while the interpreter exits)."""
        sem = self.libc.malloc(self.SIZE)
        if not sem or self.libc.sem_init(ctypes.c_void_p(sem), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        return int(sem)

    def post(self, sem: int) -> None:
        self.libc.sem_post(ctypes.c_void_p(sem))

    def wait(self, sem: int, timeout: float | None) -> bool:
        """Wait (GIL released) until posted, or ``timeout`` seconds: whether it was posted."""
        handle = ctypes.c_void_p(sem)
        if timeout is None:
            posted = self.libc.sem_wait(handle) == 0
        else:
            deadline = time.time() + timeout
            ts = (ctypes.c_long * 2)(int(deadline), int((deadline % 1) * 1e9))
            posted = self.libc.sem_timedwait(handle, ts) == 0
        if posted:  # one wake for every post so far: the sweep after it sees all they announce
            while self.libc.sem_trywait(handle) == 0:
                pass
        return bool(posted)


def _load_semaphores() -> Semaphores | None:
    try:
        return Semaphores()
    except (OSError, AttributeError):  # no POSIX libc (Windows): the watcher polls
        return None


semaphores = _load_semaphores()

_LAUNCH_HOST_FUNC = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)


def driver_launch_host_func(cu: Any) -> LaunchHostFunc | None:
    """The driver's own ``cuLaunchHostFunc``, called through ctypes; None where there is no
    POSIX libc for ``sem_post``.

    Not cuda-python's ``driver.cuLaunchHostFunc``: that one launches a wrapper of its own,
    which takes the GIL (``PyGILState_Ensure``) on the driver's thread before it calls the
    function given, even a C function: a deadlock with any thread that holds the GIL while it
    calls the driver, and a crash when a host function runs after the interpreter finalized.
    """
    if semaphores is None:
        return None
    try:
        err, address, _ = cu.cuGetProcAddress(b"cuLaunchHostFunc", 10000, 0)
    except (RuntimeError, ValueError, TypeError):  # a driver without cuGetProcAddress
        return None
    if err != SUCCESS or not address:
        return None
    launch: LaunchHostFunc = _LAUNCH_HOST_FUNC(int(address))
    return launch

"""The checkout, and Python run from it in another process."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def run_python(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` from the checkout, with ``env`` added and no AIOSTREAM_DEVICE."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    environ.pop("AIOSTREAM_DEVICE", None)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=environ,
    )


def in_spawned_process(
    target: Callable[..., None], *args: object, start: str = "spawn"
) -> tuple[int, Any]:
    """Run ``target(*args, out)`` in a fresh (spawned) process, or with ``start="fork"`` in a
    copy of this one; return its pid and what it put on ``out`` (a queue), once."""
    ctx = multiprocessing.get_context(start)
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, out))
    child.start()
    try:
        return child.pid or 0, out.get(timeout=60)
    finally:
        child.join(timeout=60)


def import_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by its name, as the examples import each other (and as
    Ray's workers import an actor's module): examples/ goes on ``sys.path``."""
    path = str(ROOT / "examples")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)

"""This distribution: its name and version, and the unrelated PyPI project ``aiostream``,
which uses this package's import name.

Installed into one environment, pip lays both distributions' files into one ``aiostream/``
folder without a word: imports inside the package then fail in ways that name neither
distribution (``cannot import name 'Stream' from 'aiostream.stream'``, where the other
project's ``aiostream/stream/`` package shadows ``stream.py``). This module finds the other
distribution and says what to do. It imports nothing of the package, so it works however mixed
the folder is.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys
from pathlib import Path

#: this project's distribution
OURS = "aiostream-cuda"


@functools.cache
def version() -> str:
    """This distribution's version, read from its metadata on first use (``import aiostream``
    reads nothing); ``0+unknown`` in a source tree that was not installed."""
    try:
        return importlib.metadata.version(OURS)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def other_distribution() -> str | None:
    """``"aiostream 0.6.4 (in /site-packages)"`` when the other project is installed, else
    None."""
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if _normal(name) == "aiostream":
            where = dist.locate_file("")
            return f"{name} {dist.version} (in {where})"
    return None


def advice(other: str) -> str:
    """What to do about the other distribution."""
    return (
        f"The distribution {other} is installed here too: it is an unrelated project that "
        f"uses the same import name, 'aiostream', and pip has mixed its files with this "
        f"project's ({OURS}). They cannot share an environment. Fix it with\n"
        f"    python -m pip uninstall -y aiostream {OURS}\n"
        f"then reinstall this project from its checkout: python -m pip install . (or "
        f"python -m pip install dist/aiostream_cuda-*.whl, a wheel built there; {OURS} is "
        f"not on PyPI yet). Uninstalling only the other one leaves this one "
        f"broken, since the two share files. To use both, give each its own virtual "
        f"environment."
    )


def running_the_command_line() -> bool:
    """Whether this interpreter was started to run aiostream's command line: ``python -m
    aiostream`` (while the package is imported to find ``__main__``, ``sys.argv[0]`` is
    ``"-m"``, and ``sys.orig_argv`` holds the module's name) or the ``aiostream`` script."""
    if sys.argv[:1] == ["-m"]:
        argv = list(getattr(sys, "orig_argv", ()))
        return any(a == "-m" and argv[i + 1 : i + 2] == ["aiostream"] for i, a in enumerate(argv))
    return bool(sys.argv) and Path(sys.argv[0]).name == "aiostream"


def explain(error: ImportError) -> None:
    """Raise an ImportError that names the other distribution and the fix, when it is the
    cause of ``error`` (the command line prints it and exits with status 1 instead: a
    traceback is not its way to say what is wrong); else return (the caller re-raises
    ``error``)."""
    other = other_distribution()
    if other is None:
        return
    message = f"aiostream could not be imported ({error}). {advice(other)}"
    if running_the_command_line():
        print(f"python -m aiostream: {message}", file=sys.stderr)
        raise SystemExit(1)
    raise ImportError(message) from error


def shadowed(package: object) -> str | None:
    """What to tell the user when ``package``, the ``aiostream`` that ``import aiostream``
    gave, is not this project's: the other project, installed after this one, replaced its
    ``__init__.py`` (nothing of this project runs on a plain ``import aiostream`` then; its
    command line and pytest plugin, whose files are still there, say it). None when it is.

    This project's ``__init__.py`` names its distribution (``_DISTRIBUTION``); the other's
    does not, whatever names it defines. (Reading the distributions' file records instead,
    whose hashes say which one wrote the file last, takes about 200 ms in an environment of
    150 distributions, on every run of pytest; an editable install has no such record.)"""
    if getattr(package, "_DISTRIBUTION", None) == OURS:
        return None
    where = getattr(package, "__file__", None) or "?"
    other = other_distribution()
    if other is not None:
        return (
            f"'import aiostream' imports {where}, which is not {OURS}'s: the other project "
            f"replaced it. {advice(other)}"
        )
    return (
        f"'import aiostream' imports {where}, which is not {OURS}'s, and no other "
        f"distribution says it owns it: reinstall this project from its checkout with "
        f"python -m pip install --force-reinstall ."
    )

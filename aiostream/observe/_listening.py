"""What the public listeners share (``aiostream.tracing.Tracing``,
``aiostream.metrics.PrometheusMetrics``): plugged into ``_hooks`` from their making until
closed, and closed by leaving their ``with`` block."""

from __future__ import annotations

from typing import Any

from .. import _hooks


class Listening(_hooks.Listener):
    """A listener that listens until it is closed."""

    closed = True

    def _listen(self) -> None:
        self.closed = False
        _hooks.add_listener(self)

    def close(self) -> None:
        """Stop listening (a second close does nothing)."""
        if self.closed:
            return
        self.closed = True
        _hooks.remove_listener(self)
        self._stopped()

    def _stopped(self) -> None:
        """What a subclass lets go of once closed."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = type(self)
        return f"<{kind.__module__}.{kind.__qualname__} {'closed' if self.closed else 'on'}>"

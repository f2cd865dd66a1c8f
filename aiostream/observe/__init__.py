"""The observing wing: the profiler (``profiler``: recording; ``_spans``: spans and their
summary; ``_export``: Chrome trace and SVG), OpenTelemetry spans (``tracing``) and Prometheus
metrics (``metrics``). Each listens at ``_hooks``; nothing of the core imports it, and it
imports no other wing (data, completions). The public names are ``aiostream.profile``,
``aiostream.Profiler``, ... and the modules ``aiostream.tracing`` and ``aiostream.metrics``."""

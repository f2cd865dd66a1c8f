"""Measurements behind ``python -m aiostream bench`` and the scripts under ``benchmarks/``, and
the demos' work (:mod:`.demo`: ``python -m aiostream demo``'s pipeline, also the loader
benchmark's workload, and ``streams``' tasks and chart).

Each function measures one thing against a baseline measured the same way; the suite
(:mod:`.suite`) runs a short selection of them with a progress bar and prints one table of
ratios; the scripts run them at full size and print every figure.
"""

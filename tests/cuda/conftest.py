"""Fixtures of the CUDA tests (``tests/helpers/cuda_fixtures.py``); what they share besides
lives in ``tests/helpers/cuda.py``."""

from tests.helpers.cuda_fixtures import contract, own_backend

__all__ = ["contract", "own_backend"]

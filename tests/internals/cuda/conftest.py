"""Fixtures of the white-box tests of the CUDA backend, the same as ``tests/cuda/``'s
(``tests/helpers/cuda_fixtures.py``); what they share besides lives in
``tests/helpers/cuda.py``."""

from tests.helpers.cuda_fixtures import contract, own_backend

__all__ = ["contract", "own_backend"]

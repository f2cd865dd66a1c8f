"""What tests share, imported by name (``from tests.helpers.process import run_python``);
conftest.py holds fixtures and hooks only.

- :mod:`.process`: the checkout's root, Python in a subprocess or a spawned process, examples.
- :mod:`.waits`: small async helpers around waits, and the virtual device's quiet check.
- :mod:`.stand_in`: the stand-in CUDA driver's test hooks (tests/fake_cuda/fake_cuda.c), where
  it is the driver.
"""

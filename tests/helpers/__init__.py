"""What tests share, imported by name (``from tests.helpers.process import run_python``);
conftest.py files hold fixtures and hooks only.

- :mod:`.process`: the checkout's root, Python in a subprocess or a spawned process, examples.
- :mod:`.deadlines`: waits that say what they waited for when they run out.
- :mod:`.lanes`: which lane runs, and how many examples a property test takes in it.
- :mod:`.protocol`: the backend protocol, the one seam onto the package besides its public
  names (white-box tests live in ``tests/internals/``).
- :mod:`.waits`: small async helpers around waits, and the virtual device's quiet check.
- :mod:`.virtual`: the virtual backend's waits observed through the protocol.
- :mod:`.loader`: sources and readers the data loader's tests share.
- :mod:`.fuzzing`: the machinery of the public calls' fuzzers.
- :mod:`.fake_cuda`: builds the stand-in CUDA driver (``tests/fake_cuda/fake_cuda.c``).
- :mod:`.stand_in`: the stand-in driver's test hooks, where it is the driver.
- :mod:`.gate`: a stream's work held on the device until the test releases it (a stream memory
  wait, through the driver API: on a GPU too).
- :mod:`.cuda`: what the CUDA tests share (the primary context, a backend of a test's own).
- :mod:`.faults`: driver calls made to fail, and counted, at the bindings: on any driver.
"""

#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels the GPU suite installs on a device without one:
# bash benchmarks/fetch_wheels.sh [PYTHON_VERSION]   (default 3.12, the device image's)
#
# The device image has PyTorch, CuPy, cuda-python, anyio, uvloop, pytest and hypothesis; this
# adds sniffio (aiostream's, where the image's anyio does not bring it), trio and
# pytest-asyncio (with what they need), pytest-timeout and pytest-xdist (the GPU tests' per-test
# limit and their processes, where the image lacks them), setuptools >= 70.1 (aiostream's build
# backend, able to build an editable install without the wheel package), and fastapi, uvicorn
# and httpx for the inference server benchmark, and Dask's distributed for the completions
# benchmark's real kinds (the suite's last step, for the lent machine's cores), into .whl/,
# which git ignores and the device call carries.
set -euo pipefail
version=${1:-3.12}
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --dest .whl --only-binary=:all: \
    --python-version "$version" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --implementation cp sniffio trio pytest-asyncio pytest-timeout pytest-xdist "setuptools>=70.1" \
    fastapi uvicorn httpx distributed
ls .whl

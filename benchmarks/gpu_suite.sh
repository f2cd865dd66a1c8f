#!/usr/bin/env bash
# The GPU suite in one command: bash benchmarks/gpu_suite.sh OUTDIR [--quick]
#
# On a GPU machine with no network: installs what the device image lacks from the wheels in
# .whl/ (fetched beforehand by benchmarks/fetch_wheels.sh), installs aiostream from this
# working tree without build isolation, then runs benchmarks/gpu_suite.py, which writes
# OUTDIR/report.md and one raw output per step. See benchmarks/README.md. Its last step hands
# buffers PyTorch -> aiostream -> CuPy (-> JAX) and to another process; JAX is kept from taking
# the GPU's memory up front, which PyTorch and CuPy need too.
set -euo pipefail
out=${1:?usage: bash benchmarks/gpu_suite.sh OUTDIR [--quick]}
shift
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install --quiet --no-index --find-links .whl sniffio trio pytest-asyncio "setuptools>=70.1" \
        || echo "gpu_suite.sh: some wheels in .whl/ did not install; going on" >&2
    "$py" -m pip install --quiet --no-index --find-links .whl pytest-timeout pytest-xdist \
        || echo "gpu_suite.sh: pytest-timeout or pytest-xdist did not install; going on" >&2
    "$py" -m pip install --quiet --no-index --find-links .whl fastapi uvicorn httpx \
        || echo "gpu_suite.sh: the server's wheels did not install; bench-server will skip" >&2
    "$py" -m pip install --quiet --no-index --find-links .whl distributed \
        || echo "gpu_suite.sh: Dask did not install; the completions step goes on without it" >&2
fi
"$py" -m pip install --quiet --no-index --no-build-isolation --no-deps -e . \
    || { echo "gpu_suite.sh: could not install aiostream from the working tree" >&2; exit 2; }
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec "$py" benchmarks/gpu_suite.py "$out" "$@"

"""Regenerate aiostream/_backends/cuda/kernels/*.ptx from their .cu sources with NVRTC.

A maintainer's tool, not needed to install or use aiostream. It needs NVRTC, for example:

    pip download --no-deps nvidia-cuda-nvrtc-cu12 && unzip nvidia_cuda_nvrtc_cu12-*.whl
    python tools/build_ptx.py --nvrtc nvidia/cuda_nvrtc/lib/libnvrtc.so.12

and, to check the result, ``--ptxas PATH`` (from the ``nvidia-cuda-nvcc-cu12`` wheel) assembles
the PTX for sm_90 as the driver would.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import subprocess
import sys
import tempfile

KERNELS = (
    pathlib.Path(__file__).resolve().parent.parent / "aiostream" / "_backends" / "cuda" / "kernels"
)
ARCH = "compute_70"  # the first architecture with __nanosleep; the driver JITs it for newer ones


def compile_ptx(nvrtc: ctypes.CDLL, source: pathlib.Path) -> bytes:
    prog = ctypes.c_void_p()
    check = _checker(nvrtc)
    check(
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None
        )
    )
    options = [f"--gpu-architecture={ARCH}".encode(), b"--std=c++17"]
    argv = (ctypes.c_char_p * len(options))(*options)
    result = nvrtc.nvrtcCompileProgram(prog, len(options), argv)
    if result != 0:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{source.name}: NVRTC failed:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx))
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value


def _checker(nvrtc: ctypes.CDLL):  # type: ignore[no-untyped-def]
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(code: int) -> None:
        if code != 0:
            sys.exit(f"NVRTC error {code}: {nvrtc.nvrtcGetErrorString(code).decode()}")

    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvrtc", required=True, help="path to libnvrtc.so")
    parser.add_argument("--ptxas", help="path to ptxas, to check the PTX assembles for sm_90")
    args = parser.parse_args()
    nvrtc = ctypes.CDLL(args.nvrtc)
    for source in sorted(KERNELS.glob("*.cu")):
        ptx = compile_ptx(nvrtc, source)
        target = source.with_suffix(".ptx")
        target.write_bytes(ptx)
        print(f"wrote {target.relative_to(KERNELS.parent.parent.parent)} ({len(ptx)} bytes)")
        if args.ptxas:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(
                    [args.ptxas, "-arch=sm_90", str(target), "-o", f"{tmp}/out.cubin"], check=True
                )
            print("  ptxas -arch=sm_90: ok")


if __name__ == "__main__":
    main()

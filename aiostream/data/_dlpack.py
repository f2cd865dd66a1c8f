"""DLPack capsules in pure ctypes: memory handed out as a ``DLManagedTensor(Versioned)``, and a
producer's capsule taken in.

The C structures are DLPack's (``dlpack.h``, version 1.0 and the legacy 0.x layout); the
capsules are made and read through CPython's capsule API, so no compiled code is needed.

Exporting: :func:`export` fills a tensor that lives in Python memory, wraps its address in a
capsule named ``dltensor_versioned`` (or ``dltensor``), and keeps the tensor, its shape and
strides, the capsule and the *owner* (the object whose memory it is) in a table until the
consumer calls the tensor's deleter. The owner thereby outlives every array a consumer made of
it. The capsule has no destructor: a consumer that refuses a capsule drops it with its own
error set, and a destructor written in Python (a ctypes callback) would run with that error
pending and replace it with a ``SystemError``. The table holds the capsule instead, and a
capsule that only the table still holds, never consumed (it keeps its first name), is
released by a sweep: at each garbage collection, each export and each count of the exports.

Importing: :func:`consume` reads a producer's capsule, renames it ``used_dltensor(_versioned)``
as the protocol asks, and returns what it describes with a function that calls the producer's
deleter once (the producer's memory is released when that runs).

Argument checks of ``__dlpack__`` (stream, max_version, dl_device, copy) live here too, with
the errors the array API standard names for them.

At the ground floor: imports nothing of the package but the argument checks.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _check

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DLDeviceType",
    "Imported",
    "check_export",
    "consume",
    "export",
    "numpy_dtype",
]

#: The DLPack version this module writes into versioned capsules.
VERSION = (1, 0)
_READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
_IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED


class DLDeviceType(enum.IntEnum):
    """DLPack's device types (``DLDeviceType``), those aiostream meets."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    CUDA_MANAGED = 13


# ---------------------------------------------------------------------- the C structures


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    """``DLManagedTensor`` (DLPack 0.x, and the legacy capsule of 1.x)."""

    _fields_ = [
        ("dl_tensor", _Tensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    """``DLManagedTensorVersioned`` (DLPack 1.x)."""

    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


# ---------------------------------------------------------------------- the capsule API

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
#: The names a consumer gives a capsule it took; they live as long as the module, as the
#: capsule keeps a pointer to its name.
_USED = b"used_dltensor"
_USED_VERSIONED = b"used_dltensor_versioned"

_api = ctypes.pythonapi
_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", _api))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api)
)
_capsule_is_valid_object = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_capsule_pointer_object = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
#: A producer's deleter, called with the GIL held (a deleter may take it, or need it).
_CALL_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)


# ---------------------------------------------------------------------- exporting


class _Export:
    """What an exported tensor needs alive: the structure, its shape and strides, the owner of
    the memory (released when the consumer calls the deleter) and the capsule (``None`` until
    it is made)."""

    __slots__ = ("capsule", "managed", "name", "owner", "shape", "strides")

    def __init__(self, managed: ctypes.Structure, owner: object, ndim: int, name: bytes) -> None:
        self.managed = managed
        self.owner = owner
        self.name = name
        self.capsule: object = None
        self.shape = (ctypes.c_int64 * max(ndim, 1))()
        self.strides = (ctypes.c_int64 * max(ndim, 1))()

    def consumed(self) -> bool:
        """Whether a consumer took the capsule (it renamed it)."""
        return not _capsule_is_valid_object(self.capsule, self.name)

    def abandoned(self) -> bool:
        """Whether nothing but this table holds the capsule (which was never consumed)."""
        return sys.getrefcount(self.capsule) <= 2  # the slot, and getrefcount's argument


#: The exported tensors whose deleter has not run yet, by address.
_exports: dict[int, _Export] = {}
#: Those of them whose capsule no consumer has been seen to take yet: what a sweep looks at
#: (so its cost is that of the capsules in hand, not of every export consumers hold).
_fresh: dict[int, _Export] = {}
_exports_lock = threading.Lock()


def _forget(address: int) -> None:
    """The consumer is done with the tensor at ``address``: its owner may go (dropped outside
    the lock, as dropping it may free memory, which may export or forget others)."""
    with _exports_lock:
        keep = _exports.pop(address, None)
        _fresh.pop(address, None)
    del keep


def _deleter(address: int | None) -> None:
    """The tensors' deleter, which consumers call from C, from any thread."""
    _forget(address or 0)


def _sweep(*, blocking: bool = True) -> None:
    """Release the exports whose capsule was dropped unconsumed (dropped outside the lock).
    Not ``blocking``: skipped while the table is in use (a collection can start inside a
    sweep, on its own thread)."""
    if not _fresh or not _exports_lock.acquire(blocking=blocking):
        return
    released = []
    try:
        for address, keep in list(_fresh.items()):
            if keep.consumed():  # the consumer calls the deleter when done
                del _fresh[address]
                keep.capsule = None
            elif keep.abandoned():
                del _fresh[address]
                released.append(_exports.pop(address))
    finally:
        _exports_lock.release()
    del released


def _on_collection(phase: str, info: dict[str, int]) -> None:
    if phase == "stop":
        _sweep(blocking=False)


gc.callbacks.append(_on_collection)

#: The deleter's C function pointer (kept alive with the module: C may call it any time).
_deleter_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_deleter)
_DELETER_ADDRESS = ctypes.cast(_deleter_c, ctypes.c_void_p).value

_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool
_KINDS = {code: kind for kind, code in _CODES.items()}


def _data_type(dtype: np.dtype) -> _DataType:
    code = _CODES.get(dtype.kind)
    if code is None or not dtype.isnative or dtype.itemsize > 31:
        raise BufferError(
            f"dtype {dtype} has no DLPack equivalent (DLPack holds booleans, integers, floats "
            "and complex numbers in native byte order): view the buffer as one of those first "
            "(DeviceBuffer.view)"
        )
    return _DataType(code, dtype.itemsize * 8, 1)


def export(
    owner: object,
    address: int,
    device: tuple[int, int],
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    versioned: bool,
    read_only: bool = False,
) -> Any:
    """A capsule of the C-contiguous array of ``dtype`` and ``shape`` at ``address`` on the
    DLPack ``device``; ``owner`` stays alive until the consumer is done with it. A versioned
    capsule says ``read_only`` in its flags (a legacy one cannot say it)."""
    dt = _data_type(dtype)
    if read_only and not versioned:
        raise BufferError(
            "the buffer is read-only, which a legacy (unversioned) DLPack capsule cannot say: "
            "the consumer could write it; ask for DLPack 1.x (max_version=(1, 0))"
        )
    managed: _Managed | _ManagedVersioned
    if versioned:
        managed = _ManagedVersioned()
        managed.version = _Version(*VERSION)
        managed.flags = _READ_ONLY if read_only else 0
    else:
        managed = _Managed()
    name = _NAME_VERSIONED if versioned else _NAME
    keep = _Export(managed, owner, len(shape), name)
    stride = 1
    for i in reversed(range(len(shape))):  # in elements, C order
        keep.shape[i] = shape[i]
        keep.strides[i] = stride
        stride *= max(shape[i], 1)
    tensor = managed.dl_tensor
    tensor.data = address or None
    tensor.device = _Device(int(device[0]), int(device[1]))
    tensor.ndim = len(shape)
    tensor.dtype = dt
    tensor.shape = ctypes.cast(keep.shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(keep.strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _DELETER_ADDRESS
    pointer = ctypes.addressof(managed)
    _sweep()
    capsule = keep.capsule = _capsule_new(pointer, name, None)
    with _exports_lock:
        _exports[pointer] = _fresh[pointer] = keep
    return capsule


def pending_exports() -> int:
    """How many exported tensors are still held by their consumers (for tests)."""
    _sweep()
    with _exports_lock:
        return len(_exports)


def check_export(
    device: tuple[int, int],
    stream: object,
    max_version: object,
    dl_device: object,
    copy: object,
) -> tuple[int | None, bool]:
    """Check the arguments of ``__dlpack__`` for memory on the DLPack ``device``; return the
    consumer's stream (None: no synchronization, or a device without streams) and whether to
    make a versioned capsule.

    The errors are the array API standard's: ``BufferError`` for an export that cannot be made
    (another device, a copy), ``ValueError``/``TypeError`` for arguments that are wrong.
    """
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be True, False or None, got {copy!r}")
    versioned = _versioned(max_version)
    if dl_device is not None:
        wanted = _dl_device(dl_device)
        if wanted != tuple(device):
            if wanted[0] == DLDeviceType.CPU and copy is False:
                raise ValueError(
                    f"dl_device={wanted} asks for host memory, which only a copy could give, "
                    "and copy=False forbids one: copy the buffer into an aiostream.HostBuffer "
                    "with copy_async and await it, then use HostBuffer.numpy()"
                )
            raise BufferError(
                f"the buffer is exported on its own device {tuple(device)} only, not on "
                f"{wanted}: aiostream copies between devices with copy_async (into a "
                "HostBuffer for host memory), never inside __dlpack__"
            )
    if copy is True:
        raise BufferError(
            "__dlpack__(copy=True) is not supported: the export shares the buffer's memory. "
            "Copy into another DeviceBuffer with copy_async and export that, or copy in the "
            "consumer (e.g. torch.from_dlpack(buf).clone())"
        )
    if device[0] != DLDeviceType.CUDA:
        if stream is not None:
            raise ValueError(
                f"stream must be None for memory exported as host memory (DLPack device "
                f"{tuple(device)}), which has no streams; got {stream!r}"
            )
        return None, versioned
    if stream is None:
        return 1, versioned  # the legacy default stream, as the standard says for CUDA
    value = _check.integer(stream, "stream", what="an int (a CUstream handle, 1, 2 or -1)")
    if value == 0:
        raise ValueError(
            "stream=0 is ambiguous and the standard disallows it on CUDA: pass 1 for the "
            "legacy default stream, 2 for the per-thread default stream, the stream's handle, "
            "or -1 for no synchronization"
        )
    if value < -1:
        raise ValueError(
            f"stream must be -1 (no synchronization), 1, 2 or a CUstream handle, got {value}"
        )
    _check.handle(max(value, 0), "stream", what="an int (a CUstream handle, 1, 2 or -1)")
    return (None if value == -1 else value), versioned


def _versioned(max_version: object) -> bool:
    if max_version is None:
        return False
    if not (isinstance(max_version, tuple) and len(max_version) == 2):
        raise TypeError(
            f"max_version must be None or a (major, minor) tuple of ints, got {max_version!r}"
        )
    major = _check.integer(max_version[0], "max_version[0]", minimum=0)
    _check.integer(max_version[1], "max_version[1]", minimum=0)
    return major >= VERSION[0]


def _dl_device(value: object) -> tuple[int, int]:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(
            "dl_device must be None or a (device_type, device_id) tuple, as __dlpack_device__() "
            f"returns; got {value!r}"
        )
    kind = _check.integer(value[0], "dl_device[0]", minimum=0)
    index = _check.integer(value[1], "dl_device[1]", minimum=0)
    return kind, index


# ---------------------------------------------------------------------- importing


@dataclass(frozen=True)
class Imported:
    """What a consumed capsule describes; ``release()`` calls the producer's deleter (once)."""

    address: int
    device: tuple[int, int]
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    read_only: bool
    release: Callable[[], None]


def numpy_dtype(code: int, bits: int, lanes: int) -> np.dtype:
    """The NumPy dtype of a DLPack data type; BufferError where NumPy has none."""
    kind = _KINDS.get(code)
    if kind is None or lanes != 1 or bits % 8 or (kind == "b" and bits != 8):
        raise BufferError(
            f"the array's DLPack data type (code {code}, {bits} bits, {lanes} lanes) has no "
            "NumPy equivalent (bfloat16 and float8 have none): view it in the producer as an "
            "integer type of the same size first (e.g. tensor.view(torch.uint16))"
        )
    import numpy as np  # when a buffer is shared: ``import aiostream`` stays light

    try:
        return np.dtype(f"{kind}{bits // 8}")
    except TypeError:
        raise BufferError(f"NumPy has no {bits}-bit type of kind {kind!r}") from None


def consume(capsule: object) -> Imported:
    """Take a producer's capsule: validated first (a capsule refused is left to its own
    destructor), then renamed as used, so that the producer's memory is released only by the
    ``release`` returned."""
    struct: type[_Managed] | type[_ManagedVersioned]
    if _capsule_is_valid_object(capsule, _NAME_VERSIONED):
        name, used, struct = _NAME_VERSIONED, _USED_VERSIONED, _ManagedVersioned
    elif _capsule_is_valid_object(capsule, _NAME):
        name, used, struct = _NAME, _USED, _Managed
    else:
        raise TypeError(
            f"__dlpack__() returned {type(capsule).__name__}, not an unused DLPack capsule "
            "(named 'dltensor' or 'dltensor_versioned')"
        )
    pointer = _capsule_pointer_object(capsule, name)
    managed = struct.from_address(pointer)
    read_only = False
    if isinstance(managed, _ManagedVersioned):
        if managed.version.major != VERSION[0]:
            raise BufferError(
                f"the capsule is of DLPack {managed.version.major}.{managed.version.minor}; "
                f"aiostream reads major version {VERSION[0]}"
            )
        read_only = bool(managed.flags & _READ_ONLY)
    tensor = managed.dl_tensor
    ndim = int(tensor.ndim)
    if ndim < 0:
        raise BufferError(f"the capsule's tensor has {ndim} dimensions")
    dtype = numpy_dtype(tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    if any(d < 0 for d in shape):
        raise BufferError(f"the capsule's tensor has a negative dimension: {shape}")
    if tensor.strides and math.prod(shape) > 1:
        expected = 1
        for i in reversed(range(ndim)):
            if shape[i] != 1 and int(tensor.strides[i]) != expected:
                strides = tuple(int(tensor.strides[j]) for j in range(ndim))
                raise BufferError(
                    f"the array is not C-contiguous (shape {shape}, strides {strides} in "
                    "elements): a DeviceBuffer is one contiguous range; make the array "
                    "contiguous first (e.g. tensor.contiguous(), cupy.ascontiguousarray)"
                )
            expected *= shape[i]
    device = (int(tensor.device.device_type), int(tensor.device.device_id))
    address = int(tensor.data or 0) + int(tensor.byte_offset)
    deleter = managed.deleter
    done = threading.Lock()

    def release() -> None:
        if not done.acquire(blocking=False):
            return  # released already
        if deleter:
            _CALL_DELETER(deleter)(pointer)

    if _capsule_set_name(capsule, used) != 0:  # pragma: no cover - only on a broken capsule
        raise BufferError("the DLPack capsule could not be marked as used")
    nbytes = math.prod(shape) * dtype.itemsize
    return Imported(address, device, dtype, shape, nbytes, read_only, release)

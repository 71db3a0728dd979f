"""The optional CUDA kernels of csrc/cuda/ (TensorIdMap's probe loops), called through ctypes.

setup.py builds ``recsave/_cuda_kernels.so`` with nvcc only where nvcc and a CUDA build of torch
exist. Without it (CPU machines, CI) ``available()`` is False and TensorIdMap runs its torch-ops
loops, which hand out exactly the same rows. The knob ``cuda_kernels`` turns the kernels off.

The library has a plain C ABI (csrc/cuda/id_map_kernels.cu): raw device pointers, the caller's
CUDA stream, a cudaError_t back. Tensors passed in must be contiguous int64 on one CUDA device.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Dict, Optional, Tuple

import torch

from recsave import knobs

log = logging.getLogger("recsave")

_ABI_VERSION = 1
_LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_cuda_kernels.so")

_lock = threading.RLock()  # _probe loads the library under it
_lib: Optional[ctypes.CDLL] = None
_why_not: Optional[str] = None
_tried = False
_device_why_not: Dict[int, Optional[str]] = {}  # device index -> None (the kernels run there) or why not


def _load() -> Optional[ctypes.CDLL]:
    """The library, loaded once (None, with the reason in _why_not, where it cannot be)."""
    global _lib, _why_not, _tried
    if _tried:  # every probe step of a table asks: no lock once decided (both set before _tried)
        return _lib
    with _lock:
        if not _tried:
            _lib, _why_not = _open_library()
            _tried = True
        return _lib


def _open_library() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    if not os.path.exists(_LIBRARY):
        return None, f"{_LIBRARY} was not built (setup.py builds it where nvcc and a CUDA torch exist)"
    try:
        lib = ctypes.CDLL(_LIBRARY)
    except OSError as exc:
        return None, f"{_LIBRARY} does not load: {exc}"
    lib.recsave_cuda_abi_version.restype = ctypes.c_int
    if lib.recsave_cuda_abi_version() != _ABI_VERSION:
        return None, f"{_LIBRARY} is of another recsave version; rebuild it (make build)"
    ptr, i64, u64 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_ulonglong
    lib.recsave_idmap_find.argtypes = [ptr, ptr, u64, ptr, i64, ptr, ptr, ptr]
    lib.recsave_idmap_find.restype = ctypes.c_int
    lib.recsave_idmap_place.argtypes = [ptr, ptr, u64, ptr, ptr, i64, ptr, ptr]
    lib.recsave_idmap_place.restype = ctypes.c_int
    lib.recsave_cuda_error_string.argtypes = [ctypes.c_int]
    lib.recsave_cuda_error_string.restype = ctypes.c_char_p
    return lib, None


def built() -> bool:
    """True when setup.py built the library (it may still not load or run: see available())."""
    return os.path.exists(_LIBRARY)


def available(device: Optional[torch.device] = None) -> bool:
    """True when the kernels are built, load, the knob ``cuda_kernels`` is on and (for `device`, a
    CUDA device; default the current one) they ran a first probe there."""
    return unavailable_reason(device) is None


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """Why available(device) is False (None when it is True)."""
    if not knobs.get("cuda_kernels"):
        return "the knob cuda_kernels is off"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if _load() is None:
        return _why_not
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index in _device_why_not:
        return _device_why_not[index]
    with _lock:
        if index not in _device_why_not:
            why, final = _probe(index)
            if not final:  # e.g. no memory for the probe's tensors: this call only, ask again later
                return why
            _device_why_not[index] = why
            if why is not None:
                log.warning("recsave: %s; CUDA tables there use torch ops", why)
        return _device_why_not[index]


def _probe(index: int) -> Tuple[Optional[str], bool]:
    """Places one id in a two-slot table on cuda:`index` and finds it again. Returns (None when the
    kernels ran there, else why not; whether that is final). A kernel that does not launch (e.g. a
    GPU older than the architectures built) or answers wrongly is final; anything else (no memory
    for the probe's tensors) is not."""
    device = torch.device("cuda", index)
    try:
        keys = torch.zeros(2, dtype=torch.int64, device=device)
        rows = torch.full((2,), -1, dtype=torch.int64, device=device)
        ids = torch.tensor([7], dtype=torch.int64, device=device)
        vals = torch.tensor([5], dtype=torch.int64, device=device)
        probe = torch.tensor([7, 8], dtype=torch.int64, device=device)
    except Exception as exc:  # not the kernels' failure: the torch ops take this call
        return f"no memory for the CUDA kernels' probe on {device}: {exc}", False
    try:
        _place_unchecked(keys, rows, 1, ids, vals)
        found = _find_unchecked(keys, rows, 1, probe)[0].tolist()
    except Exception as exc:  # a launch or an error it left: the torch ops take over
        return f"the CUDA kernels do not run on {device}: {exc}", True
    if found != [5, -1]:
        return f"the CUDA kernels gave wrong results on {device} ({found} for [5, -1])", True
    return None, True


def _check(code: int, what: str) -> None:
    if code != 0:
        assert _lib is not None
        raise RuntimeError(f"recsave CUDA kernel {what} failed: {_lib.recsave_cuda_error_string(code).decode()}")


def _same_device(*tensors: torch.Tensor) -> None:
    """A kernel given pointers into another GPU's memory would fault the whole process."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise RuntimeError(f"recsave CUDA kernels need all tensors on one device, got {sorted(map(str, devices))}")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def find(keys: torch.Tensor, rows: torch.Tensor, mask: int, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row, slot) of each id in the table (keys, rows), -1 / -1 where absent; one launch."""
    assert available(ids.device), "find() called without available()"
    return _find_unchecked(keys, rows, mask, ids)


def _find_unchecked(keys: torch.Tensor, rows: torch.Tensor, mask: int,
                    ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    lib = _load()
    assert lib is not None
    _same_device(keys, rows, ids)
    ids = ids.contiguous()
    n = ids.numel()
    out_rows = torch.empty(n, dtype=torch.int64, device=ids.device)
    out_slots = torch.empty(n, dtype=torch.int64, device=ids.device)
    with torch.cuda.device(ids.device):
        _check(lib.recsave_idmap_find(keys.data_ptr(), rows.data_ptr(), mask, ids.data_ptr(), n,
                                      out_rows.data_ptr(), out_slots.data_ptr(), _stream(ids.device)), "find")
    return out_rows, out_slots


def place(keys: torch.Tensor, rows: torch.Tensor, mask: int, ids: torch.Tensor, vals: torch.Tensor) -> int:
    """Stores distinct ids known to be absent with their rows (the table must have room); returns
    how many deleted slots they took (one launch, then one sync for that count)."""
    assert available(ids.device), "place() called without available()"
    return _place_unchecked(keys, rows, mask, ids, vals)


def _place_unchecked(keys: torch.Tensor, rows: torch.Tensor, mask: int, ids: torch.Tensor, vals: torch.Tensor) -> int:
    lib = _load()
    assert lib is not None
    _same_device(keys, rows, ids, vals)
    ids, vals = ids.contiguous(), vals.contiguous()
    reused = torch.zeros(1, dtype=torch.int64, device=ids.device)
    with torch.cuda.device(ids.device):
        _check(lib.recsave_idmap_place(keys.data_ptr(), rows.data_ptr(), mask, ids.data_ptr(), vals.data_ptr(),
                                       ids.numel(), reused.data_ptr(), _stream(ids.device)), "place")
    return int(reused.item())

"""A torch.save file written entry by entry, so a state larger than memory can be written one
table at a time (tools/convert.py).

torch.save's format is a zip archive (stored, not compressed): ``<archive>/data.pkl`` pickles the
object with each tensor as ``torch._utils._rebuild_tensor_v2(<storage>, offset, size, stride, ...)``
whose storage is a persistent id ``("storage", torch.<Type>Storage, key, "cpu", numel)``; the bytes
of storage `key` are the record ``<archive>/data/<key>``, aligned to 64 bytes in the file (so
``torch.load(mmap=True)`` maps them). Here the pickle is written last, from the shapes
and dtypes (`TensorSpec`) of the storages written before it (the reader finds records by name,
in any order), so a caller writes each tensor as it produces it. The result is read by
``torch.load(weights_only=True)``, with or without mmap.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import IO, Any, Tuple

import torch

ALIGNMENT = 64
ARCHIVE = "archive"
_PAD_ID = 0x4246  # the extra-field id torch's writer pads with ("FB")
_STORAGE_TYPES = {torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
                  torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
                  torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
                  torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage",
                  torch.complex128: "ComplexDoubleStorage"}


@dataclass(frozen=True)
class TensorSpec:
    """A written tensor: its storage key, shape and dtype."""
    key: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class _Storage:
    def __init__(self, spec: TensorSpec):
        self.spec = spec


class _Tensor:
    def __init__(self, spec: TensorSpec):
        self.spec = spec

    def __reduce__(self) -> Any:
        shape = self.spec.shape
        stride = _contiguous_stride(shape)
        if self.spec.dtype not in _STORAGE_TYPES:  # no typed storage (uint16, float8, ...): torch's v3 form
            return (torch._utils._rebuild_tensor_v3,  # noqa: SLF001 (torch's own pickle form)
                    (_Storage(self.spec), 0, shape, stride, False, collections.OrderedDict(), self.spec.dtype))
        return (torch._utils._rebuild_tensor_v2,  # noqa: SLF001 (torch's own pickle form)
                (_Storage(self.spec), 0, shape, stride, False, collections.OrderedDict()))


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            s = obj.spec
            if s.dtype not in _STORAGE_TYPES:  # an untyped storage of bytes, as torch.save writes one
                return ("storage", torch.UntypedStorage, s.key, "cpu", s.nbytes)
            numel = s.nbytes // s.dtype.itemsize
            return ("storage", getattr(torch, _STORAGE_TYPES[s.dtype]), s.key, "cpu", numel)
        return None


class StreamingTorchSave:
    """``w = StreamingTorchSave(f)``; ``p = w.add(tensor)`` writes the tensor's bytes now and
    returns what stands for it; ``w.finish(obj)`` pickles `obj` (holding those placeholders) and
    completes the file. Records may come in any order: the reader finds them by name."""

    def __init__(self, f: IO[bytes]):
        self._zip = zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._count = 0
        for name, data in ((".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
                           ("byteorder", b"little")):
            self._record(name, data, align=False)

    def _record(self, name: str, data: Any, align: bool = True) -> None:
        view = memoryview(data).cast("B")
        info = zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        if align:  # pad the local header's extra field so the data starts on ALIGNMENT
            fp = self._zip.fp
            assert fp is not None
            start = fp.tell() + 30 + len(info.filename.encode()) + 20 + 4  # + zip64 record + pad header
            pad = -start % ALIGNMENT
            info.extra = struct.pack("<HH", _PAD_ID, pad) + b"\0" * pad
        with self._zip.open(info, "w", force_zip64=True) as out:
            step = 64 << 20
            for i in range(0, len(view), step):
                out.write(view[i:i + step])

    def add(self, tensor: torch.Tensor) -> Any:
        """Writes the tensor's bytes (as a contiguous CPU copy when it is not one); returns its placeholder."""
        spec = TensorSpec(str(self._count), tuple(tensor.shape), tensor.dtype)
        self._count += 1
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        self._record(f"data/{spec.key}", flat.view(torch.uint8).numpy() if flat.numel() else b"")
        return _Tensor(spec)

    def finish(self, obj: Any) -> None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        self._record("data.pkl", buf.getvalue(), align=False)
        self._record("version", b"3\n", align=False)
        self._zip.close()

    def abort(self) -> None:
        self._zip.close()

"""Copies between host memory and a CUDA device, overlapped with file I/O: saves gather a table's
rows on the device block by block into two alternating pinned buffers (``DeviceGather``); loads
read columns into pinned buffers and copy them to the device while the next one is read
(``HostToDevice``). Used only for tensors on a CUDA device."""
from __future__ import annotations

from typing import List, Optional

import torch

from recsave import knobs


def _pinned(nbytes: int) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # page-locked memory exhausted: a pageable buffer still works, slower
        return torch.empty(nbytes, dtype=torch.uint8)


def buffer_size(nbytes: int, block: int) -> int:
    """Bytes to allocate for a block of `nbytes`: a request over a quarter of `block` (the knob
    write_block_bytes) gets a whole block at once (blocks are at most that), so the buffer never
    grows again. Each growth would leave the old buffer in torch's pinned-memory cache, where it
    stays resident: a 4 GB save of CUDA tables grew its two buffers often enough to hold 367 MB
    (H200, ea2667a)."""
    return max(nbytes, block) if 4 * nbytes > block else nbytes


def _at_least(buffers: List[Optional[torch.Tensor]], k: int, nbytes: int, block: int) -> torch.Tensor:
    """buffers[k] if it holds `nbytes`, else a new pinned one in its place (the old one freed first)."""
    buf = buffers[k]
    if buf is None or buf.numel() < nbytes:
        buffers[k] = None
        buffers[k] = buf = _pinned(buffer_size(nbytes, block))
    return buf


class PinnedPair:
    """Two page-locked host buffers, alternated: block k is copied into one while the writer
    still writes block k-1 from the other. The writer asks for block k+1 only after block k-1 is
    written (format/writer.py `_blocks`), so two are enough."""

    def __init__(self) -> None:
        self._buffers: List[Optional[torch.Tensor]] = [None, None]
        self._next = 0
        # read here, in the thread that plans the blocks (take() runs on the gather thread)
        self._block = knobs.get("write_block_bytes")

    def take(self, nbytes: int) -> torch.Tensor:
        """The next buffer (uint8, at least `nbytes`)."""
        k = self._next
        self._next ^= 1
        return _at_least(self._buffers, k, nbytes, self._block)[:nbytes]


class DeviceGather:
    """fetch(a, b) for a column on a CUDA device: gathers rows[a:b] on the device, copies them into
    a pinned buffer on a side stream and returns that buffer as a CPU tensor."""

    def __init__(self, storage: torch.Tensor, rows: torch.Tensor, buffers: PinnedPair):
        self.storage = storage
        self.buffers = buffers
        self.stream = torch.cuda.Stream(device=storage.device)
        # Work already queued on the training stream (e.g. an optimizer step) comes first.
        self.stream.wait_stream(torch.cuda.current_stream(storage.device))
        with torch.cuda.stream(self.stream):
            self.rows = rows.to(storage.device, non_blocking=False)

    def __call__(self, a: int, b: int) -> torch.Tensor:
        shape = (b - a,) + tuple(self.storage.shape[1:])
        row_bytes = self.storage.element_size() * self.storage[0].numel() if self.storage.shape[0] else 0
        out = self.buffers.take((b - a) * row_bytes).view(self.storage.dtype).view(shape)
        with torch.cuda.stream(self.stream):
            block = self.storage.index_select(0, self.rows[a:b])
            out.copy_(block, non_blocking=True)
        self.stream.synchronize()
        return out


class HostToDevice:
    """Pinned host buffers read into from files and copied to device tensors on a side stream: the
    copy out of one buffer overlaps the read into the other. Use as a context manager; on exit the
    copies are complete and ordered before later work on the current stream."""

    def __init__(self, block_bytes: Optional[int] = None) -> None:
        self._buffers: List[Optional[torch.Tensor]] = [None, None]
        self._events: List[Optional[torch.cuda.Event]] = [None, None]
        self._next = 0
        self._stream: Optional[torch.cuda.Stream] = None
        self._block = knobs.get("write_block_bytes") if block_bytes is None else block_bytes

    def __enter__(self) -> "HostToDevice":
        return self

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of `like`'s dtype and shape to read into (waits until the copy that last
        used this buffer is done)."""
        k = self._next
        event = self._events[k]
        if event is not None:
            event.synchronize()
        nbytes = like.numel() * like.element_size()
        return _at_least(self._buffers, k, nbytes, self._block)[:nbytes].view(like.dtype).view(like.shape)

    def copy(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """Starts copying `host` (from buffer()) into the device tensor `dst`."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dst.device)
            self._stream.wait_stream(torch.cuda.current_stream(dst.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[self._next] = event
        self._next ^= 1

    def __exit__(self, *exc: object) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

"""Shared fixtures. Every test writes under tmp_path; nothing touches the working directory."""
from __future__ import annotations

import signal

import pytest
import torch

import recsave.knobs
from recsave.save import unheard


@pytest.fixture(autouse=True)
def _no_fsync():
    """fsync adds nothing to what the suite checks (it cannot observe a power cut) but costs seconds on
    slow disks; tests that are about durability re-enable it explicitly."""
    with recsave.knobs.override(fsync=False):
        yield


@pytest.fixture(autouse=True)
def _forget_failed_async_writes():
    """Tests make async writes fail on purpose, and not all of them collect the error: a failure
    nobody heard of would otherwise set the exit status of the whole pytest process at its exit
    (knob async_failure_exit_code; tests/test_async_exit.py checks that in processes of its own)."""
    yield
    unheard.forget_unheard_failures()


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A CheckpointManager installs SIGTERM / SIGUSR1 handlers until close(); tests that never close
    theirs must not leave the test process unable to be terminated."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


def all_dtype_tensors(seed: int = 0) -> dict:
    """One tensor per storable dtype, with varied shapes, plus empty and 0-d tensors."""
    from recsave.format.dtypes import BY_NAME

    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dt) in enumerate(sorted(BY_NAME.items())):
        shape = (3 + i % 4, 5) if i % 2 else (7 + i,)
        raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dt.itemsize,), dtype=torch.uint8,
                            generator=g)
        out[f"t_{name}"] = raw.view(dt.torch_dtype).reshape(shape)
    out["scalar_f32"] = torch.tensor(3.5)
    out["scalar_i64"] = torch.tensor(-7, dtype=torch.int64)
    out["empty_rows"] = torch.empty(0, 16)
    out["empty_cols"] = torch.empty(4, 0, dtype=torch.bfloat16)
    out["emb@id"] = torch.arange(100, dtype=torch.int64) * 7919
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes, for byte-exact comparison whatever its dtype (NaNs included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

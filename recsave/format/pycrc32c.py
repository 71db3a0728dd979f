"""CRC32C (Castagnoli, reflected polynomial 0x82F63B78) in numpy, for the test oracle
(recsave/format/oracle.py), which must not share code with the engine (recsave._C) nor need the
test extras. Slow next to the engine (tens of MB/s) but enough for test files.

The register update is linear over GF(2): the CRC of a block starting from register r is the CRC of
the block from 0, xor r shifted through the block's length of zero bytes. So the input is cut into
equal blocks whose CRCs from 0 are computed side by side (one numpy step per byte position), then
chained in order through the precomputed "shift by one block" operator.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Union

import numpy as np

POLY = 0x82F63B78
_BLOCK = 4096  # bytes per block in the side-by-side pass
_SMALL = 2 * _BLOCK  # below this, a plain byte loop


def _byte_table() -> List[int]:
    table = []
    for b in range(256):
        r = b
        for _ in range(8):
            r = (r >> 1) ^ (POLY if r & 1 else 0)
        table.append(r)
    return table


_TABLE = _byte_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)


def _update(reg: int, data: Union[bytes, memoryview]) -> int:
    """Raw register update (no pre/post inversion), one byte at a time."""
    table = _TABLE
    for b in bytes(data):
        reg = table[(reg ^ b) & 0xFF] ^ (reg >> 8)
    return reg


@lru_cache(maxsize=None)
def _shift_tables() -> List[List[int]]:
    """Four 256-entry tables: the register after _BLOCK zero bytes, for each byte of the register
    before (the shift is linear, so the four lookups xor together)."""
    basis = np.array([1 << k for k in range(32)], dtype=np.uint32)
    for _ in range(_BLOCK):
        basis = _TABLE_NP[basis & 0xFF] ^ (basis >> 8)
    bits = [int(v) for v in basis]
    tables = []
    for byte in range(4):
        t = []
        for value in range(256):
            out = 0
            for k in range(8):
                if value >> k & 1:
                    out ^= bits[8 * byte + k]
            t.append(out)
        tables.append(t)
    return tables


def crc32c(data: Union[bytes, bytearray, memoryview], crc: int = 0) -> int:
    """CRC32C of `data`, extending `crc` (the CRC of the bytes before): crc32c(b"123456789") is
    0xE3069283, and crc32c(b, crc32c(a)) == crc32c(a + b)."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    reg = (crc ^ 0xFFFFFFFF) & 0xFFFFFFFF
    if buf.size < _SMALL:
        return _update(reg, buf.tobytes()) ^ 0xFFFFFFFF
    nblocks = buf.size // _BLOCK
    columns = buf[:nblocks * _BLOCK].reshape(nblocks, _BLOCK).T.copy()  # row j: byte j of every block
    regs = np.zeros(nblocks, dtype=np.uint32)
    for row in columns:
        regs = _TABLE_NP[(regs ^ row) & 0xFF] ^ (regs >> 8)
    t0, t1, t2, t3 = _shift_tables()
    for block_crc in regs.tolist():
        reg = t0[reg & 0xFF] ^ t1[reg >> 8 & 0xFF] ^ t2[reg >> 16 & 0xFF] ^ t3[reg >> 24] ^ block_crc
    return _update(reg, buf[nblocks * _BLOCK:].tobytes()) ^ 0xFFFFFFFF

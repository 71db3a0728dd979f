"""Per-row int8 quantisation of serving checkpoints (docs/FORMAT.md section 8).

Each row `x` (cast to float32) gets an `offset` (its minimum, rounded down to the scale dtype) and a
`scale` (``(max - offset) / 255`` rounded up to the scale dtype, so no code clamps at the top; it
is 0 only for a constant row whose value the scale dtype holds exactly, and such a row decodes
exactly):

    code = clamp(round_half_even((x - offset) / scale), 0, 255) - 128   (int8; -128 when scale == 0)
    x'   = (code + 128) * scale + offset                               (float32)

both computed in float32 with `scale` and `offset` widened to float32. With float16 scales the
product ``(code + 128) * scale`` is exact in float32 (8 + 11 significant bits), so a fused or an
unfused multiply-add gives the same bits. Every value is within ``scale / 2`` of the original,
plus float32 rounding of the subtraction, division and addition: ``(max - min) / 510`` plus what
rounding scale and offset to their dtype adds (a relative 2**-10 of the scale for a normal
float16, at most 2**-24 among its subnormals).
"""
from __future__ import annotations

from typing import Tuple

import torch

from recsave.errors import UsageError

SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def quantize_rows(rows: torch.Tensor, scale_dtype: torch.dtype = torch.float16, *,
                  what: str = "rows") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 [n, d], scale [n, 1], offset [n, 1]) of the float rows [n, d]. UsageError (naming
    `what`) for rows with NaN or infinite values, or whose offset / scale the scale dtype cannot hold."""
    x = rows.detach().to(torch.float32)
    n = x.shape[0]
    if x.numel() == 0:
        return (torch.empty(x.shape, dtype=torch.int8), torch.empty(n, 1, dtype=scale_dtype),
                torch.empty(n, 1, dtype=scale_dtype))
    lo, hi = torch.aminmax(x, dim=1, keepdim=True)  # NaN propagates, so this finds NaN and inf rows
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    if not bool(finite.all()):
        bad = int((~finite).squeeze(1).nonzero()[0, 0])
        if bool(torch.isfinite(rows[bad]).all()):  # finite, beyond float32 (a float64 row): no dtype helps
            raise UsageError(f"{what}: row {bad} holds values beyond float32's range (largest "
                             f"{float(rows[bad].abs().max()):g}), in which int8 rows are computed; no serving "
                             f"dtype holds them (fix the rows)")
        raise UsageError(f"{what}: row {bad} has NaN or infinite values; int8 cannot represent them "
                         f"(export with dtype='fp32', 'fp16' or 'bf16', or fix the rows)")
    offset = lo.to(scale_dtype)
    above = offset.to(torch.float32) > lo  # rounded up: step down once, so offset <= min
    if bool(above.any()):
        offset = torch.where(above, torch.nextafter(offset, torch.full_like(offset, float("-inf"))), offset)
    span = (hi - offset.to(torch.float32)) / 255
    scale = span.to(scale_dtype)
    # Rounded down, (max - offset) / scale would pass 255 and the top codes clamp: among float16's
    # subnormals (rows spanning less than about 4e-3) by up to half the row's range. Step up once.
    below = scale.to(torch.float32) < span
    if bool(below.any()):
        scale = torch.where(below, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    if not (bool(torch.isfinite(offset).all()) and bool(torch.isfinite(scale).all())):
        fix = ("pass scale_dtype='float32'" if scale_dtype != torch.float32
               else "a row's span must fit a float32: export with dtype='fp32'")
        raise UsageError(f"{what}: values up to {float(torch.maximum(lo.abs(), hi.abs()).max()):.6g} exceed "
                         f"what a {scale_dtype} scale / offset can hold; {fix}")
    s32, o32 = scale.to(torch.float32), offset.to(torch.float32)
    # scale is 0 only when every value equals offset (a constant row the scale dtype holds exactly):
    # (x - offset) is then 0, and 0 / 1 gives code -128.
    steps = (x - o32).div_(torch.where(s32 > 0, s32, torch.ones_like(s32)))
    codes = steps.round_().clamp_(0, 255).sub_(128).to(torch.int8)
    return codes, scale, offset


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 rows ``(codes + 128) * scale + offset`` (module docstring)."""
    out = codes.to(torch.float32).add_(128)
    out.mul_(scale.to(torch.float32))
    return out.add_(offset.to(torch.float32))

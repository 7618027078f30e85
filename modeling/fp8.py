"""FP8 checkpoints with block scales (DeepSeek-V3, Kimi K2): each quantized `X.weight` is float8_e4m3fn with an fp32
`X.weight_scale_inv` of one factor per block (e.g. 128 x 128; the edge blocks may be partial). The loader
dequantizes tensor by tensor into the model dtype; nothing here runs in FP8."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class BlockFP8:
    """`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [rows, cols], ...}.
    (Activations stay in the model dtype, so "activation_scheme" does not matter.)"""

    block: tuple[int, int]  # rows, columns of the weight one scale factor covers

    @staticmethod
    def from_config(raw: dict) -> BlockFP8 | None:
        """None for an unquantized checkpoint; a ValueError for any quantization other than block-scaled FP8."""
        quant = raw.get("quantization_config")
        if not quant:
            return None
        method = quant.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method = {method!r} is not supported; only 'fp8' "
                             "with weight_block_size (DeepSeek-V3 style) is")
        block = quant.get("weight_block_size")
        if not block or len(block) != 2 or quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 quantization_config {quant}: only fmt 'e4m3' with a 2-D weight_block_size "
                             "is supported")
        return BlockFP8((int(block[0]), int(block[1])))

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                   index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """weight.float() * scale_inv per block, in fp32. `weight` [R, C] is the part at `index` (contiguous
        slices, as a tensor-parallel rank reads) of the matrix that `scale_inv` [ceil(rows / br), ceil(cols / bc)]
        covers in full; None: all of it."""
        index = index or ()
        scale = scale_inv.float()
        for dim, size in enumerate(self.block):
            start = (index[dim].start or 0) if dim < len(index) else 0
            length = weight.shape[dim]
            first = start // size
            blocks = scale.narrow(dim, first, (start + length - 1) // size + 1 - first)
            scale = blocks.repeat_interleave(size, dim).narrow(dim, start - first * size, length)
        return weight.float() * scale

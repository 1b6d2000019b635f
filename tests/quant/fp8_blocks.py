"""Block-wise FP8 as llm-compressor writes it (compressed-tensors 0.19
``forward_helpers._process_block`` with the ``memoryless_minmax`` observer),
written independently of vframe's reader: pad the weight with zeros to whole
``bn x bk`` blocks, scale each block by ``max |w| / 448``, round to e4m3, cut the
padding off. Scales ``[ceil(out / bn), ceil(in / bk)]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn


def fp8_block_quantize(
    w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], scales [ceil(out / bn), ceil(in / bk)], dequantized [out, in]): the
    dequantized weight is each e4m3 value times its block's scale in float32, as checkpoint readers
    compute it (a float32 scale times 4 significant bits may round)."""
    bn, bk = block
    out, inp = w.shape
    rows, cols = -(-out // bn), -(-inp // bk)
    padded = F.pad(w.float(), (0, cols * bk - inp, 0, rows * bn - out))  # zeros do not change a block's max
    blocks = padded.reshape(rows, bn, cols, bk).transpose(1, 2)  # [rows, cols, bn, bk]
    scales = (blocks.abs().amax(dim=(2, 3)) / 448).clamp(min=1e-12).to(scale_dtype)  # [rows, cols]
    q = (blocks / scales.float()[:, :, None, None]).clamp(-448, 448).to(E4M3)
    q = q.transpose(1, 2).reshape(rows * bn, cols * bk)[:out, :inp]
    dequantized = torch.empty(out, inp)
    for r in range(out):  # row by row, so the block index is plainly o // bn, i // bk
        dequantized[r] = q[r].float() * scales[r // bn].float()[torch.arange(inp) // bk]
    return q.contiguous(), scales, dequantized

"""FP8 rollout weights: block-quantized float8_e4m3fn, as DeepSeek-V3 checkpoints, slime and SGLang
store them.

A decoder layer's linear projection weight W (M x N: attention q/k/v/o, MLP gate/up/down, MoE
experts) is cut into 128 x 128 blocks (the last ones ragged); each block gets one float32 scale
s = max(absmax(block), EPS) / 448 and its entries q = clamp(W * (1/s), -448, 448) in e4m3. The
scales travel as `<name>_scale_inv` (so `...proj.weight_scale_inv`, shape (ceil(M/128),
ceil(N/128))), and W ~= q * s blockwise (`dequantize_blockwise`). Everything else (embeddings,
lm_head, norms, biases, 1-D tensors) keeps the high-precision dtype. SGLang serves a checkpoint
stored this way when its config.json carries `quantization_config()`.

Pure torch (CPU or GPU), no Triton: the trainer quantizes while staging a weight sync on its
device, the built-in engine dequantizes what it receives, the benchmark measures the gap.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = (128, 128)
EPS = 1e-10  # the smallest absmax a block's scale is computed from (slime's kernel): an all-zero block gets s > 0
SCALE_SUFFIX = "_scale_inv"

# HF names of the decoder layers' linear projections (Llama/Qwen/Mistral-style, MoE experts and
# shared experts included); matched against the whole name.
_QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(?:"
    r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj)"
    r"|mlp\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"|mlp\.shared_experts?\.(?:gate_proj|up_proj|down_proj)"
    r")\.weight"
)


def quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """What config.json's `quantization_config` says of weights stored this way (SGLang's fp8)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def is_quantized_name(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether the weight sync sends `name` (of `shape`) as e4m3 + scales: a 2-D decoder-layer
    linear projection weight."""
    return len(shape) == 2 and _QUANTIZED.fullmatch(name) is not None


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def quantized_nbytes(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> int:
    """Bytes of a quantized weight of `shape` on the wire: one per entry plus its float32 scales."""
    return math.prod(shape) + 4 * math.prod(scale_shape(shape, block))


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in float8_e4m3fn of w's shape, scale_inv in float32 of shape (ceil(M/bm), ceil(N/bn))),
    computed on w's device in float32; w ~= q * scale_inv blockwise."""
    if w.dim() != 2:
        raise ValueError(f"blockwise fp8 quantization takes a 2-D weight, got shape {list(w.shape)}")
    rows, cols = w.shape
    bm, bn = block
    mb, nb = math.ceil(rows / bm), math.ceil(cols / bn)
    x = w.detach().float()
    if (mb * bm, nb * bn) != (rows, cols):  # ragged edge blocks: zeros change no absmax
        x = torch.nn.functional.pad(x, (0, nb * bn - cols, 0, mb * bm - rows))
    blocks = x.view(mb, bm, nb, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_(min=EPS) / FP8_MAX
    inverse = (1.0 / scale)[:, None, :, None]
    q = (blocks * inverse).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(mb * bm, nb * bn)
    if q.shape != (rows, cols):
        q = q[:rows, :cols].contiguous()
    return q, scale


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale_inv blockwise, in `dtype`. `q` may be a block of rows starting at a multiple of
    block[0] (a row split), with the matching rows of `scale_inv`."""
    if q.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"dequantize takes 2-D tensors, got {list(q.shape)} and {list(scale_inv.shape)}")
    if tuple(scale_inv.shape) != scale_shape(q.shape, block):
        raise ValueError(f"a weight of shape {list(q.shape)} in {list(block)} blocks has scales of shape "
                         f"{list(scale_shape(q.shape, block))}, got {list(scale_inv.shape)}")
    rows, cols = q.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (q.float() * scales).to(dtype)


def quantize_dequantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """w as an engine serving its fp8 form sees it (in w's dtype)."""
    q, scale = quantize_blockwise(w, block)
    return dequantize_blockwise(q, scale, block, dtype=w.dtype)


def quantize_named(name: str, tensor: torch.Tensor, block: tuple[int, int] = BLOCK) -> list[tuple[str, torch.Tensor]]:
    """[(name, q), (name_scale_inv, scale)] for a quantized name, else [(name, tensor)]."""
    if not is_quantized_name(name, tensor.shape):
        return [(name, tensor)]
    q, scale = quantize_blockwise(tensor, block)
    return [(name, q), (scale_name(name), scale)]


def dequantize_named(tensors: Mapping[str, torch.Tensor], row_offsets: Mapping[str, int] | None = None,
                     block: tuple[int, int] = BLOCK) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The e4m3 weights among `tensors` with their `_scale_inv` partners replaced by their float32
    dequantized values (everything else unchanged); row offsets kept for the weights (a scale's
    offset must be its weight's / block[0]). Raises ValueError naming a weight without its scales,
    scales without their weight, or a row split not on a block boundary."""
    offsets = dict(row_offsets or {})
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in tensors:
            continue
        if tensor.dtype != FP8_DTYPE:
            if name.endswith(SCALE_SUFFIX):
                raise ValueError(f"{name!r}: scales without their weight {name.removesuffix(SCALE_SUFFIX)!r}")
            out[name] = tensor
            continue
        scale = tensors.get(scale_name(name))
        if scale is None:
            raise ValueError(f"{name!r} is float8_e4m3fn but {scale_name(name)!r} (its block scales) is missing")
        start = offsets.get(name, 0)
        if start % block[0] or offsets.get(scale_name(name), start // block[0]) != start // block[0]:
            raise ValueError(f"{name!r}: rows from {start} with scale rows from {offsets.get(scale_name(name))} are "
                             f"not on a {block[0]}-row block boundary")
        offsets.pop(scale_name(name), None)
        out[name] = dequantize_blockwise(tensor, scale, block)
    return out, {k: v for k, v in offsets.items() if k in out}

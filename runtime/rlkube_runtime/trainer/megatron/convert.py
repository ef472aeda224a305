"""HF <-> megatron-core weight conversion for the Llama, Qwen2, Qwen3 and Qwen3-MoE families.

Why not mbridge (what slime uses): mbridge 0.15 builds its models with TransformerEngine layer
specs (`use_transformer_engine=True` is hard-coded, so its names are TE's fused
`linear_qkv.layer_norm_weight` and friends) and moves tensors to CUDA in its export and
pipeline-broadcast paths. rlkube runs megatron-core's local layer spec without
TransformerEngine, on CPU with gloo as well as on GPUs, so mbridge does not fit; the mapping
for these three families is small enough to own.

Names. Megatron (local spec) per layer i: input_layernorm, self_attention.{linear_qkv,
q_layernorm,k_layernorm,linear_proj}, pre_mlp_layernorm, mlp.{linear_fc1,linear_fc2};
plus embedding.word_embeddings, decoder.final_layernorm and output_layer.
- linear_qkv holds, per key/value group, that group's query heads then its key then its value
  (group-major), so an even split of dim 0 gives each tensor-parallel rank whole groups.
- linear_fc1 is [gate; up]; a tensor-parallel rank holds [its gate rows; its up rows].
- Row-parallel weights (linear_proj, linear_fc2) split dim 1; vocabulary tensors dim 0.
- Mixture of experts (SequentialMLP): mlp.router.weight is HF's mlp.gate.weight; expert e's
  mlp.experts.local_experts.<e>.linear_fc1/linear_fc2 are [gate; up] and down of HF's
  mlp.experts.<e>.{gate,up,down}_proj (the per-expert names of HF checkpoints and of SGLang's
  loaders), split over tensor-parallel ranks like the dense MLP's. Expert indices here are global.

Everything here is pure tensor reshuffling: conversions are exact (bitwise) both ways.
"""

from __future__ import annotations

import re

import torch

from .model import HFArchitecture

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Per-layer names that map one to one (megatron suffix -> HF suffix).
_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# How a full tensor is split over tensor-parallel ranks: dimension, or None (replicated).
_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
           "self_attention.linear_qkv.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_ROUTER = "mlp.router.weight"


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: HFArchitecture) -> dict[str, torch.Tensor]:
    """Full (tensor-parallel 1) megatron tensors, named with global layer indices."""
    out: dict[str, torch.Tensor] = {}
    for mg, name in _GLOBAL.items():
        if mg == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        out[mg] = _take(hf, name)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        q = f"decoder.layers.{i}."
        for mg, name in _SAME.items():
            if ("_layernorm" in mg and "self_attention" in mg and not arch.qk_norm) or (
                    mg.startswith("mlp.") and arch.num_experts):
                continue
            out[q + mg] = _take(hf, p + name)
        out[q + "self_attention.linear_qkv.weight"] = _interleave_qkv(
            [_take(hf, p + f"self_attn.{x}_proj.weight") for x in "qkv"], arch
        )
        if arch.qkv_bias:
            out[q + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                [_take(hf, p + f"self_attn.{x}_proj.bias") for x in "qkv"], arch
            )
        if arch.num_experts:
            out[q + _ROUTER] = _take(hf, p + "mlp.gate.weight")
            for e in range(arch.num_experts):
                hf_expert, mg_expert = f"{p}mlp.experts.{e}.", f"{q}mlp.experts.local_experts.{e}."
                out[mg_expert + "linear_fc1.weight"] = _gate_up(hf, hf_expert)
                out[mg_expert + "linear_fc2.weight"] = _take(hf, hf_expert + "down_proj.weight")
            continue
        out[q + "mlp.linear_fc1.weight"] = _gate_up(hf, p + "mlp.")
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], arch: HFArchitecture) -> dict[str, torch.Tensor]:
    """HF tensors from full megatron ones (the inverse of `hf_to_megatron`). With tied
    embeddings `lm_head.weight` is the very tensor of `model.embed_tokens.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mg.items():
        if name in _GLOBAL:
            if not (name == "output_layer.weight" and arch.tie_word_embeddings):
                out[_GLOBAL[name]] = tensor
            continue
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"unexpected megatron tensor {name!r}")
        i, suffix = int(m.group(1)), m.group(2)
        p = f"model.layers.{i}."
        if suffix in _SAME:
            out[p + _SAME[suffix]] = tensor
        elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            for x, part in zip("qkv", _split_qkv(tensor, arch)):
                out[p + f"self_attn.{x}_proj.{kind}"] = part
        elif suffix == _ROUTER:
            out[p + "mlp.gate.weight"] = tensor
        elif _is_fc1(suffix):  # the dense MLP's [gate; up] or an expert's
            expert = _EXPERT.match(suffix)
            mlp = p + ("mlp." if expert is None else f"mlp.experts.{expert.group(1)}.")
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = tensor.chunk(2, dim=0)
        elif (expert := _EXPERT.match(suffix)) is not None:  # an expert's down projection
            out[p + f"mlp.experts.{expert.group(1)}.down_proj.weight"] = tensor
        else:
            raise KeyError(f"unexpected megatron tensor {name!r}")
    if arch.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def tp_split(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part of the full megatron tensor `name`."""
    if size == 1:
        return tensor
    suffix = _suffix(name)
    if suffix in _COLUMN:
        return tensor.chunk(size, dim=0)[rank]
    if _is_row(suffix):
        return tensor.chunk(size, dim=1)[rank]
    if _is_fc1(suffix):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return tensor


def tp_merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor `name` from every tensor-parallel rank's part (rank order)."""
    if len(parts) == 1:
        return parts[0]
    suffix = _suffix(name)
    if suffix in _COLUMN:
        return torch.cat(parts, dim=0)
    if _is_row(suffix):
        return torch.cat(parts, dim=1)
    if _is_fc1(suffix):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return parts[0]


def is_tp_sharded(name: str) -> bool:
    """Whether tensor-parallel ranks hold different parts of `name` (else identical copies)."""
    return tp_partition_dim(name) is not None


def tp_partition_dim(name: str) -> int | None:
    """The dimension tensor-parallel ranks split `name` along, None when each holds all of it."""
    suffix = _suffix(name)
    if suffix in _COLUMN or _is_fc1(suffix):
        return 0
    if _is_row(suffix):
        return 1
    return None


def _is_fc1(suffix: str) -> bool:
    """A [gate; up] weight: the dense MLP's or an expert's."""
    expert = _EXPERT.match(suffix)
    return suffix == "mlp.linear_fc1.weight" or (expert is not None and expert.group(2) == "linear_fc1")


def _is_row(suffix: str) -> bool:
    expert = _EXPERT.match(suffix)
    return suffix in _ROW or (expert is not None and expert.group(2) == "linear_fc2")


def is_expert(name: str) -> bool:
    """Whether `name` is one expert's weight (expert-parallel ranks hold different experts)."""
    return _EXPERT.match(_suffix(name)) is not None


def shift_expert(name: str, offset: int) -> str:
    """An expert weight's name with its expert index moved by `offset`: local -> global with
    the rank's first expert index (ep_rank x experts per rank), global -> local with minus it.
    Other names are returned as they are."""
    m = _LAYER.match(name)
    expert = _EXPERT.match(m.group(2)) if m else None
    if expert is None:
        return name
    return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{int(expert.group(1)) + offset}.{expert.group(2)}.weight"


def to_local_layer(name: str, offset: int) -> str:
    """A global-index megatron name as a pipeline stage whose first layer is `offset` names it."""
    m = _LAYER.match(name)
    return name if m is None else f"decoder.layers.{int(m.group(1)) - offset}.{m.group(2)}"


def to_global_layer(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    return name if m is None else f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"


def layer_of(name: str) -> int | None:
    """The global layer index of a megatron name, None for embedding/final norm/output."""
    m = _LAYER.match(name)
    return None if m is None else int(m.group(1))


def _suffix(name: str) -> str:
    m = _LAYER.match(name)
    return name if m is None else m.group(2)


def _interleave_qkv(qkv: list[torch.Tensor], arch: HFArchitecture) -> torch.Tensor:
    q, k, v = qkv
    groups, per = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, per * arch.head_dim, *rest)
    k = k.reshape(groups, arch.head_dim, *rest)
    v = v.reshape(groups, arch.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def _split_qkv(fused: torch.Tensor, arch: HFArchitecture) -> tuple[torch.Tensor, ...]:
    groups, per, d = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    rest = fused.shape[1:]
    g = fused.reshape(groups, (per + 2) * d, *rest)
    q, k, v = g.split([per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _gate_up(hf: dict[str, torch.Tensor], mlp: str) -> torch.Tensor:
    """linear_fc1 of the HF MLP (or expert) whose names start with `mlp`: [gate; up]."""
    return torch.cat([_take(hf, mlp + "gate_proj.weight"), _take(hf, mlp + "up_proj.weight")])


def _take(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"the HF checkpoint has no tensor {name!r}")
    return hf[name]

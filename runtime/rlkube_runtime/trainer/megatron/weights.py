"""HF files and a megatron model: reading an HF checkpoint's tensors (safetensors, sharded or not)
without building the model, loading a rank's share of them into its GPTModel stage, and writing
an HF directory from HF-named tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import convert
from .model import HFArchitecture


def read_hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in `hf_dir` (index-listed or all of them), as stored."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir} has no *.safetensors weights (the megatron backend reads safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(hf_dir / name)))
    return tensors


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, arch: HFArchitecture, *, tp_rank: int, tp_size: int,
                 first_expert: int = 0, expert_tp: tuple[int, int] | None = None) -> None:
    """Copy this tensor/pipeline rank's share of the HF checkpoint in `hf_dir` into `model`.
    A mixture of experts: this expert-parallel rank's experts start at global index
    `first_expert`, split over `expert_tp` = (rank, size) (default: the tensor-parallel ones)."""
    offset = layer_offset(model)
    hf = read_hf_tensors(hf_dir)
    full = convert.hf_to_megatron(hf, arch)
    with torch.no_grad():
        for name, param in named_weights(model):
            key = convert.shift_expert(convert.to_global_layer(name, offset), first_expert)
            if key == "output_layer.weight" and arch.tie_word_embeddings:
                key = "embedding.word_embeddings.weight"  # the last stage's copy of the embeddings
            if key not in full:
                raise KeyError(f"no HF tensor converts to megatron parameter {key!r}")
            rank, size = (expert_tp or (tp_rank, tp_size)) if convert.is_expert(key) else (tp_rank, tp_size)
            part = convert.tp_split(key, full[key], rank, size)
            if tuple(part.shape) != tuple(param.shape):
                raise ValueError(f"{key}: converted shape {tuple(part.shape)} != model shape {tuple(param.shape)}")
            param.copy_(part)
            _mark_tensor_parallel(param, convert.tp_partition_dim(key))


def _mark_tensor_parallel(param: torch.Tensor, dim: int | None) -> None:
    """The attributes megatron-core's grad-norm and optimizer read to tell shards from copies.
    Its layers set them only while initialising weights, which loading replaces
    (perform_initialization=False)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if dim is not None and not getattr(param, "tensor_model_parallel", False):
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                delattr(param, attr)
        set_tensor_model_parallel_attributes(param, True, dim, 1)


def write_hf_directory(weights: dict[str, torch.Tensor], directory: str | Path, source: str, *,
                       trust_remote_code: bool, tied: bool) -> Path:
    """config.json (and generation config), model.safetensors and the tokenizer of `source`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(directory)
    generation = Path(source) / "generation_config.json"
    if generation.is_file():
        (directory / "generation_config.json").write_bytes(generation.read_bytes())
    tensors = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    try:
        AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(directory)
    except (OSError, ValueError) as err:
        raise RuntimeError(f"could not copy the tokenizer of {source!r} into {directory}: {err}") from err
    return directory


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters of a GPTModel stage by state-dict name (no `_extra_state`, no buffers)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor) and "rotary_pos_emb" not in k]


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of this pipeline stage's first decoder layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0

"""Reading an HF checkpoint's tensors (safetensors, sharded or not) without building the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch


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

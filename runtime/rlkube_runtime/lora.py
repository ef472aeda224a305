"""LoRA adapters as they travel: peft's directory format, and merging one into base weights.

The trainer writes its adapter with peft (`adapter_config.json` and `adapter_model.safetensors`,
tensors named `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`), the form SGLang's
/load_lora_adapter reads. The built-in engine and the HF export read that same directory and fold
it into the base weights, W + scaling * B @ A, with `merged_weights`: one definition of what an
adapter does to a layer, whoever applies it. torch is imported where tensors are handled: the
rollout side reads `ADAPTER_NAME` in processes that never load it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The one adapter a job's engines serve; generation requests name it in `lora_path`.
ADAPTER_NAME = "policy"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def read_adapter(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, {tensor name: tensor}) of a peft adapter directory; raises ValueError
    naming the missing file."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"{directory} is not a LoRA adapter directory: it has no {name}")
    config = json.loads((directory / CONFIG_FILE).read_text())
    return config, load_file(str(directory / WEIGHTS_FILE))


def scaling_of(config: Mapping) -> float:
    """What B @ A is multiplied by under peft's config: alpha / r, or alpha / sqrt(r) rank-stabilised."""
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def adapted_modules(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path in the HF model: (A [r, in], B [out, r])}; raises ValueError naming a tensor
    without its partner or outside peft's naming."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        for suffix, part in ((_A, "A"), (_B, "B")):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                module = module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise ValueError(f"adapter tensor {name!r} is neither a lora_A nor a lora_B weight")
    incomplete = sorted(m for m, p in pairs.items() if len(p) != 2)
    if incomplete:
        raise ValueError(f"adapter modules without both lora_A and lora_B: {incomplete[:5]}")
    return {m: (p["A"], p["B"]) for m, p in pairs.items()}


def merged_weights(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """{`<module>.weight`: base + scaling * B @ A} for every module the adapter adapts, computed in
    float32 and returned in the base weight's dtype and device. Raises ValueError naming a module
    the base lacks or whose shapes do not fit."""
    import torch

    merged = {}
    for module, (a, b) in adapted_modules(adapter).items():
        name = f"{module}.weight"
        if name not in base:
            raise ValueError(f"the adapter adapts {module!r}, which the model does not have ({name} is not a weight)")
        weight = base[name]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ValueError(f"adapter for {module!r}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not make "
                             f"the weight's shape {tuple(weight.shape)}")
        delta = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)
        merged[name] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged


def adapter_bytes(directory: str | Path) -> int:
    """Bytes a weight sync writes and each engine reads for one adapter."""
    return sum((Path(directory) / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE))

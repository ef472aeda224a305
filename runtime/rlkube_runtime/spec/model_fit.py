"""What the spec asks of the model itself, checked wherever its config.json can be read: by
`rlkube validate` when spec.model.hfCheckpoint is a local directory, and by `rlkube run` (on a
cluster, the driver) before anything starts.

The parallel sizes must split the model evenly (tensor: attention and key/value heads, the
vocabulary and the MLP channels; pipeline: the layers), the megatron backend must know the
architecture, and a mixture-of-experts model must be one whose experts the weight sync names one
by one (Qwen3-MoE: `expert_names.py`, the megatron conversion); others are refused by model type.
Plain dictionaries in, (path relative to spec, message) pairs out, as in backend_rules.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .backend_rules import backend_violations, chosen_backend, with_backend
from .megatron_args import moe_loss_keys

# The HF model types the megatron backend converts (trainer/megatron/model.py builds them).
MEGATRON_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# The MoE architectures whose experts both backends train and the weight sync names one by one
# (expert_names.py): the torch backend through transformers, the megatron backend's conversion.
MOE_MODEL_TYPES = ("qwen3_moe",)

# config.json keys that give a mixture-of-experts model's expert count (Qwen-MoE, Mixtral, DeepSeek).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count_key(config: Mapping[str, Any]) -> str | None:
    """The config.json key that makes this a mixture-of-experts model, or None for a dense one."""
    return next((key for key in _EXPERT_COUNT_KEYS if (config.get(key) or 0) > 1), None)


def split_violations(tensor: int, pipeline: int, config: Mapping[str, Any], *, expert: int = 1,
                     expert_tensor: int | None = None, sequence_parallel: bool | None = None) -> list[tuple[str, str]]:
    """Where tensor/pipeline/expert sizes do not divide the model of this config.json, or (given
    `sequence_parallel`, as training is) split a mixture of experts as megatron-core cannot train it."""
    heads = config["num_attention_heads"]
    parts = (("attention heads", heads), ("key/value heads", config.get("num_key_value_heads") or heads),
             ("vocabulary entries", config["vocab_size"]), ("MLP channels", config["intermediate_size"]))
    violations = [("parallelism.tensor", f"{tensor} does not divide the model's {n} {what}")
                  for what, n in parts if n % tensor]
    layers = config["num_hidden_layers"]
    if layers % pipeline:
        violations.append(("parallelism.pipeline", f"{pipeline} does not divide the model's {layers} layers"))
    if expert > 1:
        key = expert_count_key(config)
        if key is None:
            violations.append(("parallelism.expert", f"{expert} splits a mixture of experts' experts; the model "
                               f"({config.get('model_type')}) is dense"))
        elif config[key] % expert:
            violations.append(("parallelism.expert", f"{expert} does not divide the model's {config[key]} experts"))
    moe = expert_count_key(config)
    if expert_tensor and expert_tensor > 1:
        channels = config.get("moe_intermediate_size")
        if moe is None:
            violations.append(("parallelism.expertTensor", f"{expert_tensor} splits a mixture of experts' experts; "
                               f"the model ({config.get('model_type')}) is dense"))
        elif channels and channels % expert_tensor:
            violations.append(("parallelism.expertTensor", f"{expert_tensor} does not divide the model's {channels} "
                               "expert MLP channels (moe_intermediate_size)"))
    if moe and tensor > 1 and sequence_parallel is False:
        violations.append(("parallelism.sequenceParallel", f"megatron-core trains a mixture of experts over tensor "
                           f"({tensor}) ranks only with sequence parallelism; set it true"))
    return violations


def moe_only_violations(megatron_args: Mapping[str, Any] | None, config: Mapping[str, Any], *,
                        routing_replay: bool = False) -> list[tuple[str, str]]:
    """What only a mixture of experts can have, asked of a dense model of this config.json:
    megatronArgs MoE losses, and routing replay (training.routingReplay)."""
    if expert_count_key(config):
        return []
    dense = f"the model (config.json model_type {config.get('model_type')!r}) has no experts"
    violations = [(f"model.megatronArgs.{key}", f"a mixture-of-experts loss, and {dense}; remove it")
                  for key in moe_loss_keys(megatron_args)]
    if routing_replay:
        violations.append(("training.routingReplay", f"replays a mixture of experts' routing, and {dense}; leave it false"))
    return violations


def model_fit_violations(spec: Any, config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What `spec` (an RLJobSpec) asks that the model of `config` (its config.json) cannot do."""
    moe = expert_count_key(config)
    if moe and config.get("model_type") not in MOE_MODEL_TYPES:
        return [("model", f"config.json {moe}: {config[moe]}: a mixture-of-experts model of type "
                 f"{config.get('model_type')!r}; RL jobs run the MoE types {list(MOE_MODEL_TYPES)}")]
    backend, _ = chosen_backend(spec, config)
    if backend != "megatron":
        return []
    model_type = config.get("model_type")
    if model_type not in MEGATRON_MODEL_TYPES:
        return [("training.backend", f"megatron converts HF model types {list(MEGATRON_MODEL_TYPES)}; the "
                 f"checkpoint's config.json has model_type {model_type!r}")]
    par = spec.parallelism
    violations = split_violations(par.tensor, par.pipeline, config, expert=par.expert, expert_tensor=par.expert_tensor,
                                  sequence_parallel=par.sequence_parallel)
    violations += moe_only_violations(spec.model.megatron_args, config, routing_replay=spec.training.routing_replay)
    if chosen_backend(spec)[0] != backend:  # `auto` chose megatron for this model: megatron's rules apply
        violations = backend_violations(with_backend(spec, backend)) + violations
    return violations


def read_model_config(path: str | Path) -> dict[str, Any] | None:
    """config.json of a local HF checkpoint directory; None when `path` is not one (a hub id, or
    storage only the cluster sees)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    with file.open() as stream:
        return json.load(stream)

"""Which spec.model.megatronArgs keys the megatron backend can set, decided without importing
megatron-core, so `rlkube validate`, the operator and the trainer refuse the same keys.

A key is a Megatron-LM flag name without dashes (`attention-softmax-in-fp32`, or with
underscores) naming a field of megatron-core's TransformerConfig or OptimizerConfig; the field
names and simple types come from `megatron_fields.py`, generated from the megatron-core the
images install (`python -m rlkube_runtime.spec.megatron_args > .../megatron_fields.py`; a test
fails when it is stale). A key the HF config.json or another spec field already sets is refused
with the field to use instead.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping

from .megatron_fields import MEGATRON_CORE_VERSION, OPTIMIZER_FIELDS, TRANSFORMER_FIELDS

# Read from the HF config: a megatronArgs key naming one of these would contradict the weights.
FROM_HF_CONFIG = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "normalization", "layernorm_epsilon", "gated_linear_unit", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "vocab_size", "rotary_base", "max_position_embeddings",
    "untie_embeddings_and_output_weights", "group_query_attention", "swiglu",
})
# Set by spec.parallelism or by the backend itself (precision, CPU mode, how losses are scaled).
OWNED = {
    "tensor_model_parallel_size": "spec.parallelism.tensor",
    "pipeline_model_parallel_size": "spec.parallelism.pipeline",
    "context_parallel_size": "spec.parallelism.context",
    "expert_model_parallel_size": "spec.parallelism.expert",
    "sequence_parallel": "spec.parallelism.sequenceParallel",
    "recompute_granularity": "spec.parallelism.recompute",
    "bf16": "spec.model.dtype", "fp16": "spec.model.dtype", "params_dtype": "spec.model.dtype",
    "lr": "spec.training.optimizer.lr", "min_lr": "spec.training.optimizer.minLr",
    "weight_decay": "spec.training.optimizer.weightDecay", "clip_grad": "spec.training.optimizer.clipGrad",
    "adam_beta1": "spec.training.optimizer.beta1", "adam_beta2": "spec.training.optimizer.beta2",
    "adam_eps": "spec.training.optimizer.eps", "calculate_per_token_loss": "the backend's loss scaling",
    "use_cpu_initialization": "the backend (on when there is no GPU)",
}

# MoE fields: the router and experts come from the model's config.json (trainer/megatron/model.py), not from here.
_MOE_PREFIXES = ("moe_", "num_moe_experts", "expert_")
# ...except the load-balancing losses, which change the objective and not the routing. The trainer
# weighs them as Megatron-LM does (each micro-batch's loss over the micro-batch count, averaged over
# data-parallel ranks) and leaves out the zero-weight micro-batches that even the expert ranks' work.
# global_aux_loss keeps token counts across steps (reset by Megatron-LM's own training loop) and
# sinkhorn routes differently from the engine's HF block: neither is offered.
MOE_LOSS_KEYS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type")
MOE_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")

_TYPE_CHECKS = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


def megatron_arg_name(key: str) -> str:
    """The config field a megatronArgs key names."""
    return key.lstrip("-").replace("-", "_")


def megatron_arg_problem(key: str, value: Any) -> str | None:
    """Why megatronArgs.<key>: <value> cannot be set, or None when it can."""
    name = megatron_arg_name(key)
    if name in FROM_HF_CONFIG:
        return "the architecture comes from the HF checkpoint's config.json; remove it"
    if name in OWNED:
        return f"set by {OWNED[name]}; remove it here"
    if name in MOE_LOSS_KEYS:
        return _moe_loss_problem(name, value)
    if name.startswith(_MOE_PREFIXES):
        return ("a mixture-of-experts setting; RL jobs build the router from the model's config.json (routed as its "
                f"HF block); of the MoE keys only {', '.join(MOE_LOSS_KEYS)} can be set; remove it")
    kind = TRANSFORMER_FIELDS.get(name) or OPTIMIZER_FIELDS.get(name)
    if kind is None:
        return (f"not a field of megatron-core {MEGATRON_CORE_VERSION}'s TransformerConfig or OptimizerConfig "
                "(keys are Megatron-LM flag names without the dashes)")
    if value is False or kind == "any":  # false leaves a flag at its default, like the omitted flag
        return None
    base, optional = kind.rstrip("?"), kind.endswith("?")
    if (value is None and not optional) or (value is not None and not _TYPE_CHECKS[base](value)):
        return f"{value!r} is not a {base}{' or null' if optional else ''}, the type of megatron-core's {name}"
    return None


def _moe_loss_problem(name: str, value: Any) -> str | None:
    if name == "moe_router_load_balancing_type":
        if value not in MOE_BALANCING_TYPES:
            return f"{value!r} is not one of {list(MOE_BALANCING_TYPES)}"
        return None
    if name == "moe_z_loss_coeff" and value is None:
        return None
    if not _TYPE_CHECKS["float"](value) or value < 0:
        return f"{value!r} is not a float >= 0"
    return None


def moe_loss_keys(args: Mapping[str, Any] | None) -> list[str]:
    """The megatronArgs keys (as written) that set a mixture-of-experts load-balancing loss."""
    return [key for key in (args or {}) if megatron_arg_name(key) in MOE_LOSS_KEYS]


def megatron_args_violations(args: Mapping[str, Any], *, pipeline: int = 1, expert: int = 1) -> list[tuple[str, str]]:
    """(path relative to spec, message) for every megatronArgs key the megatron backend cannot
    set, alone or beside the others and the parallel sizes."""
    violations = [(f"model.megatronArgs.{key}", problem) for key, value in (args or {}).items()
                  if (problem := megatron_arg_problem(key, value)) is not None]
    named = {megatron_arg_name(key): key for key in (args or {})}
    coeff_key = named.get("moe_aux_loss_coeff")
    balancing = args.get(named["moe_router_load_balancing_type"]) if "moe_router_load_balancing_type" in named else None
    if coeff_key and balancing == "none" and _TYPE_CHECKS["float"](args[coeff_key]) and args[coeff_key] > 0:
        violations.append((f"model.megatronArgs.{coeff_key}", "an auxiliary loss needs "
                           "moe_router_load_balancing_type aux_loss or seq_aux_loss (it is none here)"))
    if pipeline > 1 and expert > 1:
        # megatron-core's 1F1B schedule gives every micro-batch one aux-loss scale, the
        # zero-weight ones that even the expert ranks' work included.
        for key in moe_loss_keys(args):
            violations.append((f"model.megatronArgs.{key}", f"not with both spec.parallelism.pipeline ({pipeline}) and "
                               f"spec.parallelism.expert ({expert}) above 1: the pipeline schedule would count the "
                               "load-balancing loss of the empty micro-batches that keep expert ranks in step"))
    return violations


def megatron_arg_target(key: str) -> str:
    """"model" (TransformerConfig) or "optimizer" (OptimizerConfig): where a valid key goes."""
    return "model" if megatron_arg_name(key) in TRANSFORMER_FIELDS else "optimizer"


def _type_tag(annotation: Any) -> str:
    """bool/int/float/str, with '?' when None is allowed; 'any' for what YAML scalars cannot hold
    as such (callables, dtypes, enums, lists), whose values megatron-core checks itself."""
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "").replace(" ", "")
    optional = False
    for wrapper in ("Optional[",):
        if text.startswith(wrapper) and text.endswith("]"):
            text, optional = text[len(wrapper):-1], True
    for suffix in ("|None",):
        if text.endswith(suffix):
            text, optional = text[: -len(suffix)], True
    if text.startswith("None|"):
        text, optional = text[5:], True
    return (text + ("?" if optional else "")) if text in _TYPE_CHECKS else "any"


def render_fields_module() -> str:
    """megatron_fields.py for the installed megatron-core."""
    import megatron.core
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    def table(config) -> str:
        rows = "".join(f"    {f.name!r}: {_type_tag(f.type)!r},\n" for f in dataclasses.fields(config))
        return "{\n" + rows + "}"

    return (
        '"""Generated by `python -m rlkube_runtime.spec.megatron_args` from the installed megatron-core;\n'
        'do not edit. Each config field: bool/int/float/str (? when null is allowed) or any."""\n\n'
        f"MEGATRON_CORE_VERSION = {megatron.core.__version__!r}\n\n"
        f"TRANSFORMER_FIELDS = {table(TransformerConfig)}\n\n"
        f"OPTIMIZER_FIELDS = {table(OptimizerConfig)}\n"
    )


if __name__ == "__main__":
    sys.stdout.write(render_fields_module())

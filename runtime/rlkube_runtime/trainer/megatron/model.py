"""A megatron-core GPT model of an HF causal LM: the TransformerConfig its config.json gives,
the local (non-TransformerEngine) layer spec, and spec.model.megatronArgs on top.

Supported families: Llama, Qwen2 (biased q/k/v projections), Qwen3 (q/k RMSNorm), and Qwen3-MoE
(Qwen3's attention, every layer's MLP a routed mixture of SwiGLU experts). All are pre-norm
RMSNorm decoders with rotary embeddings, so one layer spec covers them (with megatron-core's MoE
layer in place of the MLP for Qwen3-MoE); `hf_architecture` refuses anything else naming the
field that differs. Qwen3-MoE's experts can be split over expert-parallel ranks
(`spec.parallelism.expert`), and megatronArgs may add megatron-core's load-balancing losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlkube_runtime.spec.megatron_args import (megatron_arg_name, megatron_arg_problem, megatron_arg_target,
                                               megatron_args_violations)
from rlkube_runtime.spec.model_fit import MEGATRON_MODEL_TYPES, moe_only_violations, split_violations

# Mixture-of-experts families the model builder and converter know (beside the dense ones).
MOE_MODEL_TYPES = ("qwen3_moe",)

@dataclass(frozen=True)
class HFArchitecture:
    """The shape of an HF decoder, as the converter and the model builder need it."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # Mixture of experts (0 experts: a dense MLP). moe_norm_topk: the top-k routing weights are
    # renormalised to sum to 1 (HF's norm_topk_prob), else they stay softmax-over-all shares.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = False


def hf_architecture(hf_config: Any) -> HFArchitecture:
    """The architecture of an HF `PretrainedConfig`; ValueError for unsupported models."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MEGATRON_MODEL_TYPES + MOE_MODEL_TYPES:
        raise ValueError(
            f"spec.training.backend: megatron supports HF model types {list(MEGATRON_MODEL_TYPES + MOE_MODEL_TYPES)}; "
            f"the checkpoint's config.json has model_type {model_type!r}"
        )
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", None):
        raise ValueError(
            f"spec.training.backend: megatron does not convert rope scaling {rope_type!r} (config.json "
            "rope_scaling); only plain rotary embeddings are supported"
        )
    theta = getattr(hf_config, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf_config.hidden_act!r}: only silu (SwiGLU) is supported")
    if model_type == "llama" and getattr(hf_config, "mlp_bias", False):
        raise ValueError("config.json mlp_bias: true is not supported by the megatron backend")
    if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("config.json use_sliding_window: true is not supported by the megatron backend")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return HFArchitecture(
        **_moe_fields(hf_config),
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(theta if theta is not None else 10000.0),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
    )


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    """HFArchitecture's expert fields of a Qwen3-MoE config (none for a dense model); refuses the
    layouts one layer spec cannot build: dense layers between sparse ones, shared experts."""
    if getattr(hf_config, "model_type", None) not in MOE_MODEL_TYPES:
        return {}
    if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
        raise ValueError("config.json decoder_sparse_step/mlp_only_layers: the megatron backend builds every "
                         "layer as a mixture of experts (decoder_sparse_step 1, no mlp_only_layers)")
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        raise ValueError("config.json shared_expert_intermediate_size: shared experts are not supported")
    return dict(num_experts=hf_config.num_experts, moe_topk=hf_config.num_experts_per_tok,
                moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                moe_norm_topk=bool(getattr(hf_config, "norm_topk_prob", False)))


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | full | selective
    expert: int = 1  # expert-parallel ranks of a mixture of experts (each holds experts/expert of them)
    expert_tensor: int | None = None  # tensor-parallel ranks each expert is split over (None: tensor's)

    @property
    def etp(self) -> int:
        """The expert-tensor-parallel size in effect (megatron-core's default: the tensor size)."""
        return self.expert_tensor or self.tensor

    @classmethod
    def from_spec(cls, spec: Any) -> ParallelSizes:
        par = spec.parallelism
        return cls(tensor=par.tensor, pipeline=par.pipeline, context=par.context,
                   sequence_parallel=par.sequence_parallel, recompute=par.recompute, expert=par.expert,
                   expert_tensor=par.expert_tensor)


def transformer_config(
    arch: HFArchitecture,
    sizes: ParallelSizes,
    *,
    dtype: torch.dtype,
    cpu: bool,
    overrides: dict[str, Any] | None = None,
    training: bool = True,
    routing_replay: bool = False,
):
    """The megatron-core TransformerConfig of `arch` under `sizes`, with `overrides` (from
    `split_megatron_args`) applied last; `training` False for a model only loaded and saved;
    `routing_replay`: routers that can take given experts (routing_replay.py)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_divisible(arch, sizes, training=training)
    recompute: dict[str, Any] = {}
    if sizes.recompute == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif sizes.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=sizes.expert_tensor,
        sequence_parallel=sizes.sequence_parallel,
        # Micro-batches have different shapes: pipeline stages exchange them before each transfer.
        variable_seq_lengths=sizes.pipeline > 1,
        moe_token_dispatcher_type="alltoall",  # MoE-only, but the default refuses variable lengths
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        # SwiGLU fused by torch.compile (megatron's jit_fuser) on a GPU; the other fused kernels
        # need apex or TransformerEngine, which rlkube does not install.
        bias_activation_fusion=not cpu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        **recompute,
    )
    overrides = dict(overrides or {})
    check_moe_settings(arch, sizes, overrides, routing_replay=routing_replay)
    fields.update(_moe_config(arch, cpu=cpu))
    if routing_replay:
        fields["moe_enable_routing_replay"] = True
    fields.update(overrides)
    if fields.get("moe_aux_loss_coeff", 0) > 0 and "moe_router_load_balancing_type" not in overrides:
        fields["moe_router_load_balancing_type"] = "aux_loss"  # a coefficient alone asks for the usual loss
    return TransformerConfig(**fields)


def check_moe_settings(arch: HFArchitecture, sizes: ParallelSizes, overrides: dict[str, Any], *,
                       routing_replay: bool = False) -> None:
    """Refuse load-balancing losses or routing replay on a dense model, and losses where the spec's
    rules refuse them (the spec's own checks, for callers that hold an architecture)."""
    for field, message in (moe_only_violations(overrides, _fit_config(arch), routing_replay=routing_replay)
                           + megatron_args_violations(overrides, pipeline=sizes.pipeline, expert=sizes.expert)):
        raise ValueError(f"spec.{field}: {message}")


def _moe_config(arch: HFArchitecture, *, cpu: bool) -> dict[str, Any]:
    """megatron-core's MoE fields for `arch`, routing as HF's Qwen3-MoE block does: softmax over
    every expert's logit, the top k kept (pre-softmax routing), renormalised when moe_norm_topk
    (which equals a softmax over the k kept logits: megatron's default order). Experts run one
    after another (SequentialMLP): grouped GEMM needs TransformerEngine or grouped_gemm. No
    load-balancing loss unless megatronArgs asks for one (`spec.megatron_args.MOE_LOSS_KEYS`). On the CPU tokens reach the experts through
    the all-gather dispatcher: the all-to-all one opens a CUDA stream when it is built."""
    if not arch.num_experts:
        return {}
    return dict(moe_token_dispatcher_type="allgather" if cpu else "alltoall",
                num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk,
                moe_ffn_hidden_size=arch.moe_ffn_hidden_size, moe_router_pre_softmax=not arch.moe_norm_topk,
                moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def _fit_config(arch: HFArchitecture) -> dict[str, Any]:
    """The config.json fields spec/model_fit.py's checks read, from an architecture."""
    return {"num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
            "vocab_size": arch.vocab_size, "intermediate_size": arch.ffn_hidden_size,
            "num_hidden_layers": arch.num_layers, "num_experts": arch.num_experts, "model_type": arch.model_type,
            "moe_intermediate_size": arch.moe_ffn_hidden_size}


def check_divisible(arch: HFArchitecture, sizes: ParallelSizes, *, training: bool = True) -> None:
    """Refuse parallel sizes the architecture cannot be split into (or, `training`, trained as),
    naming the spec field (the spec's own check, spec/model_fit.py, for callers that hold an
    architecture). Conversion only loads and saves, where a MoE needs no sequence parallelism."""
    for field, message in split_violations(sizes.tensor, sizes.pipeline, _fit_config(arch), expert=sizes.expert,
                                           expert_tensor=sizes.expert_tensor,
                                           sequence_parallel=sizes.sequence_parallel if training else None):
        raise ValueError(f"spec.{field}: {message}")
    if sizes.sequence_parallel and sizes.tensor == 1:
        raise ValueError("spec.parallelism.sequenceParallel: true needs spec.parallelism.tensor > 1")


def split_megatron_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """spec.model.megatronArgs -> (TransformerConfig fields, megatron OptimizerConfig fields).

    The spec's validation (spec/megatron_args.py) decides which keys are allowed; this refuses the
    same ones (for a spec built without it) and leaves a `false` flag at its default, like the
    omitted flag.
    """
    model_over: dict[str, Any] = {}
    optim_over: dict[str, Any] = {}
    for key, value in (args or {}).items():
        problem = megatron_arg_problem(key, value)
        if problem is not None:
            raise ValueError(f"spec.model.megatronArgs.{key}: {problem}")
        if value is False:
            continue
        target = model_over if megatron_arg_target(key) == "model" else optim_over
        target[megatron_arg_name(key)] = value
    return model_over, optim_over


def build_gpt_model(config, arch: HFArchitecture, *, pre_process: bool, post_process: bool) -> torch.nn.Module:
    """One pipeline stage's GPTModel, weights uninitialised until loaded.

    The local layer spec, with every RMSNorm (input, pre-MLP, q/k and final) replaced by
    `RMSNorm` below: megatron-core's own torch-norm wrapper refuses sequence parallelism
    (its sequence-parallel norms come from apex or TransformerEngine, which rlkube does not install).
    Its core attention is `sdpa_attention_class()`'s: torch's fused attention instead of the
    local spec's score matrix.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    if arch.num_experts:
        _router_gemm_without_transformer_engine()
    layer = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                     qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    layer.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if arch.qk_norm:
        layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
    stage_layers = config.num_layers // config.pipeline_model_parallel_size
    block = ModuleSpec(module=TransformerBlock,
                       submodules=TransformerBlockSubmodules(layer_specs=[layer] * stage_layers, layer_norm=RMSNorm))
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )


def _router_gemm_without_transformer_engine() -> None:
    """megatron-core 0.16's router matmul tests `te_general_gemm is not None` before its torch.mm
    fallback, but binds that name only when TransformerEngine imports: without it every MoE
    forward raised NameError. Bound to None, the fallback (torch.mm in the router dtype) runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm signature. Under sequence parallelism each
    tensor-parallel rank normalises its part of the sequence, so the weight's gradient is
    partial there: it is marked `sequence_parallel` for megatron (and the CPU path) to sum it
    over tensor-parallel ranks."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype,
                         device="cpu" if config.use_cpu_initialization else torch.cuda.current_device())
        if config.sequence_parallel:
            self.weight.sequence_parallel = True


def sdpa_attention_class():
    """megatron-core's local DotProductAttention with its forward on torch's
    `scaled_dot_product_attention` (flash attention on a GPU, GQA without repeating keys).

    The local one materialises the [batch, heads, seq, seq] scores in float32 and runs an unfused
    masked softmax over them: at 640-token rows that is most of a layer's memory traffic. Every
    micro-batch here is right-padded rows under a causal mask (`MegatronBackend._micro_batch`), so
    `is_causal` is the same mask. Configurations that need the local path (attention dropout,
    query-key layer scaling, windows, non-vanilla softmax, an explicit bias) keep it.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            cfg = self.config
            if (attention_bias is not None or packed_seq_params is not None or cfg.apply_query_key_layer_scaling
                    or self.attention_dropout.p > 0 or getattr(cfg, "window_size", None) is not None
                    or getattr(cfg, "softmax_type", "vanilla") != "vanilla"):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale,
                enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
            )
            seq, batch = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)

    return SdpaDotProductAttention

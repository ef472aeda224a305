"""Tiny random HF checkpoints of the families the megatron backend converts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

megatron_core = pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")


def tiny_hf(kind: str, out: Path, *, seed: int = 0, **shape) -> Path:
    """A 2-layer Qwen3 (tied embeddings, q/k norms), Qwen2 (q/k/v biases), Llama (untied) or
    Qwen3-MoE (8 experts, top 2, renormalised), grouped-query attention, random weights, saved with
    a character tokenizer. `shape` overrides config fields (a larger model for the GPU tests)."""
    from rlkube_runtime.tiny.model import build_char_tokenizer
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    classes = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
        "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                      dict(head_dim=32, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True)),
    }
    config_cls, model_cls, extra = classes[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**{**common, **extra, **shape}))
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # not all ones/zeros, so a swap shows
                p.data.uniform_(0.5, 1.5) if "norm" in name else p.data.normal_(0, 0.1)
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return Path(out)

"""A random-init Qwen3-0.6B-shaped checkpoint, built locally (nothing downloaded): the GPU
benchmarks' model. Qwen3-0.6B's architecture (its config.json) with seeded random weights in
bf16, and a word-level tokenizer of exactly the real vocabulary size (151,936 entries: the
specials, then the words w0, w1, ...), so embedding, LM head, logits and weight syncs have the
real sizes. `TINY` is the same code path at CPU size.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
# A random-init Qwen3-MoE of a few hundred million parameters (Qwen3-30B-A3B's layer design at a
# small size: 16 experts, top 2, renormalised, untied head), for the megatron MoE run on one GPU.
QWEN3_MOE_SMALL = dict(
    QWEN3_06B,  # intermediate_size stays, unused when every layer is sparse
    num_hidden_layers=8,
    moe_intermediate_size=768,
    num_experts=16,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
TINY_MOE = dict(QWEN3_MOE_SMALL, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=8192)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=8192,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)  # ids 0, 1, 2; synthetic words w0, w1, ... follow


def build_checkpoint(out: Path, shape: dict, *, seed: int, device: str) -> int:
    """Write model and tokenizer into `out` (reused when already there); returns the parameter count."""
    out = Path(out)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return count_params(shape)
    tokenizer = build_tokenizer(shape["vocab_size"])
    params = _build_model(out, shape, seed=seed, device=device)
    tokenizer.save_pretrained(out)
    _declare_generic_tokenizer_class(out)
    return params


def _classes(shape: dict):
    """(config class, model class): Qwen3-MoE when the shape names experts, dense Qwen3 otherwise."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    return (Qwen3MoeConfig, Qwen3MoeForCausalLM) if "num_experts" in shape else (Qwen3Config, Qwen3ForCausalLM)


def qwen3_config(shape: dict):
    config_cls, _ = _classes(shape)
    return config_cls(
        **{"tie_word_embeddings": True, **shape},
        rope_theta=1e6,
        pad_token_id=SPECIALS.index(PAD),
        eos_token_id=SPECIALS.index(EOS),
        bos_token_id=None,
    )


def count_params(shape: dict) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in _classes(shape)[1](qwen3_config(shape)).parameters())


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer: the specials, then the words w0, w1, ... up to exactly vocab_size entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(vocab_size - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left", model_max_length=4096
    )
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} entries, expected {vocab_size}")
    return tokenizer


def _declare_generic_tokenizer_class(out: Path) -> None:
    """As rlkube_runtime.tiny.model does: name the class every transformers version loads from tokenizer.json."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build_model(out: Path, shape: dict, *, seed: int, device: str) -> int:
    """Seeded random init (on the GPU when there is one: seconds), saved as bf16 safetensors."""
    import torch
    from transformers import GenerationConfig

    config = qwen3_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = _classes(shape)[1](config)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    model.save_pretrained(out)
    del model
    return params

"""A tiny HF-format causal LM with a character-level tokenizer, written to a directory.

Everything is built locally and seeded (nothing downloaded), so a CPU test, the local default
run and a benchmark can all load the same checkpoint with `AutoModelForCausalLM` /
`AutoTokenizer` exactly as they would load a real model.
"""

from __future__ import annotations

import json
import pathlib
import string

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)

# Printable ASCII without the vertical tab and form feed: letters, digits, punctuation, space,
# tab, newline and carriage return.
DEFAULT_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \t\n\r"

# Each message is `<|role|>content<eos>`; a generation prompt ends with `<|assistant|>`, so a
# model that ends its answer with <eos> reproduces the template exactly. Content may be a string
# or OpenAI-style text parts ([{"type": "text", "text": ...}]).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('chat role must be system, user, assistant or tool, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tiny_checkpoint(
    out_dir: str | pathlib.Path,
    *,
    alphabet: str | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    experts: int = 0,
) -> pathlib.Path:
    """Write model weights, config, generation config and tokenizer files into `out_dir`.

    The same arguments always give the same files. `alphabet` (default: printable ASCII) is the
    set of characters with their own token; any other character becomes `<unk>`. `experts` > 0
    makes it a Qwen3-MoE (that many experts per layer, two routed per token) instead of a Llama.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}); "
            f"pick e.g. hidden_size={num_heads * max(1, hidden_size // num_heads)}"
        )
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.save_pretrained(out)
    _declare_generic_tokenizer_class(out)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (PAD, BOS, EOS)}

    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        # Grouped-query attention (when the head count allows) so the tiny model exercises the
        # same attention path as real Llama/Qwen models.
        num_key_value_heads=num_heads // 2 if num_heads % 2 == 0 else num_heads,
        max_position_embeddings=4096,
        # Untied: with tied embeddings a random model mostly repeats its last input token, which
        # makes greedy outputs (and tests on them) degenerate.
        tie_word_embeddings=False,
        pad_token_id=ids[PAD],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
    )
    if experts:
        config_cls, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
        shape.update(head_dim=hidden_size // num_heads, num_experts=experts, num_experts_per_tok=2,
                     moe_intermediate_size=hidden_size, norm_topk_prob=True)
    else:
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    config = config_cls(**shape)
    # Initialise under a private generator state so the caller's RNG stream is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]
    )
    model.save_pretrained(out)
    return out


def build_char_tokenizer(alphabet: str | None = None):
    """A `PreTrainedTokenizerFast` with one token per character plus the special tokens.

    A BPE model with no merges is exactly a character tokenizer that keeps spaces and newlines
    as they are; the `Fuse` decoder joins tokens back without separators.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = _unique_chars(DEFAULT_ALPHABET if alphabet is None else alphabet)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _declare_generic_tokenizer_class(out: pathlib.Path) -> None:
    """Name the generic fast tokenizer class, which transformers 4.x (SGLang images) and 5.x both
    load straight from tokenizer.json, instead of the 5.x-only `TokenizersBackend`."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _unique_chars(alphabet: str) -> list[str]:
    if not alphabet:
        raise ValueError("alphabet is empty; pass at least one character or None for printable ASCII")
    chars = list(dict.fromkeys(alphabet))
    clashes = [c for c in chars if c in SPECIAL_TOKENS]
    if clashes:
        raise ValueError(f"alphabet characters {clashes!r} clash with special tokens")
    return chars

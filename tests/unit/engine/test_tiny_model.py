"""The tiny checkpoint loads like a real HF model and is a pure function of its arguments."""

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkube_runtime.tiny.model import build_tiny_checkpoint


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_writes_identical_files_and_other_seed_different_weights(tmp_path):
    a = build_tiny_checkpoint(tmp_path / "a", seed=3)
    b = build_tiny_checkpoint(tmp_path / "b", seed=3)
    c = build_tiny_checkpoint(tmp_path / "c", seed=4)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert _digests(a)["tokenizer.json"] == _digests(c)["tokenizer.json"]


def test_loads_with_auto_classes_and_is_tiny(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id == model.generation_config.pad_token_id
    logits = model(torch.tensor([tokenizer("hi")["input_ids"]])).logits
    assert logits.shape == (1, 2, len(tokenizer))


def test_tokenizer_round_trips_text_with_spaces_and_newlines(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Hello, world!\n  x = 1 + 2\t# ok"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text


def test_unknown_characters_become_unk_not_dropped(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path, alphabet="0123456789+="))
    assert tokenizer("1+é=2")["input_ids"] == tokenizer.convert_tokens_to_ids(["1", "+", "<unk>", "=", "2"])


def test_chat_template_renders_openai_messages_with_generation_prompt(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|system|>be brief<eos><|user|>2+2?<eos><|assistant|>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "be brief2+2?"


def test_chat_template_accepts_openai_content_parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+1"}, {"type": "text", "text": "=?"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<bos><|user|>1+1=?<eos>"


def test_rejects_head_count_that_does_not_divide_hidden_size(tmp_path):
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_checkpoint(tmp_path, hidden_size=64, num_heads=5)

"""`--enable-lora`: the built-in engine loads a peft adapter with SGLang's /load_lora_adapter, merges
it into its weights and then generates what peft's own model (independent code) computes; an
unload gives the base model back; requests name the adapter they want, and anything else is refused."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

PROMPT = [5, 9, 14, 3]


def _adapter(model_dir, out_dir, *, targets=("q_proj", "v_proj", "down_proj", "lm_head"), seed=0):
    """A peft adapter with random (non-zero) B, saved as the trainer saves it; returns the peft model."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(str(out_dir), save_embedding_layers=False)
    return model.eval()


def _greedy_logprobs(model, tokens, steps):
    """Greedy continuation of `tokens` and each chosen token's log-prob, by full forwards."""
    tokens, out = list(tokens), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            out.append((token, float(logp[token])))
            tokens.append(token)
    return out


async def _generate(client, **fields):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, **fields}
    reply = await client.post("/generate", json=body)
    return reply.status, await reply.json()


def _pairs(out):
    return [(int(t), lp) for lp, t, *_ in out["meta_info"]["output_token_logprobs"]]


async def test_a_loaded_adapter_serves_what_peft_computes_and_unloading_restores_the_base(start_engine, tiny_model_dir, tmp_path):
    client = await start_engine(enable_lora=True, max_lora_rank=8)
    status, before = await _generate(client)
    assert status == 200
    peft_model = _adapter(tiny_model_dir, tmp_path / "adapter")

    reply = await client.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(tmp_path / "adapter")})
    assert reply.status == 200, await reply.text()
    status, adapted = await _generate(client, lora_path="policy")
    assert status == 200
    want = _greedy_logprobs(peft_model, PROMPT, 6)
    got = _pairs(adapted)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4
    with peft_model.disable_adapter():
        base = _greedy_logprobs(peft_model, PROMPT, 6)
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, base)) > 1e-2  # the adapter does change the model

    assert (await client.post("/update_weight_version", json={"new_version": "7"})).status == 200
    assert (await (await client.get("/get_weight_version")).json())["weight_version"] == "7"

    assert (await client.post("/unload_lora_adapter", json={"lora_name": "policy"})).status == 200
    status, after = await _generate(client)
    assert status == 200 and after["output_ids"] == before["output_ids"]
    assert [lp for lp, *_ in after["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, *_ in before["meta_info"]["output_token_logprobs"]], abs=1e-6)


async def test_requests_and_adapters_the_engine_cannot_serve_are_refused_by_name(start_engine, tiny_model_dir, tmp_path):
    _adapter(tiny_model_dir, tmp_path / "adapter")
    plain = await start_engine()
    reply = await plain.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(tmp_path / "adapter")})
    assert reply.status == 400 and "--enable-lora" in await reply.text()
    status, body = await _generate(plain, lora_path="policy")
    assert status == 400 and "lora_path" in str(body)

    client = await start_engine(enable_lora=True, max_lora_rank=2)
    reply = await client.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(tmp_path / "adapter")})
    assert reply.status == 400 and "--max-lora-rank 2" in await reply.text()
    reply = await client.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(tmp_path / "missing")})
    assert reply.status == 400 and "adapter_config.json" in await reply.text()

    narrow = await start_engine(enable_lora=True, lora_target_modules=("q_proj", "v_proj", "down_proj", "lm_head"))
    assert (await narrow.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(tmp_path / "adapter")})).status == 200
    for fields in ({}, {"lora_path": "other"}):  # the base, or another adapter: the weights serve this one only
        status, body = await _generate(narrow, **fields)
        assert status == 400 and "policy" in str(body)
    reply = await narrow.post("/load_lora_adapter", json={"lora_name": "second", "lora_path": str(tmp_path / "adapter")})
    assert reply.status == 400 and "/unload_lora_adapter" in await reply.text()
    reply = await narrow.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir)})
    assert reply.status == 400 and "merged" in await reply.text()
    assert (await narrow.post("/unload_lora_adapter", json={"lora_name": "other"})).status == 400
    assert (await narrow.get("/health_generate")).status == 200

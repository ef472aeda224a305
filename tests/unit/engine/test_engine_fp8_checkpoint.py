"""The built-in engine started from the block-fp8 checkpoint an fp8 rollout writes (as SGLang is):
fp8 because its config.json says so, serving exactly what quantizing the bf16 checkpoint at start
serves, and what a full forward of the dequantized weights computes."""

import torch
from transformers import AutoModelForCausalLM

from rlkube_runtime import fp8
from rlkube_runtime.fp8_checkpoint import write_fp8_checkpoint

PROMPT = [5, 9, 14, 3]


async def _greedy(client):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    reply = await client.post("/generate", json=body)
    assert reply.status == 200, await reply.text()
    out = await reply.json()
    return [(int(t), lp) for lp, t, *_ in out["meta_info"]["output_token_logprobs"]]


def _reference(model_dir, steps=6):
    """Greedy tokens and log-probs of the bf16 model's weights quantize-dequantized, by full forwards."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if fp8.is_quantized_name(name, tensor.shape):
                tensor.copy_(fp8.quantize_dequantize(tensor))
        tokens, out = list(PROMPT), []
        for _ in range(steps):
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], -1)
            token = int(logp.argmax())
            out.append((token, float(logp[token])))
            tokens.append(token)
    return out


async def test_an_fp8_checkpoint_is_served_as_fp8_and_generates_what_its_dequantized_weights_compute(
        start_engine, tiny_model_dir, tmp_path):
    fp8_dir = write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8")
    from_checkpoint = await start_engine(model_path=str(fp8_dir))
    info = await (await from_checkpoint.get("/get_server_info")).json()
    assert info["quantization"] == "fp8"
    quantized_at_start = await start_engine(quantization="fp8")
    plain = await start_engine()

    got = await _greedy(from_checkpoint)
    assert got == await _greedy(quantized_at_start)
    want = _reference(tiny_model_dir)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4
    # and not what the unquantized weights give (the check could otherwise pass on bf16)
    assert [lp for _, lp in got] != [lp for _, lp in await _greedy(plain)]

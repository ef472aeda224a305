"""FP8 rollout: how far the block-fp8 weights move the policy's per-token logprobs, and what they save.

At the Qwen3-0.6B shape with seeded random weights in bf16, a fixed batch of sequences is sampled
from the bf16 model; then every response token's logprob is computed twice, with the bf16 weights
and with the same weights quantize-dequantized through rlkube's blockwise e4m3 quantizer
(`rlkube_runtime/fp8.py`: the decoder layers' linear weights in 128x128 blocks, float32
scales; embeddings, norms and the tied head unchanged) - what the built-in engine serves under
`model.rolloutDtype: fp8`. Reported: the mean / p99 / max absolute per-token logprob gap, the
bytes per weight sync in bf16 and in fp8 (e4m3 + scales for the quantized weights, bf16 for the
rest), and the GPU time of quantizing every quantized weight (median of the repeats after a
warm-up). The gap is the weights' quantization error alone: SGLang's fp8 GEMMs also quantize the
activations per token group, which this does not model. A random-init model's logits are flatter
than a trained one's, so its gap is not a trained model's gap.

    python benchmarks/fp8_rollout_gap.py --out benchmarks/results/fp8_rollout_gap_h100.md
CPU check of the same code path at the tiny shape:
    python benchmarks/fp8_rollout_gap.py --tiny-shape --device cpu
Needs torch and transformers only (no ray, no pydantic).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent / "runtime"))

from _harness import call_times, command_line, loadavg, write_results  # noqa: E402
from qwen3_shape import QWEN3_06B, TINY, qwen3_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("fp8_rollout_gap: --device cuda but no CUDA device is visible; for a CPU check run "
              "--tiny-shape --device cpu", file=sys.stderr)
        return 2
    figures = measure(args)
    command = command_line(__file__, argv)
    print(json.dumps(figures), flush=True)
    write_results(_render(figures, command), figures, command, out=args.out, json_path=args.json)
    return 0


def _parse_args(argv):
    parser = sampled_batch_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed quantizations (default 5, after one warm-up)")
    return parser.parse_args(argv)


def sampled_batch_parser(description: str) -> argparse.ArgumentParser:
    """The options of a benchmark that scores a batch sampled from a seeded Qwen3-shaped model
    (`_sample`, `_response_logprobs`): this one and fp8_checkpoint_load.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny-shape", action="store_true", help="the tiny Qwen3 shape (a quick CPU check)")
    parser.add_argument("--batch", type=int, default=16, help="sequences in the batch (default 16)")
    parser.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per sequence (default 64)")
    parser.add_argument("--response-len", type=int, default=256, help="sampled tokens per sequence (default 256)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="Markdown report")
    parser.add_argument("--json", help="figures as JSON")
    return parser


def measure(args) -> dict:
    import torch

    from rlkube_runtime import fp8

    model, shape, device = seeded_bf16_model(args)

    named = _unique_named_tensors(model)
    quantized = [n for n, t in named if fp8.is_quantized_name(n, t.shape)]
    tensors = dict(named)
    bf16_bytes = sum(t.numel() * 2 for _, t in named)
    quantized_bf16_bytes = sum(tensors[n].numel() * 2 for n in quantized)
    quantized_fp8_bytes = sum(fp8.quantized_nbytes(tensors[n].shape) for n in quantized)
    fp8_bytes = bf16_bytes - quantized_bf16_bytes + quantized_fp8_bytes

    sequences = _sample(model, args, shape["vocab_size"], device)
    bf16_logprobs = _response_logprobs(model, sequences, args.prompt_len)

    def quantize_all():
        return [fp8.quantize_blockwise(tensors[n]) for n in quantized]

    quantize_all()  # warm-up (allocator, kernels)
    times, _ = call_times(quantize_all, args.repeat, device=device.type)

    relative_errors = []
    with torch.no_grad():
        for name in quantized:
            weight = tensors[name]
            served = fp8.quantize_dequantize(weight)
            relative_errors.append(float((served.float() - weight.float()).norm() / weight.float().norm()))
            weight.copy_(served)
    fp8_logprobs = _response_logprobs(model, sequences, args.prompt_len)

    gap = (fp8_logprobs - bf16_logprobs).abs().flatten()
    ratio = (fp8_logprobs - bf16_logprobs).exp().flatten()  # engine/trainer importance ratio, as TIS sees it
    return {
        "shape": "tiny" if args.tiny_shape else "qwen3-0.6b",
        "device": args.device,
        "machine": _machine(args.device),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "temperature": args.temperature,
        "tokens": int(gap.numel()),
        "quantized_tensors": len(quantized),
        "tensors": len(named),
        "logprob_gap_mean": float(gap.mean()),
        "logprob_gap_p99": float(gap.quantile(0.99)) if gap.numel() <= 16_000_000 else None,
        "logprob_gap_max": float(gap.max()),
        "bf16_logprob_mean": float(bf16_logprobs.mean()),
        "ratio_outside_0.5_2": float(((ratio < 0.5) | (ratio > 2.0)).float().mean()),
        "weight_relative_error_mean": sum(relative_errors) / len(relative_errors),
        "bytes_per_sync_bf16": bf16_bytes,
        "bytes_per_sync_fp8": fp8_bytes,
        "quantized_part_bytes_bf16": quantized_bf16_bytes,
        "quantized_part_bytes_fp8": quantized_fp8_bytes,
        "quantize_seconds": times,
        "quantize_seconds_median": sorted(times)[len(times) // 2],
    }


def seeded_bf16_model(args):
    """(model, shape, device): the Qwen3-shaped model both fp8 benchmarks score, seeded random
    weights in bf16 on `args.device`, at the tiny shape with --tiny-shape."""
    import torch
    from transformers import Qwen3ForCausalLM

    shape = TINY if args.tiny_shape else QWEN3_06B
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    with device:
        model = Qwen3ForCausalLM(qwen3_config(shape))
    return model.to(torch.bfloat16).eval(), shape, device


def _unique_named_tensors(model) -> list:
    """Parameters and buffers, a tied tensor once (as the weight sync sends them)."""
    seen, out = set(), []
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out.append((name, tensor.data))
    return out


def _sample(model, args, vocab_size: int, device):
    """The fixed batch: random prompts, then response tokens sampled from the bf16 model."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    prompts = torch.randint(3, vocab_size, (args.batch, args.prompt_len), generator=generator).to(device)
    torch.manual_seed(args.seed + 2)
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=args.temperature, top_k=0,
            top_p=1.0, max_new_tokens=args.response_len, min_new_tokens=args.response_len, eos_token_id=None,
            pad_token_id=0,
        )
    return out


def _response_logprobs(model, sequences, prompt_len: int, rows_per_pass: int = 4):
    """[batch, response_len] float32 logprobs of the response tokens, a few rows per forward pass
    (the logits of 152k-token vocabularies are large)."""
    import torch

    parts = []
    with torch.no_grad():
        for start in range(0, sequences.shape[0], rows_per_pass):
            rows = sequences[start : start + rows_per_pass]
            logits = model(rows).logits[:, prompt_len - 1 : -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            parts.append(logprobs.gather(-1, rows[:, prompt_len:, None]).squeeze(-1))
            del logits, logprobs
    return torch.cat(parts)


def _machine(device: str) -> dict:
    import torch

    info = {"loadavg": loadavg(), "torch": torch.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _render(f: dict, command: str) -> str:
    p99 = "n/a" if f["logprob_gap_p99"] is None else f"{f['logprob_gap_p99']:.4f}"
    return "\n".join([
        "# FP8 rollout: per-token logprob gap of block-fp8 weights vs bf16",
        "",
        f"Command: `{command}`",
        "",
        f"Shape {f['shape']} (seeded random init, bf16), device {f['device']}, machine {json.dumps(f['machine'])}.",
        f"{f['batch']} sequences of {f['prompt_len']} random prompt tokens + {f['response_len']} tokens sampled from the "
        f"bf16 model (temperature {f['temperature']}); {f['tokens']} response tokens scored with the bf16 "
        f"weights and with the {f['quantized_tensors']} decoder-layer linear weights (of {f['tensors']} tensors) "
        "quantize-dequantized in 128x128 e4m3 blocks. Weights' quantization error only (no fp8 activations).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| mean abs logprob gap | {f['logprob_gap_mean']:.4f} |",
        f"| p99 abs logprob gap | {p99} |",
        f"| max abs logprob gap | {f['logprob_gap_max']:.4f} |",
        f"| mean bf16 logprob of the sampled tokens | {f['bf16_logprob_mean']:.3f} |",
        f"| tokens with importance ratio outside [0.5, 2] | {f['ratio_outside_0.5_2']:.4%} |",
        f"| mean relative weight error (Frobenius) | {f['weight_relative_error_mean']:.4f} |",
        f"| bytes per sync, bf16 | {f['bytes_per_sync_bf16'] / 1e6:.1f} MB |",
        f"| bytes per sync, fp8 | {f['bytes_per_sync_fp8'] / 1e6:.1f} MB ({f['bytes_per_sync_fp8'] / f['bytes_per_sync_bf16']:.3f} of bf16) |",
        f"| quantized weights, bf16 -> fp8 | {f['quantized_part_bytes_bf16'] / 1e6:.1f} MB -> "
        f"{f['quantized_part_bytes_fp8'] / 1e6:.1f} MB ({f['quantized_part_bytes_fp8'] / f['quantized_part_bytes_bf16']:.3f}) |",
        f"| quantize time, all quantized weights (median of {len(f['quantize_seconds'])}) | "
        f"{f['quantize_seconds_median'] * 1e3:.2f} ms |",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())

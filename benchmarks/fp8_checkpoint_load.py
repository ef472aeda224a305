"""FP8 rollout's starting checkpoint at real size: what writing it costs, and whether a third-party
block-fp8 loader serves it as rlkube means it.

At the Qwen3-0.6B shape (seeded random weights, bf16, saved as safetensors), the block-fp8 copy the
engines start from is written by `rlkube_runtime.fp8_checkpoint.write_fp8_checkpoint` (timed, sizes
on disk). A batch is sampled from the bf16 model, and its response tokens' logprobs are computed
three ways: with the bf16 weights; with the copy read back dequantized (what the built-in engine
serves); and with the copy loaded by transformers' own fine-grained fp8 loader, whose layers keep
e4m3 weights with `weight_scale_inv` and run block-fp8 GEMMs that also quantize the activations
per 128-wide group (the scheme SGLang's fp8 linear method runs). That loader reading the copy is an
independent check of its layout (names, scale shapes, quantization_config); its gap to bf16 is what
fp8 GEMMs add to the weights' own quantization error.

    python benchmarks/fp8_checkpoint_load.py --out benchmarks/results/fp8_checkpoint_load_h100.md \
        --json benchmarks/results/fp8_checkpoint_load_h100.json
Needs a GPU, torch, transformers and safetensors (no ray, no pydantic).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent / "runtime"))

from _harness import command_line, write_results  # noqa: E402
from fp8_rollout_gap import _machine, _response_logprobs, _sample, sampled_batch_parser, seeded_bf16_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = sampled_batch_parser(__doc__.splitlines()[0]).parse_args(argv)
    figures = measure(args)
    command = command_line(__file__, argv)
    write_results(render(figures, command), figures, command, out=args.out, json_path=args.json)
    return 0


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkube_runtime.fp8_checkpoint import read_dequantized, write_fp8_checkpoint

    model, shape, device = seeded_bf16_model(args)
    figures: dict = {"shape": "tiny" if args.tiny_shape else "qwen3-0.6b", "machine": _machine(args.device),
                     "batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len}
    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp) / "bf16", Path(tmp) / "fp8"
        model.save_pretrained(source)
        started = time.perf_counter()
        write_fp8_checkpoint(source, target)
        figures["write_seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        write_fp8_checkpoint(source, target)
        figures["rewrite_check_seconds"] = time.perf_counter() - started  # kept: made from the same files
        figures["bytes_bf16_dir"] = sum(p.stat().st_size for p in source.iterdir())
        figures["bytes_fp8_dir"] = sum(p.stat().st_size for p in target.iterdir())

        sequences = _sample(model, args, shape["vocab_size"], device)
        bf16 = _response_logprobs(model, sequences, args.prompt_len)

        dequantized = read_dequantized(target)
        served = {k: v.to(torch.bfloat16) for k, v in dequantized.items()}
        missing, unexpected = model.load_state_dict(served, strict=False)
        figures["dequantized_load"] = {"missing": sorted(missing), "unexpected": sorted(unexpected)}
        builtin = _response_logprobs(model, sequences, args.prompt_len)
        del model, served, dequantized
        if device.type == "cuda":
            torch.cuda.empty_cache()

        try:
            third_party = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16, device_map=args.device).eval()
            layer = third_party.model.layers[0].self_attn.q_proj
            figures["transformers_layer"] = type(layer).__name__
            figures["transformers_weight_dtype"] = str(layer.weight.dtype)
            scale = getattr(layer, "weight_scale_inv", None)
            figures["transformers_scale_shape"] = list(scale.shape) if scale is not None else None
            gemm = _response_logprobs(third_party, sequences, args.prompt_len)
            figures["fp8_gemm"] = _gaps(gemm, bf16) | {"vs_dequantized_mean": float((gemm - builtin).abs().mean())}
        except Exception as err:  # noqa: BLE001 - reported, not hidden
            figures["transformers_error"] = f"{type(err).__name__}: {err}"[:2000]
    figures["tokens"] = int(bf16.numel())
    figures["dequantized"] = _gaps(builtin, bf16)
    return figures


def _gaps(logprobs, reference) -> dict:
    gap = (logprobs - reference).abs().flatten()
    ratio = (logprobs - reference).exp().flatten()
    return {"mean": float(gap.mean()), "p99": float(gap.quantile(0.99)), "max": float(gap.max()),
            "ratio_outside_0.5_2": float(((ratio < 0.5) | (ratio > 2.0)).float().mean())}


def render(f: dict, command: str) -> str:
    lines = [
        "# FP8 rollout: the engines' block-fp8 starting checkpoint at real size",
        "",
        f"Command: `{command}`",
        "",
        f"Shape {f['shape']} (seeded random init, bf16), machine {f['machine']}. {f['batch']} sequences of "
        f"{f['prompt_len']} random prompt tokens + {f['response_len']} tokens sampled from the bf16 model; "
        f"{f['tokens']} response tokens scored three ways.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| write the fp8 copy (bf16 safetensors in, e4m3 + scales out) | {f['write_seconds']:.2f} s |",
        f"| second call (copy kept: made from the same files) | {f['rewrite_check_seconds'] * 1000:.1f} ms |",
        f"| directory size, bf16 -> fp8 | {f['bytes_bf16_dir'] / 1e6:.1f} MB -> {f['bytes_fp8_dir'] / 1e6:.1f} MB |",
        f"| dequantized copy (built-in engine) vs bf16, mean / p99 / max abs logprob gap | "
        f"{f['dequantized']['mean']:.4f} / {f['dequantized']['p99']:.4f} / {f['dequantized']['max']:.4f} |",
        f"| dequantized copy loads into the model (missing / unexpected names) | "
        f"{f['dequantized_load']['missing'] or 'none'} / {f['dequantized_load']['unexpected'] or 'none'} |",
    ]
    if "fp8_gemm" in f:
        g = f["fp8_gemm"]
        lines += [
            f"| transformers' fp8 loader: layer, weight dtype, q_proj scale shape | {f['transformers_layer']}, "
            f"{f['transformers_weight_dtype']}, {f['transformers_scale_shape']} |",
            f"| fp8 GEMMs (transformers) vs bf16, mean / p99 / max abs logprob gap | "
            f"{g['mean']:.4f} / {g['p99']:.4f} / {g['max']:.4f} |",
            f"| fp8 GEMMs vs the dequantized copy, mean abs logprob gap | {g['vs_dequantized_mean']:.4f} |",
            f"| tokens with importance ratio outside [0.5, 2], fp8 GEMMs vs bf16 | {g['ratio_outside_0.5_2']:.4%} |",
        ]
    else:
        lines += [f"| transformers' fp8 loader | failed: {f['transformers_error']} |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

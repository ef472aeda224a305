"""The loop's parts one at a time on a GPU, on the random-init Qwen3-0.6B shape, against the
machine's own measured ceilings:

  ceilings  bf16 matmul (8192^3, random data) and device-to-device copy bandwidth
  engine    the built-in engine's generation (in process, through its /generate handler):
            tokens/s at 64 and 256 requests in flight (128-token prompts, 512 new tokens, EOS
            ignored), the generic transformers runner beside it, and the logprobs it reports
            against a full-sequence forward (mean and max |difference|)
  trainer   the torch backend on a GRPO-shaped batch (64 samples x (128 + 512) tokens): forward,
            forward+backward with model FLOPs per second as a share of the matmul ceiling, the
            optimizer step, and the colocated offload/onload
  sync      weight sync of the trainer's fp32 weights (sent as bf16) into an engine server:
            CUDA IPC handles on the same GPU, NCCL to an engine on a second GPU (when there is
            one), bytes over HTTP; seconds, bytes and GB/s

Usage (GPU machine, from the repository root, with the runtime importable):
    python benchmarks/gpu_components.py --out benchmarks/results/gpu_components_h200.md
CPU plumbing check (tiny shape, minutes): python benchmarks/gpu_components.py --tiny-shape --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Stopwatch, command_line, median_time, time_train_passes, write_results  # noqa: E402
from qwen3_shape import QWEN3_06B, TINY, build_checkpoint  # noqa: E402

PARTS = ("ceilings", "engine", "trainer", "sync")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny_shape else QWEN3_06B
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlkube-components-"))
    model_dir = workdir / ("tiny" if args.tiny_shape else "qwen3-0.6b-shape")
    params = build_checkpoint(model_dir, shape, seed=args.seed, device=device)
    print(f"checkpoint {model_dir}: {params:,} parameters", flush=True)
    results: dict[str, dict] = {"meta": _machine(device, params, shape)}
    for part in args.only:
        print(f"--- {part} ---", flush=True)
        with Stopwatch() as watch:
            try:
                results[part] = PART_FUNCS[part](args, device, model_dir, results)
            except Exception:  # one part failing must not lose the others' figures
                results[part] = {"error": traceback.format_exc()[-3000:]}
                print(results[part]["error"], flush=True)
        results[part]["seconds"] = watch.seconds
        print(json.dumps(results[part], indent=1, default=str)[:3000], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    command = command_line(__file__, argv or None)
    report = _render(results, command)
    print(report, flush=True)
    write_results(report, results, command, out=args.out, json_path=args.json)
    return 0 if all("error" not in v for k, v in results.items() if k != "meta") else 1


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--tiny-shape", action="store_true", help="a tiny model with the same code paths (CPU checks)")
    p.add_argument("--only", type=lambda t: [x for x in t.split(",") if x], default=list(PARTS),
                   help=f"comma-separated parts of {PARTS}")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--in-flight", type=lambda t: [int(x) for x in t.split(",")], default=[64, 256])
    p.add_argument("--train-samples", type=int, default=64)
    p.add_argument("--engine-compile", action="store_true", help="engine: also the slot runner with --enable-torch-compile")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="Markdown report")
    p.add_argument("--json", default=None, help="every figure as JSON")
    args = p.parse_args(argv)
    unknown = set(args.only) - set(PARTS)
    if unknown:
        p.error(f"--only: unknown parts {sorted(unknown)}; choose from {PARTS}")
    return args


# ---- ceilings ---------------------------------------------------------------------------------


def ceilings(args, device, model_dir, results) -> dict:
    if device != "cuda":
        return {"note": "no GPU: no ceilings"}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_s = _cuda_time(lambda: a @ b, repeat=10)
    del a, b
    src = torch.randn(2**30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    copy_s = _cuda_time(lambda: dst.copy_(src), repeat=10)
    moved = 2 * src.numel() * 4
    del src, dst
    return {"matmul_tflops": 2 * n**3 / matmul_s / 1e12, "copy_tb_s": moved / copy_s / 1e12}


# ---- engine -----------------------------------------------------------------------------------


def engine(args, device, model_dir, results) -> dict:
    from rlkube_runtime.engine.engine import Engine, EngineConfig

    dtype = "bfloat16" if device == "cuda" else "float32"
    out: dict = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    variants = ["slot", *(["slot_compiled"] if args.engine_compile else []), "hf"]
    for variant in variants:
        runner = "hf" if variant == "hf" else "slot"
        cap = max(args.in_flight)
        eng = Engine.load(EngineConfig(model_path=str(model_dir), device=device, dtype=dtype, max_running_requests=cap,
                                       runner=runner, mem_fraction_static=0.6, torch_compile=variant == "slot_compiled"))
        eng.start()
        try:
            vocab = eng.vocab_size
            if runner == "hf":
                # The generic runner is the slow baseline: fewer tokens keep it to seconds.
                n, new = min(args.in_flight), max(16, args.new_tokens // 4)
                secs, tokens, _ = asyncio.run(_generate(eng, n, args.prompt_len, new, vocab, seed=1))
                out["hf"] = {"in_flight": n, "new_tokens": new, "seconds": secs, "tokens_per_s": tokens / secs}
                continue
            asyncio.run(_generate(eng, 8, args.prompt_len, 32, vocab, seed=0))  # warm-up: load kernels, first graphs
            for n in args.in_flight:
                asyncio.run(_generate(eng, n, args.prompt_len, args.new_tokens, vocab, seed=2))  # captures this shape's graphs
                secs, tokens, responses = asyncio.run(_generate(eng, n, args.prompt_len, args.new_tokens, vocab, seed=3))
                out[f"{variant}_{n}"] = {"in_flight": n, "seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs,
                                    "kv_cache_gib": eng.runner.kv_bytes() / 2**30, "graph_captures": eng.runner.graph_captures}
                if n == min(args.in_flight):
                    out["logprob_parity" + ("_compiled" if variant == "slot_compiled" else "")] = _parity(
                        eng.model, responses[:16], device
                    )
        finally:
            eng.stop()
            del eng
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


async def _generate(eng, n: int, prompt_len: int, new_tokens: int, vocab: int, *, seed: int):
    """n concurrent requests of random prompts through the engine's /generate handler."""
    g = torch.Generator().manual_seed(seed)
    bodies = [
        {"input_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), "rid": f"b{seed}-{i}",
         "return_logprob": True, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}}
        for i in range(n)
    ]
    with Stopwatch() as watch:
        responses = await asyncio.gather(*(eng.generate(b) for b in bodies))
    seconds = watch.seconds
    tokens = sum(len(r["output_ids"]) for r in responses)
    return seconds, tokens, list(zip(bodies, responses))


def _parity(model, pairs, device) -> dict:
    """|engine logprob - full forward logprob| over every generated token of these requests."""
    diffs = []
    # The reference is the eager forward, also when the engine compiled the model's modules.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for body, response in pairs:
            prompt, output = body["input_ids"], response["output_ids"]
            ids = torch.tensor([prompt + output], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(output, device=device)[:, None]).squeeze(1)
            got = torch.tensor([lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]], device=device)
            diffs.append((expected - got).abs())
    d = torch.cat(diffs)
    return {"tokens": d.numel(), "mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item(),
            "p99_abs_diff": d.quantile(0.99).item()}


# ---- trainer ----------------------------------------------------------------------------------


def trainer(args, device, model_dir, results) -> dict:
    from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
    from rlkube_runtime.trainer.torch_backend import TorchBackend

    config = TrainerConfig(
        model=ModelConfig(hf_checkpoint=str(model_dir), dtype="bfloat16"),
        optimizer=OptimizerConfig(lr=1e-6),
        batching=BatchingConfig(),
        loss=LossConfig(),
    )
    backend = TorchBackend(config, device=device)
    n, p, r = args.train_samples, args.prompt_len, args.new_tokens
    batch = grpo_batch(backend.model.config.vocab_size, n, p, r)
    out, _ = time_train_passes(backend, batch, _train_flops(backend.model.config, n, p + r, r), device)
    timed = partial(median_time, device=device)
    ceiling = results.get("ceilings", {}).get("matmul_tflops")
    if ceiling:
        out["share_of_matmul_ceiling"] = out["tflops"] / ceiling
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        for label, keep in (("offload", False), ("offload_keep_weights", True)):
            release_s, _ = timed(lambda keep=keep: backend.release(keep_weights=keep), repeat=1)
            resume_s, _ = timed(backend.restore, repeat=1)
            release_s, _ = timed(lambda keep=keep: backend.release(keep_weights=keep), repeat=1)  # pinned twins exist now
            resume_s, _ = timed(backend.restore, repeat=1)
            out[f"{label}_s"], out[f"onload_after_{label}_s"] = release_s, resume_s
    del backend
    return out


def grpo_batch(vocab: int, samples: int, prompt_len: int, response_len: int):
    """The trainer benchmarks' batch: random tokens, every response token in the loss, one seeded
    random advantage per sample (a GRPO-shaped batch without the rollout)."""
    from rlkube_runtime.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    return TrainBatch.from_lists(
        tokens=[torch.randint(3, vocab, (prompt_len + response_len,), generator=g).tolist() for _ in range(samples)],
        response_lengths=[response_len] * samples,
        loss_masks=[[1] * response_len for _ in range(samples)],
        advantages=[[float(torch.randn(1, generator=g))] * response_len for _ in range(samples)],
    )


def _train_flops(config, samples: int, length: int, response: int) -> float:
    """Model FLOPs of one forward+backward (3x the forward): every matmul of the layers on every
    token, the LM head on response positions only (the backend computes no other logits), and
    causal attention (scores and values: 2 x L^2/2 x heads x head_dim x 2 per layer)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, getattr(config, "head_dim", h // config.num_attention_heads)
    per_token_layer = 2 * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * config.intermediate_size)
    forward = samples * length * layers * per_token_layer
    forward += samples * response * 2 * h * config.vocab_size
    forward += samples * layers * 2 * length * length * heads * d
    return 3 * forward


# ---- weight sync ------------------------------------------------------------------------------


def sync(args, device, model_dir, results) -> dict:
    from transformers import AutoModelForCausalLM

    from rlkube_runtime.serving.launch import start_engine
    from rlkube_runtime.weight_sync import WeightSender

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)  # fp32 master weights
    sender = WeightSender(model, dtype=dtype, bucket_bytes=128 << 20, device=torch.device(device))
    out: dict = {}
    log_dir = tempfile.mkdtemp(prefix="rlkube-sync-logs-")
    cases = [("tensor", [0]), ("http", [0])]
    if device == "cuda" and torch.cuda.device_count() > 1:
        cases.insert(1, ("distributed", [1]))
    if device != "cuda":
        cases.append(("distributed", []))
    for transport, gpus in cases:
        eng = start_engine(model_path=str(model_dir), log_dir=log_dir, name=f"sync-{transport}", device=device,
                           gpu_ids=gpus, engine_args={"dtype": "bfloat16" if device == "cuda" else "float32"})
        try:
            times = []
            for attempt in range(4):
                report = sender.push([eng.url], transport=transport, version=f"v{attempt}")
                if report.failed:
                    raise RuntimeError(f"{transport}: {report.failed}")
                times.append(report.seconds)
            seconds = statistics.median(times[1:])  # the first pays for groups, buffers and handles
            out[transport] = {"bytes": report.bytes_per_engine, "requests": report.requests_per_engine,
                              "first_s": times[0], "median_s": seconds, "gb_s": report.bytes_per_engine / seconds / 1e9}
        finally:
            eng.stop()
    sender.close()
    return out


PART_FUNCS = {"ceilings": ceilings, "engine": engine, "trainer": trainer, "sync": sync}


# ---- helpers ----------------------------------------------------------------------------------


def _cuda_time(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _machine(device: str, params: int, shape: dict) -> dict:
    import transformers

    info = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "params": params, "shape": shape, "cpus": os.cpu_count()}
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _render(results: dict, command: str) -> str:
    meta = results["meta"]
    lines = [f"# GPU components ({meta.get('gpus', [meta['device']])[0] if meta.get('gpus') else meta['device']})", "",
             f"Command: `{command}`", "",
             f"- Model: random-init Qwen3-0.6B shape, {meta['params']:,} parameters; torch {meta['torch']}, "
             f"transformers {meta['transformers']}, {meta['cpus']} CPUs, GPUs: {meta.get('gpus', 'none')}", ""]
    for part in PARTS:
        if part not in results:
            continue
        lines += [f"## {part}", "", "```json", json.dumps(results[part], indent=1, default=_num), "```", ""]
    return "\n".join(lines)


def _num(value):
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


if __name__ == "__main__":
    sys.exit(main())

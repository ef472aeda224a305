"""Built-in engine throughput (generated tokens/s) against plain `model.generate` on the same model.

The engine runs as its own process behind HTTP, exactly as rollouts use it, and is driven by the
rollout client at a fixed number of requests in flight. The baselines call transformers'
`generate` in this process: one sequence at a time, and whole batches at once (left padding).
Every sequence generates exactly `--max-new-tokens` tokens (EOS ignored), so all rows do the
same work. Not a test: run it by hand and keep the table it writes.

    python benchmarks/engine_throughput.py --device cpu --out benchmarks/results/engine_throughput_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Stopwatch, command_line, median_time, write_results  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--sequential-requests", type=int, default=8, help="sequences for the batch-1 baseline")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for the engine and baselines")
    parser.add_argument("--out", default=None, help="write a markdown report here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    workdir = tempfile.mkdtemp(prefix="engine-bench-")
    model_dir = build_tiny_checkpoint(
        os.path.join(workdir, "model"), hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads, seed=0
    )
    prompts = [_prompt(i, args.prompt_len) for i in range(max(max(args.concurrency) * 2, args.sequential_requests))]

    rows: list[tuple[str, int, int, float]] = []  # (what, in flight, sequences, tokens/s)
    for concurrency in args.concurrency:
        n = max(2 * concurrency, 16)
        rows.append((f"built-in engine, {concurrency} in flight", concurrency, n,
                     _engine_tokens_per_s(model_dir, workdir, args, dtype, concurrency, prompts[:n])))
        print(rows[-1], flush=True)
    baselines = _Baseline(model_dir, args.device, dtype)
    rows.append(("model.generate, batch 1, sequential", 1, args.sequential_requests,
                 baselines.tokens_per_s(prompts[: args.sequential_requests], 1, args.max_new_tokens)))
    print(rows[-1], flush=True)
    for batch in args.concurrency:
        if batch > 1:
            rows.append((f"model.generate, batch {batch}", batch, batch, baselines.tokens_per_s(prompts[:batch], batch, args.max_new_tokens)))
            print(rows[-1], flush=True)

    command = command_line(__file__)
    report = _report(args, dtype, model_dir, rows, baselines.num_params, command)
    print(report)
    write_results(report, {}, command, out=args.out, json_path=None)


def _engine_tokens_per_s(model_dir, workdir, args, dtype, concurrency, prompts) -> float:
    from rlkube_runtime.serving.client import RolloutClient
    from rlkube_runtime.serving.launch import start_engine

    engine_args = {"dtype": dtype, "max-running-requests": max(concurrency, 1)}
    if args.num_threads:
        engine_args["num-threads"] = args.num_threads
    engine = start_engine(model_path=str(model_dir), log_dir=workdir, name=f"bench-c{concurrency}", device=args.device,
                          engine_args=engine_args, gpu_ids=[0] if args.device.startswith("cuda") else ())

    async def drive() -> float:
        sampling = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 1.0}
        async with RolloutClient(engine.url) as client:
            await client.generate({"text": prompts[0], "sampling_params": {**sampling, "max_new_tokens": 4}})  # warm-up
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int, prompt: str) -> int:
                async with gate:
                    result = await client.generate({"text": prompt, "rid": f"bench-{i}", "sampling_params": sampling})
                    return len(result["output_ids"])

            with Stopwatch() as watch:
                tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
            return tokens / watch.seconds

    try:
        return asyncio.run(drive())
    finally:
        engine.stop()


class _Baseline:
    def __init__(self, model_dir, device: str, dtype: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        self.num_params = sum(p.numel() for p in self.model.parameters())

    @torch.inference_mode()
    def tokens_per_s(self, prompts: list[str], batch: int, max_new_tokens: int) -> float:
        self._generate(prompts[:1], 4)  # warm-up
        seconds, tokens = median_time(
            lambda: sum(self._generate(prompts[i : i + batch], max_new_tokens) for i in range(0, len(prompts), batch)),
            repeat=1, device=self.device,
        )
        return tokens / seconds

    def _generate(self, prompts: list[str], max_new_tokens: int) -> int:
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.device)
        out = self.model.generate(**inputs, do_sample=True, temperature=1.0, max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, pad_token_id=self.tokenizer.pad_token_id)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]


def _prompt(i: int, length: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    return "".join(alphabet[(i * 7 + j * 13) % len(alphabet)] for j in range(length))


def _report(args, dtype, model_dir, rows, num_params, command: str) -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",) * 3
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or platform.machine()
    lines = [
        f"# Built-in engine throughput ({args.device})",
        "",
        f"Command: `{command}`",
        "",
        f"- Model: tiny Llama from `build_tiny_checkpoint(hidden_size={args.hidden_size}, num_layers={args.num_layers}, "
        f"num_heads={args.num_heads})`, {num_params / 1e6:.2f} M parameters, {dtype}, character vocabulary",
        f"- Work: prompts of {args.prompt_len} characters, exactly {args.max_new_tokens} new tokens per sequence "
        "(EOS ignored), temperature 1.0",
        f"- Machine: {os.cpu_count()} CPUs, {device}, torch {torch.__version__}, torch threads "
        f"{args.num_threads or torch.get_num_threads()}, load average at the end {load[0]:.1f}",
        "- Engine rows go through HTTP (a separate engine process, the rollout client, N requests in flight, "
        "2N requests or at least 16); `model.generate` rows run in this process with no server.",
        "",
        "| what | in flight | sequences | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {what} | {inflight} | {n} | {tps:,.0f} |" for what, inflight, n, tps in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

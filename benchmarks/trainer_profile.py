"""Where the torch backend's forward+backward time goes on the Qwen3-0.6B shape, and what moves it.

Runs the trainer part of `gpu_components.py` (64 samples x (128 + 512) tokens, GRPO loss) under a
few variants, each timed as the median of three `accumulate_gradients` calls after a warm-up, with
the model FLOPs per second as a share of the measured bf16 matmul ceiling:

  base        the backend as configured by default (on a GPU: compiled decoder layers, micro-batches
              of up to 16,384 padded tokens)
  eager       the decoder layers not compiled (RLKUBE_TORCH_COMPILE=0)
  mb8k/mb32k  micro-batches of up to 8,192 / 32,768 padded tokens
  flash       attention forced onto SDPA's flash kernel (fails if it cannot take it)
  bf16w       the weights themselves in bf16 (no autocast casts, bf16 residual stream): what the
              float32 master weights under autocast cost

The first variant is also profiled: GPU time by kernel family (matmul, attention, elementwise,
reductions, copies) against wall time shows whether the step is bound by kernels or by launches.

Usage (GPU machine, repository root, runtime importable):
    python benchmarks/trainer_profile.py --variants base,eager,mb32k --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import traceback
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import call_times, command_line, median_time, write_results  # noqa: E402
from gpu_components import _train_flops, grpo_batch  # noqa: E402
from qwen3_shape import QWEN3_06B, TINY, build_checkpoint  # noqa: E402

VARIANTS = ("base", "eager", "mb8k", "mb32k", "flash", "bf16w")
KERNEL_FAMILIES = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|sm90|sm100|cublas|matmul|xmma", re.I)),
    ("reduction", re.compile(r"reduce|softmax|logsumexp|norm|sum_kernel|max_kernel", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|fill|CatArray|index", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton", re.I)),
)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny_shape else "cpu"
    shape = TINY if args.tiny_shape else QWEN3_06B
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlkube-trainer-profile-"))
    model_dir = workdir / "model"
    params = build_checkpoint(model_dir, shape, seed=1234, device=device)
    ceiling = _matmul_ceiling() if device == "cuda" else None
    results: dict = {"parameters": params, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "matmul_tflops": ceiling, "variants": {}}
    for i, name in enumerate(args.variants):
        print(f"--- {name} ---", flush=True)
        try:
            results["variants"][name] = run_variant(name, model_dir, device, args, ceiling, profile=(i == 0))
        except Exception:
            results["variants"][name] = {"error": traceback.format_exc()[-2500:]}
        print(json.dumps(results["variants"][name], indent=1)[:4000], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        write_results("", results, command_line(__file__, argv or None), out=None,
                      json_path=Path(args.out) / "trainer_profile.json")
    return 0


def run_variant(name: str, model_dir: Path, device: str, args, ceiling: float | None, *, profile: bool) -> dict:
    from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
    from rlkube_runtime.trainer.torch_backend import TorchBackend

    from rlkube_runtime.trainer import torch_backend

    max_tokens = {"mb8k": 8192, "mb32k": 32768}.get(name)
    os.environ[torch_backend.COMPILE_ENV] = "0" if name == "eager" else "1"
    config = TrainerConfig(
        model=ModelConfig(hf_checkpoint=str(model_dir), dtype="bfloat16"),
        optimizer=OptimizerConfig(lr=1e-6),
        batching=BatchingConfig(max_tokens_per_gpu=max_tokens),
        loss=LossConfig(),
    )
    backend = TorchBackend(config, device=device)
    if name == "bf16w":
        backend.model.to(torch.bfloat16)
    n, p, r = args.train_samples, args.prompt_len, args.new_tokens
    batch = grpo_batch(backend.model.config.vocab_size, n, p, r)
    context = contextlib.nullcontext
    if name == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        context = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    with context():
        old = backend.log_probs(batch).log_probs
        batch = batch.with_fields(old_log_probs=old)
        fwd_bwd = partial(backend.accumulate_gradients, batch)
        # The warm-up call compiles, fills the allocator and picks cuBLAS heuristics.
        warmup_s, _ = median_time(fwd_bwd, repeat=1, device=device)
        times, _ = call_times(fwd_bwd, repeat=3, device=device)
        out = {"warmup_s": warmup_s, "forward_backward_s": statistics.median(times), "times": times,
               "micro_batches": len(backend._plan(batch))}
        flops = _train_flops(backend.model.config, n, p + r, r)
        out["tflops"] = flops / out["forward_backward_s"] / 1e12
        if ceiling:
            out["share_of_matmul_ceiling"] = out["tflops"] / ceiling
        if device == "cuda":
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        if profile and device == "cuda":
            out["profile"] = _profile(fwd_bwd)
    del fwd_bwd, backend
    return out


def _profile(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    def profiled():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return prof

    wall, prof = median_time(profiled, repeat=1, device="cuda")
    families: dict[str, float] = defaultdict(float)
    kernels = []
    launches = 0
    for event in prof.key_averages():
        cuda_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if event.device_type == torch.autograd.DeviceType.CUDA and cuda_us > 0:
            launches += event.count
            family = next((f for f, pattern in KERNEL_FAMILIES if pattern.search(event.key)), "other")
            families[family] += cuda_us / 1e6
            kernels.append((cuda_us / 1e6, event.count, event.key[:120]))
    kernels.sort(reverse=True)
    busy = sum(families.values())
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table, flush=True)
    return {
        "wall_s_under_profiler": wall,
        "gpu_busy_s": busy,
        "kernel_launches": launches,
        "gpu_s_by_family": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"s": s, "count": c, "name": k} for s, c, k in kernels[:25]],
    }


def _matmul_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b

    def twenty():
        for _ in range(20):
            a @ b

    seconds, _ = median_time(twenty, repeat=1, device="cuda")
    return 20 * 2 * 8192**3 / seconds / 1e12


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", type=lambda t: [x for x in t.split(",") if x], default=list(VARIANTS))
    p.add_argument("--tiny-shape", action="store_true", help="tiny model on the CPU: a plumbing check")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--train-samples", type=int, default=64)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="directory for trainer_profile.json")
    args = p.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    return args


if __name__ == "__main__":
    raise SystemExit(main())

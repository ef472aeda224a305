"""Forward+backward MFU of the megatron trainer backend on the random-init Qwen3-0.6B shape
(hidden 1024, 28 layers, 16 heads / 8 kv heads, head_dim 128, intermediate 3072, vocabulary
151,936, tied embeddings), on a GRPO-shaped batch of 64 samples x (128 + 512) tokens.

The method is the trainer measurement of gpu_components.py (_harness.time_train_passes): the same batch, the median of
3 timed calls each of log_probs (forward), accumulate_gradients (forward+backward, no
optimizer step), the optimizer step and a whole train_step; model FLOPs counted by
gpu_components._train_flops (every layer matmul on every token, the LM head on response
positions only, causal attention); TFLOP/s as a share of the bf16 matmul ceiling measured in the
same process (8192^3, gpu_components.ceilings) and of the GPU's dense bf16 peak when known.

Usage (GPU machine, repository root, runtime importable):
    python benchmarks/megatron_mfu.py --out benchmarks/results/megatron_mfu_h200.md
    torchrun --nproc-per-node 2 benchmarks/megatron_mfu.py --tensor 2 --out benchmarks/results/megatron_mfu_h200_tp2.md
CPU plumbing check (tiny shape): python benchmarks/megatron_mfu.py --tiny-shape --device cpu --train-samples 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import command_line, time_train_passes, write_results  # noqa: E402
from gpu_components import _machine, _num, _train_flops, ceilings, grpo_batch  # noqa: E402
from qwen3_shape import QWEN3_06B, TINY, build_checkpoint, qwen3_config  # noqa: E402

# Dense bf16 peaks (no sparsity), by device name fragment, for MFU against the spec sheet.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = _init_distributed(device)
    shape = TINY if args.tiny_shape else QWEN3_06B
    workdir = Path(args.workdir or os.environ.get("RLKUBE_BENCH_DIR") or tempfile.gettempdir()) / "rlkube-megatron-mfu"
    model_dir = workdir / ("tiny" if args.tiny_shape else "qwen3-0.6b-shape")
    if rank == 0:
        params = build_checkpoint(model_dir, shape, seed=args.seed, device=device)
    if world > 1:
        torch.distributed.barrier()
    params = build_checkpoint(model_dir, shape, seed=args.seed, device=device)  # reused: just the count
    from megatron.core import __version__ as megatron_core

    results = {"meta": {**_machine(device, params, shape), "world_size": world, "megatron_core": megatron_core}}
    if device == "cuda":
        results["ceilings"] = ceilings(args, device, model_dir, results)
    results["megatron_trainer"] = measure(args, device, model_dir, results)
    if rank == 0:
        command = command_line(__file__, argv or None)
        if world > 1:
            command = f"torchrun --nproc-per-node {world} " + command[len("python "):]
        report = render(results, command)
        print(report, flush=True)
        write_results(report, results, command, out=args.out, json_path=args.json)
    return 0


def measure(args, device, model_dir, results) -> dict:
    from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
    from rlkube_runtime.trainer.megatron.backend import MegatronBackend
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    config = TrainerConfig(
        model=ModelConfig(hf_checkpoint=str(model_dir), dtype="bfloat16"),
        optimizer=OptimizerConfig(lr=1e-6),
        batching=BatchingConfig(max_tokens_per_gpu=args.max_tokens_per_gpu),
        loss=LossConfig(),
    )
    sizes = ParallelSizes(tensor=args.tensor, pipeline=args.pipeline, sequence_parallel=args.sequence_parallel,
                          recompute=args.recompute)
    backend = MegatronBackend(config, sizes, device="cpu" if device == "cpu" else None)
    n, p, r = args.train_samples, args.prompt_len, args.new_tokens
    batch = grpo_batch(backend.arch.vocab_size, n, p, r)
    flops = _train_flops(qwen3_config(QWEN3_06B if not args.tiny_shape else TINY), n, p + r, r)
    timing, metrics = time_train_passes(backend, batch, flops, device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out = {**timing, "tensor": args.tensor, "pipeline": args.pipeline, "sequence_parallel": args.sequence_parallel,
           "recompute": args.recompute, "gpus": world, "max_tokens_per_gpu": args.max_tokens_per_gpu,
           "micro_batches_per_rank": metrics["num_micro_batches"], "tflops_per_gpu": timing["tflops"] / world}
    ceiling = results.get("ceilings", {}).get("matmul_tflops")
    if ceiling:
        out["share_of_matmul_ceiling"] = out["tflops_per_gpu"] / ceiling
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        if peak:
            out["mfu_of_dense_bf16_peak"] = out["tflops_per_gpu"] / peak
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def render(results: dict, command: str) -> str:
    meta, m = results["meta"], results["megatron_trainer"]
    gpus = meta.get("gpus") or [meta["device"]]
    lines = [f"# Megatron trainer forward+backward MFU ({gpus[0]})", "", f"Command: `{command}`", "",
             f"- Model: random-init {'tiny' if meta['params'] < 10**8 else 'Qwen3-0.6B'} shape, {meta['params']:,} "
             f"parameters, " + ("bf16 (fp32 master weights in megatron-core's distributed optimizer)"
                                if meta["device"] == "cuda" else "float32 on CPU (torch AdamW)")
             + f"; torch {meta['torch']}, transformers {meta['transformers']}, megatron-core {meta.get('megatron_core')}",
             f"- Batch: {m['samples']} samples x {m['tokens'] // m['samples']} tokens; tensor {m['tensor']}, pipeline "
             f"{m['pipeline']}, sequence parallel {m['sequence_parallel']}, recompute {m['recompute']}, "
             f"{m['micro_batches_per_rank']:.0f} micro-batches per rank",
             f"- Method: benchmarks/gpu_components.py's trainer measurement (median of 3; model FLOPs by its _train_flops)",
             ""]
    if "ceilings" in results:
        lines += ["## Ceilings (measured in the same run)", "", "```json",
                  json.dumps(results["ceilings"], indent=1, default=_num), "```", ""]
    lines += ["## Megatron backend", "", "```json", json.dumps(m, indent=1, default=_num), "```", ""]
    return "\n".join(lines)


def _init_distributed(device: str) -> tuple[int, int]:
    """torchrun's ranks (RANK/WORLD_SIZE set) join one group; a plain start is one rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    return rank, world


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--tiny-shape", action="store_true", help="a tiny model with the same code paths (CPU checks)")
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", choices=("none", "full", "selective"), default="none")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="micro-batch token budget (default: the runtime's)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--train-samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="Markdown report")
    p.add_argument("--json", default=None, help="every figure as JSON")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

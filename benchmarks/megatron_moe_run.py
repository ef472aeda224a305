"""`rlkube run` of a random-init Qwen3-MoE of a few hundred million parameters on the megatron
backend, colocated on one GPU: does the whole MoE loop (megatron-core's MoE layer in training,
every expert synced into the built-in engine, generation through HF's Qwen3-MoE block) run at a
real size, and how far apart do engine and trainer score the same tokens?

One invocation:
  0. builds (or reuses) a seeded random-init checkpoint of `QWEN3_MOE_SMALL` (qwen3_shape.py:
     hidden 1024, 8 layers, 16 experts of 768, top 2, untied head, the real 151,936-entry
     vocabulary as a word-level tokenizer) and WORKDIR/prompts.jsonl (random words), in a child;
  1. runs `python -m rlkube_runtime.cli run JOB.yaml` on an RLJob with backend megatron, placement
     colocated, engine builtin, bf16, GRPO, a weight sync every rollout, and the even-token reward
     (`even_token_reward.py`: the share of response tokens with an even id, chance 0.5), while
     `nvidia-smi` samples the GPU's used memory every 0.5 s;
  2. writes, per rollout, the reward, the engine-vs-trainer log-prob gap
     (`train/train_rollout_logprob_abs_diff`, mean absolute difference per response token), the
     step's stages, the bytes and seconds of the weight sync, and the peak GPU memory seen.

Usage on the GPU machine, after unpacking the device bundle
(`bash ../shared/tools/device-bundle.sh megatron-core==0.19.2`):

    python benchmarks/megatron_moe_run.py --out benchmarks/results/megatron_moe_h100.md \
        --json benchmarks/results/megatron_moe_h100.json   (named for the card that runs it)

CPU plumbing check: `python benchmarks/megatron_moe_run.py --tiny-shape --device cpu --rollouts 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_shape import QWEN3_MOE_SMALL, SPECIALS, TINY_MOE, build_checkpoint  # noqa: E402
from _harness import Stopwatch, command_line, read_jsonl, timed_subprocess, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COLUMNS = (  # (metrics.jsonl key, column title, digits)
    ("rollout/raw_reward", "reward", 3),
    ("train/train_rollout_logprob_abs_diff", "log-prob gap", 4),
    ("rollout/response_len/mean", "response tokens", 0),
    ("train/moe_load_balancing_loss", "balance loss", 3),
    ("rollout/routed_experts_bytes", "routes bytes", 0),
    ("train/routing_replay_mismatch", "route mismatch", 4),
    ("perf/rollout_time", "generate s", 2),
    ("perf/actor_train_time", "train s", 2),
    ("perf/update_weights_time", "sync s", 3),
    ("perf/handoff_to_train_time", "to train s", 2),
    ("perf/handoff_to_rollout_time", "to rollout s", 2),
    ("perf/step_time", "step s", 2),
)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.build_worker:
        return _build_worker(Path(args.build_worker))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlkube-moe-"))
    workdir.mkdir(parents=True, exist_ok=True)
    build = _build(args, workdir)
    print(f"checkpoint: {build['checkpoint']} ({build['params']:,} parameters, built in {build['build_s']:.0f}s)", flush=True)
    prompts = _write_prompts(workdir / "prompts.jsonl", args)
    job = workdir / "rljob.yaml"
    job.write_text(json.dumps(_rljob(args, build, prompts), indent=1), encoding="utf-8")
    out = workdir / "run"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "operator"), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    memory = _GpuMemory() if build["device"] == "cuda" else None
    log = workdir / "run.log"
    cmd = [sys.executable, "-m", "rlkube_runtime.cli", "run", str(job), "--output-dir", str(out), "--no-resume"]
    rc, wall = timed_subprocess(cmd, log, timeout=args.timeout, env=env, echo=_PROGRESS)
    peak_mib = memory.stop() if memory else None
    rows = sorted((r for r in read_jsonl(out / "metrics.jsonl") if r.get("rollout", -1) >= 0), key=lambda r: r["rollout"])
    if rc != 0 or len(rows) < args.rollouts:
        print(log.read_text(encoding="utf-8", errors="replace")[-6000:], flush=True)
    figures = {"build": build, "returncode": rc, "wall_s": wall, "peak_gpu_memory_mib": peak_mib, "rollouts": rows}
    command = command_line(__file__, argv)
    report = _report(args, build, rows, rc, wall, peak_mib, command)
    write_results(report, figures, command, out=args.out, json_path=args.json)
    print(report, flush=True)
    return 0 if rc == 0 and len(rows) == args.rollouts else 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per rollout")
    p.add_argument("--n-samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="words (one token each) per prompt")
    p.add_argument("--max-response-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aux-loss-coeff", type=float, default=0.0,
                   help="megatronArgs moe-aux-loss-coeff (0: no load-balancing loss, the routing of the HF block alone)")
    p.add_argument("--routing-replay", action="store_true",
                   help="training.routingReplay: the engine reports every token's experts and the trainer replays them")
    p.add_argument("--tiny-shape", action="store_true", help="the same code path at CPU size")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="where the checkpoint is built")
    p.add_argument("--timeout", type=float, default=540, help="seconds the run may take")
    p.add_argument("--workdir")
    p.add_argument("--out", help="Markdown report")
    p.add_argument("--json", help="every figure, with the command")
    p.add_argument("--build-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _build(args: argparse.Namespace, workdir: Path) -> dict:
    """Build the checkpoint in a child, so this process holds no GPU memory while the run does."""
    shape = TINY_MOE if args.tiny_shape else QWEN3_MOE_SMALL
    config = {"out": str(workdir / f"model-{'tiny-moe' if args.tiny_shape else 'qwen3-moe-small'}-seed{args.seed}"),
              "info": str(workdir / "build.json"), "shape": shape, "seed": args.seed, "device": args.device}
    path = workdir / "build-config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-worker", str(path)], check=True)
    return {**json.loads(Path(config["info"]).read_text(encoding="utf-8")), "shape": shape}


def _build_worker(config_path: Path) -> int:
    import torch

    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    device = cfg["device"] if cfg["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with Stopwatch() as watch:
        params = build_checkpoint(Path(cfg["out"]), cfg["shape"], seed=cfg["seed"], device=device)
    info = {"checkpoint": cfg["out"], "params": params, "build_s": watch.seconds, "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    Path(cfg["info"]).write_text(json.dumps(info), encoding="utf-8")
    return 0


def _write_prompts(path: Path, args: argparse.Namespace) -> Path:
    """batch x rollouts distinct prompts of --prompt-len random words (the labels are unused)."""
    rng = random.Random(args.seed)
    words = (TINY_MOE if args.tiny_shape else QWEN3_MOE_SMALL)["vocab_size"] - len(SPECIALS)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(args.batch_size * args.rollouts):
            prompt = " ".join(f"w{rng.randrange(words)}" for _ in range(args.prompt_len))
            f.write(json.dumps({"prompt": prompt, "label": ""}) + "\n")
    return path


def _rljob(args: argparse.Namespace, build: dict, prompts: Path) -> dict:
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "bench-megatron-moe"},
        "spec": {
            "model": {"hfCheckpoint": build["checkpoint"], "dtype": "bfloat16",
                      **({"megatronArgs": {"moe-aux-loss-coeff": args.aux_loss_coeff}} if args.aux_loss_coeff else {})},
            "data": {"promptData": str(prompts), "inputKey": "prompt", "labelKey": "label"},
            "rollout": {"engine": "builtin", "batchSize": args.batch_size, "nSamplesPerPrompt": args.n_samples,
                        "maxResponseLen": args.max_response_len, "temperature": 1.0},
            "reward": {"type": "custom", "customPath": "even_token_reward:even_token_share"},
            "algorithm": {"advantageEstimator": "grpo"},
            "training": {"backend": "megatron", "numRollout": args.rollouts, "routingReplay": args.routing_replay,
                         "globalBatchSize": args.batch_size * args.n_samples, "updateWeightsInterval": 1,
                         "optimizer": {"lr": args.lr}, "seed": args.seed},
            "resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 1}},
        },
    }


class _GpuMemory:
    """The peak of the GPU's used memory (all processes) as `nvidia-smi` reports it every 0.5 s."""

    def __init__(self) -> None:
        self.peak = 0
        self._child = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "500", "-i", "0"],
            stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._child.stdout:
            if line.strip().isdigit():
                self.peak = max(self.peak, int(line))

    def stop(self) -> int:
        self._child.terminate()
        self._child.wait()
        self._reader.join(timeout=5)
        return self.peak


def _report(args, build, rows, rc, wall, peak_mib, command) -> str:
    shape = build["shape"]
    lines = [
        "# A random-init Qwen3-MoE through `rlkube run` on the megatron backend, colocated",
        "",
        f"Model: random-init Qwen3-MoE, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_experts']} experts of {shape['moe_intermediate_size']}, top {shape['num_experts_per_tok']}, "
        f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV heads of {shape['head_dim']}, "
        f"vocabulary {shape['vocab_size']:,}, untied head: **{build['params']:,} parameters**, bf16. "
        f"Device: {build['gpu'] or build['device']}. Each rollout: {args.batch_size} prompts of {args.prompt_len} tokens "
        f"x {args.n_samples} samples, up to {args.max_response_len} new tokens, temperature 1.0, GRPO, lr {args.lr:g}, "
        "one optimizer step, a weight sync (every expert) after it. Reward: the share of response tokens with an even id "
        "(chance 0.5)." + (f" Load-balancing loss on (moe-aux-loss-coeff {args.aux_loss_coeff:g})." if args.aux_loss_coeff else "")
        + (" Rollout routing replay on (training.routingReplay: the trainer's routers take the engine's experts)."
           if args.routing_replay else ""),
        "",
        f"Exit code {rc}, {len(rows)} of {args.rollouts} rollouts, wall {wall:.0f} s (start-up included)"
        + (f", peak GPU memory used {peak_mib / 1024:.1f} GiB (nvidia-smi, every 0.5 s)" if peak_mib else "") + ".",
        "",
        "| rollout | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        lines.append(f"| {r['rollout']} | " + " | ".join(_fmt(r.get(key), digits) for key, _, digits in COLUMNS) + " |")
    if rows:
        synced = {r.get("perf/update_weights_bytes") for r in rows}
        gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
        later = rows[1:] or rows
        lines += ["", f"Bytes per weight sync: {', '.join(f'{int(b):,}' for b in sorted(b for b in synced if b))} "
                      f"(bf16: {2 * build['params']:,} for every parameter once).",
                  f"Log-prob gap: max {max(gaps):.4f}, median {statistics.median(gaps):.4f} per token." if gaps else "",
                  f"Medians over rollouts {later[0]['rollout']}-{later[-1]['rollout']} (rollout 0 warms up): "
                  + ", ".join(f"{title} {_fmt(statistics.median([r[key] for r in later if key in r]), digits)}"
                              for key, title, digits in COLUMNS if key.startswith("perf/") and any(key in r for r in later)) + "."]
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def _fmt(value, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


_PROGRESS = re.compile(r"^rollout \d+/\d+")


if __name__ == "__main__":
    sys.exit(main())

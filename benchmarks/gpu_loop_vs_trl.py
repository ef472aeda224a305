"""Per-stage seconds of GRPO rollouts of a Qwen3-0.6B-shaped model on GPU: rlkube beside TRL.

One invocation runs, one after the other, each in its own child process (so each pays its own
start-up and holds the GPU alone):

  0. build: a seeded random-init checkpoint of Qwen3-0.6B's shape (596M parameters, bf16
     safetensors, tied embeddings) and a word-level tokenizer with exactly vocab_size entries,
     built locally (nothing downloaded) into WORKDIR once; plus WORKDIR/prompts.jsonl, prompts of
     `--prompt-len` random words (one token each) with a one-word label, seeded. All sides read
     these same files.
  1. rlkube colocated: `python -m rlkube_runtime.cli run JOB.yaml --output-dir DIR` on a generated
     RLJob (placement colocated, trainer 1 node x 1 GPU, engine builtin, bf16, weight sync every
     rollout) with CUDA_VISIBLE_DEVICES=<first GPU>.
  2. rlkube separate: the same RLJob with placement separate (trainer 1 GPU + rollout.gpus 1),
     CUDA_VISIBLE_DEVICES=<first two GPUs>; skipped with a note when fewer than 2 GPUs are visible.
  3. TRL GRPOTrainer (TRL 1.x, transformers `model.generate`, no vLLM), one GPU, bf16=True.

Every rollout is one optimizer step on batch x n samples (8 prompts x 8 samples = 64 by default),
responses up to --max-response-len tokens (a random model practically never samples EOS, so they
run to the limit; the actual mean length is read back from each side's logs), temperature 1.0,
lr 1e-6, the same exact-match reward rule (rlkube's built-in `exact` type; TRL gets
rlkube_runtime.rewards.text_rules.exact_reward as its reward function). The reward is 0 for
practically every sample, so the advantages are 0; both sides still run the full forward,
backward and optimizer step (neither skips zero-advantage batches). Learning is not measured.

What is measured, per rollout (rollout 0 of each side is warm-up; medians are over the rest):
  - rlkube: every `perf/*` key of the run's metrics.jsonl, as the loop (runtime/rlkube_runtime/
    run/loop.py) defines it at the measured revision, plus `rollout/response_len/mean`. The summary
    rows use perf/rollout_time (generate: generation + reward), perf/actor_train_time (train),
    perf/update_weights_time (weight sync), the sum of any offload/onload/release/resume keys
    (memory hand-off, when the driver reports it separately) and perf/step_time (step). The last
    rollout's step also writes the run's final checkpoint (the driver always does).
  - TRL: step = seconds between consecutive `on_step_end` callbacks, each after a
    torch.cuda.synchronize(); generate = wall time of `_generate_and_score_completions` (generation,
    decoding, reward, advantages; ended by a synchronize); of which model.generate = TRL's own
    `transformers.generate` profiling timer (generate synchronizes every token, so its wall time is
    GPU time); train = step - generate (4 micro-batch forward/backward passes, the optimizer step,
    logging). There is no weight sync: the policy generates itself. TRL's other profiling timers
    are listed too; timers around GPU work that does not synchronize measure launch time only.
  - samples/s = samples per rollout / median step seconds; generated tokens/s = samples x mean
    response tokens / median generate seconds.

Usage, from the repository root:

    python benchmarks/gpu_loop_vs_trl.py --rollouts 6 --out benchmarks/results/gpu_loop_h200.md

The GPU machine lacks ray, pydantic, trl, datasets, ...: build the bundle here with
`bash ../shared/tools/device-bundle.sh trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19`,
carry `.device`, and start the command there with
`mkdir -p /tmp/site && tar -C /tmp/site -xJf .device/site.tar.xz &&
export PYTHONPATH=$PWD/runtime:$PWD/operator:/tmp/site RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 &&`.
--timeout bounds each side; the sides together must fit the machine's limit on one command. When
they do not, run them in turns with `--only` into one --workdir and render them together with
`--merge-json` of the earlier JSON files. CPU plumbing check:
`--tiny-shape --device cpu --max-response-len 16 --prompt-len 16 --rollouts 3`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_shape import QWEN3_06B, SPECIALS, TINY, build_checkpoint  # noqa: E402  (the GPU benchmarks' model)
from trl_settings import grpo_settings  # noqa: E402
from _harness import (  # noqa: E402
    Stopwatch, command_line, read_jsonl, step_timer, timed_generation, timed_subprocess, write_results,
)

REPO = Path(__file__).resolve().parent.parent
SIDES = ("colocated", "colocated-megatron", "separate", "trl")
TITLES = {"colocated": "rlkube colocated", "colocated-megatron": "rlkube colocated, megatron backend",
          "separate": "rlkube separate", "trl": "TRL GRPOTrainer"}
RLKUBE_SIDES = ("colocated", "colocated-megatron", "separate")
# Each rlkube side: (placement, training.backend).
LAYOUTS = {"colocated": ("colocated", "torch"), "colocated-megatron": ("colocated", "megatron"),
           "separate": ("separate", "torch")}

HANDOFF_KEY = re.compile(r"offload|onload|release|resume|hand_?off")


@dataclass
class Side:
    """One side of the comparison: its status and every per-rollout number read back from its logs."""

    key: str  # colocated | separate | trl
    title: str
    status: str = "not run"  # ok | failed | skipped | not run
    note: str = ""
    error: str = ""
    wall_s: float = math.nan  # the whole child process: start-up, rollouts, shutdown
    log_path: str = ""
    log_tail: str = ""
    # One dict per rollout, warm-up first. rlkube: the metrics.jsonl row as written. TRL: step_s,
    # generate_s, timer/<TRL profiling timer> (seconds summed over the step), log/<logged key>.
    rollouts: list[dict] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.build_worker:
        return _build_worker(Path(args.build_worker))
    if args.trl_worker:
        return _trl_worker(Path(args.trl_worker))
    command = command_line(__file__)
    only = _parse_only(args.only)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlkube-gpu-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json or Path(args.out).with_suffix(".json"))
    print(f"workdir: {workdir}", flush=True)

    build = _build(args, workdir)
    print(
        f"checkpoint: {build['checkpoint']} ({build['params']:,} parameters, built in {build['build_s']:.1f}s"
        f"{', reused' if build['reused'] else ''}); device {build['device']}, GPUs: {build['gpu_count']} "
        f"{build['gpu_names']}",
        flush=True,
    )
    prompts = _write_prompts(workdir / "prompts.jsonl", args, vocab_words=build["vocab_size"] - len(SPECIALS))
    gpus = _visible_gpus(build["gpu_count"]) if build["device"] == "cuda" else []

    sides = [s for s in _load_merged(args.merge_json) if s.key not in only]
    beside = None  # TRL on the last GPU while rlkube colocated runs on the first (--trl-beside-colocated)
    if args.trl_beside_colocated and "trl" in only and "colocated" in only and len(gpus) >= 2:
        print(f"--- {TITLES['trl']} (on GPU {gpus[-1]}, beside rlkube colocated on GPU {gpus[0]}) ---", flush=True)
        beside = concurrent.futures.ThreadPoolExecutor(1).submit(_run_trl, args, build, prompts, workdir, gpus[-1:])
    for key in SIDES:
        if key not in only:
            continue
        if key == "trl" and beside is not None:
            side = beside.result()
            side.note += "; ran at the same time as rlkube colocated, on another GPU of the same host"
        else:
            if key == "separate" and beside is not None:
                beside.result()  # separate needs both GPUs
            print(f"--- {TITLES[key]} ---", flush=True)
            if key == "trl":
                side = _run_trl(args, build, prompts, workdir, gpus)
            else:
                side = _run_rlkube(args, key, build, prompts, workdir, gpus)
        print(f"  {side.status}: {_one_line(side)}", flush=True)
        sides.append(side)
        _write_json(json_path, command, args, build, sides)  # after every side: nothing lost if a later one hangs
    sides.sort(key=lambda s: SIDES.index(s.key))
    _write_json(json_path, command, args, build, sides)
    print(f"wrote {json_path}", flush=True)

    report = _render_report(args, build, sides, command=command)
    print(report, flush=True)
    write_results(report, {}, command, out=args.out, json_path=None)
    print(f"wrote {args.out}", flush=True)
    return 0 if all(s.status in ("ok", "skipped") for s in sides) else 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=6, help="rollouts (= optimizer steps) per side, the first is warm-up. Default 6.")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per rollout. Default 8.")
    p.add_argument("--n-samples", type=int, default=8, help="samples per prompt (GRPO group). Default 8.")
    p.add_argument("--max-response-len", type=int, default=512, help="max new tokens per sample. Default 512.")
    p.add_argument("--prompt-len", type=int, default=128, help="words (= tokens) per prompt. Default 128.")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of both sides. Default 1e-6.")
    p.add_argument("--seed", type=int, default=1234, help="seed of the checkpoint, the prompts and both trainers. Default 1234.")
    p.add_argument("--tiny-shape", action="store_true", help="a 2-layer, 64-wide model with an 8192-word vocabulary instead of Qwen3-0.6B's shape (CPU checks).")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when torch sees a GPU. Default auto.")
    p.add_argument("--trl-micro-batch", type=int, default=16, help="TRL per_device_train_batch_size; gradient accumulation makes up the rest of the batch. Default 16 (64 samples = 4 micro-batches).")
    p.add_argument("--trl-model-dtype", choices=("float32", "bfloat16"), default="float32", help="dtype TRL loads the policy in; with bf16=True the forward runs under bf16 autocast either way. Default float32 (TRL's own default for a model path, and fp32 master weights as rlkube's trainer keeps them).")
    p.add_argument("--only", default=",".join(SIDES), help=f"comma-separated sides to run, of {','.join(SIDES)}. Default all.")
    p.add_argument("--trl-beside-colocated", action="store_true", help="with 2+ GPUs, run TRL on the last GPU at the same time as rlkube colocated on the first (each still has its GPU alone; they share the host's CPUs), so the three sides fit in one shorter invocation.")
    p.add_argument("--timeout", type=float, default=300, help="seconds each side may take (its whole process). Default 300.")
    p.add_argument("--workdir", default=None, help="checkpoint, prompts, job files, logs, run outputs (default: a new temp directory).")
    p.add_argument("--out", default="benchmarks/results/gpu_loop_h200.md", help="Markdown report. Default benchmarks/results/gpu_loop_h200.md.")
    p.add_argument("--json", default=None, help="raw per-rollout numbers of every side. Default: --out with .json.")
    p.add_argument("--revision", default=None, help="the measured revision to print where this is no git checkout (the GPU machine's copy has no .git).")
    p.add_argument("--merge-json", action="append", default=[], help="a JSON file of an earlier run; its sides not run now join the report (repeatable).")
    p.add_argument("--build-worker", default=None, help=argparse.SUPPRESS)  # internal: the build child
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: the TRL child
    args = p.parse_args(argv)
    if args.build_worker or args.trl_worker:
        return args
    for name in ("batch_size", "max_response_len", "prompt_len", "trl_micro_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.n_samples < 2:
        p.error("--n-samples must be >= 2 (GRPO compares within a group)")
    if args.rollouts < 2:
        p.error("--rollouts must be >= 2 (the first one is warm-up)")
    if (args.batch_size * args.n_samples) % args.trl_micro_batch:
        p.error(f"--trl-micro-batch {args.trl_micro_batch} must divide batch x n = {args.batch_size * args.n_samples}")
    return args


def _parse_only(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SIDES]
    if unknown or not keys:
        sys.exit(f"--only takes a comma-separated list of {', '.join(SIDES)}; got {text!r}")
    return keys


# --- checkpoint and prompts --------------------------------------------------------------------


def _build(args: argparse.Namespace, workdir: Path) -> dict:
    """Build (or reuse) the checkpoint in a child process, which also reports the GPUs torch sees.

    A child keeps this process free of CUDA: it holds no GPU memory while the sides run.
    """
    shape = TINY if args.tiny_shape else QWEN3_06B
    name = "tiny" if args.tiny_shape else "qwen3-0.6b-shape"
    config = {
        "out": str(workdir / f"model-{name}-seed{args.seed}"),
        "info": str(workdir / f"build-{name}.json"),
        "shape": shape,
        "seed": args.seed,
        "device": args.device,
    }
    path = workdir / f"build-{name}-config.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    Path(config["info"]).unlink(missing_ok=True)
    log = workdir / "build.log"
    rc, _, error = _run_child([sys.executable, str(Path(__file__).resolve()), "--build-worker", str(path)], log, timeout=900)
    if rc != 0 or not Path(config["info"]).exists():
        print(_tail(log), flush=True)
        sys.exit(f"building the checkpoint failed ({error}); log: {log}")
    info = json.loads(Path(config["info"]).read_text(encoding="utf-8"))
    return {**info, "shape_name": name, "shape": shape}


def _build_worker(config_path: Path) -> int:
    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    import torch

    device = cfg["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(cfg["out"])
    with Stopwatch() as build:
        reused = (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
        params = build_checkpoint(out, cfg["shape"], seed=cfg["seed"], device=device)
    info = {
        "checkpoint": str(out),
        "params": params,
        "vocab_size": cfg["shape"]["vocab_size"],
        "build_s": build.seconds,
        "reused": reused,
        "device": device,
        "gpu_count": torch.cuda.device_count() if device == "cuda" else 0,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device == "cuda" else [],
    }
    Path(cfg["info"]).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return 0


def _write_prompts(path: Path, args: argparse.Namespace, *, vocab_words: int) -> Path:
    """batch x rollouts distinct prompts of --prompt-len random words, each with a one-word label."""
    rng = random.Random(args.seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(args.batch_size * args.rollouts):
            words = [f"w{rng.randrange(vocab_words)}" for _ in range(args.prompt_len)]
            f.write(json.dumps({"prompt": " ".join(words), "label": f"w{rng.randrange(vocab_words)}"}) + "\n")
    return path


def _visible_gpus(count: int) -> list[str]:
    """GPU ids as this process names them (its CUDA_VISIBLE_DEVICES, else 0..count-1)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()][:count]
    return [str(i) for i in range(count)]


# --- rlkube ------------------------------------------------------------------------------------


def _rljob(args: argparse.Namespace, key: str, build: dict, prompts: Path) -> dict:
    samples = args.batch_size * args.n_samples
    placement, backend = LAYOUTS[key]
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": f"bench-gpu-{key}"},
        "spec": {
            "model": {"hfCheckpoint": build["checkpoint"], "dtype": "bfloat16"},
            "data": {"promptData": str(prompts), "inputKey": "prompt", "labelKey": "label"},
            "rollout": {
                "engine": "builtin",
                "batchSize": args.batch_size,
                "nSamplesPerPrompt": args.n_samples,
                "maxResponseLen": args.max_response_len,
                "temperature": 1.0,
            },
            "reward": {"type": "exact"},
            "algorithm": {"advantageEstimator": "grpo"},
            "training": {
                "backend": backend,
                "numRollout": args.rollouts,
                "globalBatchSize": samples,  # one optimizer step per rollout
                "updateWeightsInterval": 1,
                "optimizer": {"lr": args.lr},
                "seed": args.seed,
            },
            # No periodic checkpoints; the driver still writes one after the last rollout.
            # Colocated engines run on the trainer's GPU: the spec refuses rollout GPUs there.
            "resources": {
                "placement": placement,
                "trainer": {"nodes": 1, "gpusPerNode": 1},
                **({"rollout": {"gpus": 1}} if placement == "separate" else {}),
            },
        },
    }


def _run_rlkube(args: argparse.Namespace, key: str, build: dict, prompts: Path, workdir: Path, gpus: list[str]) -> Side:
    import yaml

    side = Side(key, TITLES[key])
    on_gpu = build["device"] == "cuda"
    need = 2 if key == "separate" else 1
    if on_gpu and len(gpus) < need:
        side.status = "skipped"
        side.note = f"needs {need} GPUs, {len(gpus)} visible"
        return side
    job = workdir / f"rljob-{key}.yaml"
    job.write_text(yaml.safe_dump(_rljob(args, key, build, prompts), sort_keys=False), encoding="utf-8")
    env = _child_env(gpus[:need] if on_gpu else [])
    side.note = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES'] or '(none: CPU)'}"

    log = workdir / f"rlkube-{key}.log"
    side.log_path = str(log)
    validate = subprocess.run(
        [sys.executable, "-m", "rlkube_runtime.cli", "validate", str(job)],
        env=env, capture_output=True, text=True, check=False,
    )
    if validate.returncode != 0:
        side.status, side.error = "failed", f"rlkube validate {job} failed"
        side.log_tail = (validate.stdout + validate.stderr)[-4000:]
        return side

    out = workdir / f"rlkube-{key}-run"
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl is appended to: start from nothing
    cmd = [sys.executable, "-m", "rlkube_runtime.cli", "run", str(job), "--output-dir", str(out), "--no-resume"]
    rc, side.wall_s, error = _run_child(cmd, log, timeout=args.timeout, env=env)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("rollout", -1) >= 0]
    side.rollouts = sorted(rows, key=lambda r: r["rollout"])
    _finish(side, rc, error, expected=args.rollouts)
    if side.status != "ok":
        # The run's own logs (engines, router, failure.txt) say more than the driver's output.
        for path in sorted((out / "logs").glob("*")):
            side.log_tail += f"\n--- {path} (last lines) ---\n" + _tail(path, 15)
    return side


# --- TRL ---------------------------------------------------------------------------------------


def _run_trl(args: argparse.Namespace, build: dict, prompts: Path, workdir: Path, gpus: list[str]) -> Side:
    side = Side("trl", TITLES["trl"])
    on_gpu = build["device"] == "cuda"
    if on_gpu and not gpus:
        side.status, side.note = "skipped", "no GPU visible"
        return side
    config = {
        "checkpoint": build["checkpoint"],
        "prompts": str(prompts),
        "out_dir": str(workdir / "trl-run"),
        "result": str(workdir / "trl-result.json"),
        "rollouts": args.rollouts,
        "batch_size": args.batch_size,
        "n_samples": args.n_samples,
        "max_response_len": args.max_response_len,
        "micro_batch": args.trl_micro_batch,
        "model_dtype": args.trl_model_dtype,
        "lr": args.lr,
        "seed": args.seed,
        "cuda": on_gpu,
    }
    path = workdir / "trl-config.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    Path(config["result"]).unlink(missing_ok=True)
    env = _child_env(gpus[:1] if on_gpu else [])
    accumulation = args.batch_size * args.n_samples // args.trl_micro_batch
    side.note = (
        f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES'] or '(none: CPU)'}; policy loaded in {args.trl_model_dtype}, "
        f"bf16={on_gpu}; {accumulation} micro-batches of {args.trl_micro_batch}; gradient checkpointing off"
    )
    log = workdir / "trl.log"
    side.log_path = str(log)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(path)]
    rc, side.wall_s, error = _run_child(cmd, log, timeout=args.timeout, env=env)
    if Path(config["result"]).exists():
        side.rollouts = json.loads(Path(config["result"]).read_text(encoding="utf-8"))["rollouts"]
    _finish(side, rc, error, expected=args.rollouts)
    return side


def _trl_worker(config_path: Path) -> int:
    """The TRL side, in its own process: same checkpoint, prompts, reward rule and optimizer settings."""
    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    import torch
    import trl.extras.profiling as trl_profiling
    from datasets import Dataset
    from rlkube_runtime.rewards.text_rules import exact_reward
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(cfg["prompts"]).read_text(encoding="utf-8").splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)
    samples = cfg["batch_size"] * cfg["n_samples"]
    sync = torch.cuda.synchronize if cfg["cuda"] else (lambda: None)
    rollouts: list[dict] = []
    pending: dict[str, float] = {}  # timers of the step in progress

    def exact_match(completions: list[str], label: list[str], **_) -> list[float]:
        return [exact_reward(c, gold) for c, gold in zip(completions, label)]

    # TRL times its stages (profiling_context) but reports them only to wandb/mlflow/trackio:
    # record them here as well.
    original_log_metrics = trl_profiling.ProfilingContext._log_metrics

    def record_timer(self, duration: float) -> None:
        # Names are "<trainer class>.<stage>": keep the stage ("transformers.generate", "compute_loss").
        key = "timer/" + self.name.split(".", 1)[-1]
        pending[key] = pending.get(key, 0.0) + duration
        original_log_metrics(self, duration)

    trl_profiling.ProfilingContext._log_metrics = record_timer

    def save() -> None:
        Path(cfg["result"]).write_text(json.dumps({"rollouts": rollouts}), encoding="utf-8")

    def on_step(step: float) -> None:
        rollouts.append({"step_s": step, **pending})
        pending.clear()
        save()
        gen = rollouts[-1].get("generate_s", math.nan)
        print(f"trl step {len(rollouts)}/{cfg['rollouts']} | step {step:.2f}s | generate {gen:.2f}s", flush=True)

    def on_log(logs: dict) -> None:
        if rollouts:
            rollouts[-1].update({f"log/{k}": float(v) for k, v in logs.items() if isinstance(v, (int, float))})
            save()

    def on_generate(seconds: float) -> None:
        pending["generate_s"] = pending.get("generate_s", 0.0) + seconds

    TimedGRPOTrainer = timed_generation(GRPOTrainer, on_generate, sync=sync)

    # Settings mirror rlkube's defaults (spec/training.py, spec/algorithm.py) where TRL's differ.
    config = GRPOConfig(
        output_dir=cfg["out_dir"],
        use_cpu=not cfg["cuda"],
        bf16=cfg["cuda"],
        use_vllm=False,
        per_device_train_batch_size=cfg["micro_batch"],
        gradient_accumulation_steps=samples // cfg["micro_batch"],  # one optimizer step per generation
        generation_batch_size=samples,  # one generate call of batch x n completions per step
        **grpo_settings(rollouts=cfg["rollouts"], lr=cfg["lr"], n_samples=cfg["n_samples"],
                        max_response_len=cfg["max_response_len"], seed=cfg["seed"]),
    )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["model_dtype"]]
    model = AutoModelForCausalLM.from_pretrained(cfg["checkpoint"], dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg["checkpoint"])
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_timer(on_step, on_log, sync=sync)],
    )
    trainer.train()
    save()
    return 0


# --- reading the numbers -----------------------------------------------------------------------


def _stage_series(side: Side, samples: int) -> dict[str, list[float]]:
    """Per-rollout values of the summary rows, warm-up included (NaN where a side has no such stage)."""
    out: dict[str, list[float]] = {}
    for r in side.rollouts:
        if side.key == "trl":
            step, gen = r.get("step_s", math.nan), r.get("generate_s", math.nan)
            pure = r.get("timer/transformers.generate", math.nan)
            length = r.get("log/completions/mean_length", math.nan)
            row = {
                "generate": gen,
                "model.generate": pure,
                "train": step - gen,
                "weight sync": math.nan,
                "memory hand-off": math.nan,
                "step": step,
                "other": math.nan,
                "response tokens": length,
                "generated tokens/s (over model.generate)": samples * length / pure if pure else math.nan,
            }
        else:
            step = r.get("perf/step_time", math.nan)
            gen = r.get("perf/rollout_time", math.nan)
            train = r.get("perf/actor_train_time", math.nan)
            sync = r.get("perf/update_weights_time", math.nan)
            handoff = [v for k, v in r.items() if k.startswith("perf/") and HANDOFF_KEY.search(k)]
            length = r.get("rollout/response_len/mean", math.nan)
            # The loop times these stages one after the other (run/loop.py, train), so
            # what is left of the step is Ray calls, eval, checkpoints and logging.
            other = step - gen - train - (0.0 if math.isnan(sync) else sync) - sum(handoff)
            row = {
                "generate": gen,
                "model.generate": math.nan,
                "train": train,
                "weight sync": sync,
                "memory hand-off": sum(handoff) if handoff else math.nan,
                "step": step,
                "other": other,
                "response tokens": length,
                "generated tokens/s (over model.generate)": math.nan,
            }
        row["generated tokens/s"] = samples * row["response tokens"] / gen if gen else math.nan
        for k, v in row.items():
            out.setdefault(k, []).append(float(v))
    return out


def _median(values: list[float]) -> float:
    """Median over the measured rollouts (the first is warm-up), NaNs left out."""
    kept = [v for v in values[1:] if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def _keys_with_prefix(side: Side, prefixes: tuple[str, ...]) -> list[str]:
    return sorted({k for r in side.rollouts for k in r if k.startswith(prefixes)})


# --- report ------------------------------------------------------------------------------------


def _render_report(args: argparse.Namespace, build: dict, sides: list[Side], *, command: str) -> str:
    samples = args.batch_size * args.n_samples
    series = {s.key: _stage_series(s, samples) for s in sides}
    med = {s.key: {k: _median(v) for k, v in series[s.key].items()} for s in sides}
    rate = {s.key: samples / med[s.key].get("step", math.nan) if s.rollouts else math.nan for s in sides}
    shape = build["shape"]
    lines = [
        "# GRPO loop on GPU: rlkube vs TRL GRPOTrainer, Qwen3-0.6B-shaped model"
        + (" (TINY SHAPE: plumbing check)" if args.tiny_shape else ""),
        "",
        (
            f"Random-init Qwen3 ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"intermediate {shape['intermediate_size']}, {shape['num_attention_heads']} heads / "
            f"{shape['num_key_value_heads']} KV heads of {shape['head_dim']}, vocabulary {shape['vocab_size']:,}, tied "
            f"embeddings; {build['params']:,} parameters), bf16 checkpoint, word-level tokenizer. Each rollout: "
            f"{args.batch_size} prompts of {args.prompt_len} tokens x {args.n_samples} samples = {samples} samples, "
            f"up to {args.max_response_len} new tokens each, temperature 1.0, exact-match reward, lr {args.lr:g}, one "
            f"optimizer step. {args.rollouts} rollouts per side; medians over rollouts 1-{args.rollouts - 1} "
            "(rollout 0 is warm-up). Device: " + build["device"] + "."
        ),
        "",
        "## Per-stage medians (seconds per rollout unless named otherwise)",
        "",
        "| | " + " | ".join(s.title for s in sides) + " |",
        "|---|" + "---|" * len(sides),
        "| status | " + " | ".join(_status_cell(s) for s in sides) + " |",
    ]
    rows = [
        ("generate", "generate (rlkube perf/rollout_time; TRL _generate_and_score_completions)", 2),
        ("model.generate", "of which model.generate (TRL's transformers.generate timer)", 2),
        ("train", "train (rlkube perf/actor_train_time; TRL step - generate)", 2),
        ("weight sync", "weight sync (perf/update_weights_time)", 2),
        ("memory hand-off", "memory hand-off (sum of perf/*handoff*, *offload*, *onload*, *release*, *resume* keys, when reported)", 2),
        ("other", "other (rlkube step - generate - train - sync - hand-off; the last rollout's checkpoint lands here)", 2),
        ("step", "**step**", 2),
    ]
    for key, label, digits in rows:
        lines.append(f"| {label} | " + " | ".join(_fmt(med[s.key].get(key), digits) for s in sides) + " |")
    lines.append("| **samples/s** (samples / median step) | " + " | ".join(f"**{_fmt(rate[s.key], 2)}**" if s.rollouts else "-" for s in sides) + " |")
    lines.append("| generated tokens/s (over generate) | " + " | ".join(_fmt(med[s.key].get("generated tokens/s"), 0) for s in sides) + " |")
    lines.append(
        "| generated tokens/s (over model.generate alone) | "
        + " | ".join(_fmt(med[s.key].get("generated tokens/s (over model.generate)"), 0) for s in sides)
        + " |"
    )
    lines.append("| mean response tokens | " + " | ".join(_fmt(med[s.key].get("response tokens"), 1) for s in sides) + " |")
    trl = next((s for s in sides if s.key == "trl" and s.status == "ok"), None)
    lines.append(
        "| samples/s ratio rlkube / TRL | "
        + " | ".join(
            _fmt(rate[s.key] / rate["trl"], 2) + "x" if trl and s.key != "trl" and s.status == "ok" else "-"
            for s in sides
        )
        + " |"
    )
    lines.append("| process wall s (start-up, all rollouts, shutdown) | " + " | ".join(_fmt(s.wall_s, 1) for s in sides) + " |")

    lines += _all_keys_table(sides, "Every perf/* key of metrics.jsonl (rlkube), median", ("perf/",), only=RLKUBE_SIDES)
    lines += _all_keys_table(sides, "TRL's own timers (seconds summed per step) and timing keys, median", ("timer/", "log/step_time"), only=("trl",))
    lines += ["", "## Step seconds of every rollout (rollout 0 = warm-up)", ""]
    for s in sides:
        if s.rollouts:
            steps = series[s.key]["step"]
            lines.append(f"- {s.title}: " + ", ".join(_fmt(v, 2) for v in steps))
    failed = [s for s in sides if s.status == "failed"]
    for s in failed:
        lines += ["", f"## {s.title} failed: {s.error}", "", f"Log: `{s.log_path}`; its last lines:", "", "```", s.log_tail.rstrip(), "```"]
    lines += [
        "",
        "## How each number is measured",
        "",
        *[f"- {line}" for line in _method_notes(args)],
        *[f"- {s.title}: {s.note}" for s in sides if s.note],
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in _machine(build, args.revision)],
        "",
        "## Command",
        "",
        "```",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)


def _all_keys_table(sides: list[Side], title: str, prefixes: tuple[str, ...], *, only: tuple[str, ...]) -> list[str]:
    chosen = [s for s in sides if s.key in only and s.rollouts]
    keys = sorted({k for s in chosen for k in _keys_with_prefix(s, prefixes)})
    if not keys:
        return []
    lines = ["", f"## {title}", "", "| key | " + " | ".join(s.title for s in chosen) + " |", "|---|" + "---|" * len(chosen)]
    for key in keys:
        cells = [_fmt(_median([float(r.get(key, math.nan)) for r in s.rollouts]), 3) for s in chosen]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return lines


def _method_notes(args: argparse.Namespace) -> list[str]:
    return [
        "rlkube: `python -m rlkube_runtime.cli run` (= `rlkube run`) on a generated RLJob (builtin engine, "
        "model.dtype bfloat16, training.updateWeightsInterval 1, no periodic checkpoints); every number is a "
        "key of the run's metrics.jsonl as the driver defines it at the measured revision. The driver "
        "always writes a checkpoint after the last rollout, inside that rollout's perf/step_time.",
        "TRL: GRPOTrainer with use_vllm=False (transformers generate, padded batch of all samples at once), "
        f"generation_batch_size {args.batch_size * args.n_samples}, num_generations {args.n_samples}, "
        f"per_device_train_batch_size {args.trl_micro_batch} with gradient accumulation to one optimizer step per "
        f"generation, max_steps {args.rollouts}, beta 0 (no reference model), loss_type grpo, scale_rewards group, "
        "AdamW (wd 0.1, betas 0.9/0.98, eps 1e-8), grad clip 1.0, constant lr, no saving, report_to none. "
        "Step = time between on_step_end callbacks after a cuda synchronize; generate = wall time of "
        "_generate_and_score_completions ended by a synchronize; train = step - generate; model.generate = TRL's "
        "own profiling timer. TRL timers around work that does not synchronize (compute_loss, "
        "_get_per_token_logps_and_entropies) measure kernel launch, not GPU time.",
        "samples/s = samples per rollout / median step seconds. Generated tokens/s = samples x mean response "
        "tokens / median generate seconds (rlkube: perf/rollout_time includes the reward and the HTTP round trips; "
        "TRL: generate includes decoding and the reward).",
        "The reward (exact match against a one-word label) is 0 for practically every sample, so advantages are 0; "
        "both sides still run every forward, backward and optimizer step. A random model practically never "
        "samples EOS: responses run to the length limit (see mean response tokens).",
        "Each side runs alone in its own process tree, one after the other; nothing else was started on the GPUs.",
    ]


def _status_cell(side: Side) -> str:
    if side.status == "ok":
        return "ok" + (f" ({len(side.rollouts)} rollouts)" if side.rollouts else "")
    if side.status == "skipped":
        return f"skipped: {side.note}"
    return f"{side.status.upper()}: {side.error}"


def _one_line(side: Side) -> str:
    if side.status == "skipped":
        return side.note
    step = _median([float(r.get("perf/step_time", r.get("step_s", math.nan))) for r in side.rollouts])
    text = f"{len(side.rollouts)} rollouts, median step {_fmt(step, 2)}s, wall {_fmt(side.wall_s, 1)}s"
    return text + (f"; {side.error}; log {side.log_path}" if side.error else "")


def _machine(build: dict, revision: str | None = None) -> list[tuple[str, str]]:
    versions = []
    for dist in ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "ray"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} (not installed)")
    names = build["gpu_names"]
    gpus = f"{build['gpu_count']} x {names[0]}" if names and len(set(names)) == 1 else (", ".join(names) or "none")
    return [
        ("rlkube", _revision(revision)),
        ("GPUs (torch)", gpus),
        ("CPU", _cpu_name()),
        ("cores usable", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())),
        ("python", platform.python_version()),
        ("packages", ", ".join(versions)),
    ]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _revision(given: str | None) -> str:
    if given:
        return given
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "runtime"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision (no git checkout where this ran)"
    return f"commit {head}" + (f" plus {len(dirty)} uncommitted files under runtime/" if dirty else "")


# --- helpers -----------------------------------------------------------------------------------


def _child_env(gpus: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "runtime"), str(REPO / "operator"), env.get("PYTHONPATH", "")) if p
    )
    return env


def _run_child(cmd: list[str], log_path: Path, *, timeout: float, env: dict | None = None) -> tuple[int, float, str]:
    """`timed_subprocess` with per-rollout progress echoed, and this report's error text.
    Returns (exit code, wall seconds, error)."""
    rc, wall = timed_subprocess(cmd, log_path, timeout=timeout, env=env, echo=_PROGRESS)
    error = ""
    if rc == 124:
        error = f"timed out after {timeout:.0f}s (--timeout)"
    elif rc != 0:
        cause = _cause_line(log_path.read_text(encoding="utf-8", errors="replace"))
        error = f"exit {rc}" + (f": {cause[:200]}" if cause else "")
    return rc, wall, error


_PROGRESS = re.compile(r"^(rollout \d+/\d+|trl step \d+/\d+)")  # rlkube's MetricsLogger line; the TRL worker's


def _cause_line(text: str) -> str:
    """The line that best says why a child failed: rlkube's one-line cause, else the last error line."""
    lines = [l.strip() for l in text.splitlines() if l.strip() and not _SIGNAL_NOISE.search(l)]
    for pattern in (r"^rlkube run: ", r"(Error|Exception)\b"):
        hits = [l for l in lines if re.search(pattern, l)]
        if hits:
            return hits[-1]
    return lines[-1] if lines else ""


def _finish(side: Side, rc: int, error: str, *, expected: int) -> None:
    """ok when every rollout was measured; a bad exit after the last one is noted, not fatal."""
    complete = len(side.rollouts) >= expected
    if complete and rc == 0:
        side.status = "ok"
    elif complete:
        side.status = "ok"
        side.note += f"; the process ended badly after its last rollout ({error})"
    else:
        side.status = "failed"
        side.error = error or f"exit {rc}, {len(side.rollouts)} of {expected} rollouts measured"
    if side.status != "ok" or rc != 0:
        side.log_tail = _tail(Path(side.log_path))


# Ray's stack dump when a timed-out run is sent SIGTERM: noise in a log tail.
_SIGNAL_NOISE = re.compile(r"SIGTERM received|logging\.cc:\d+:\s+(PC: )?@|^\s*(PC: )?@\s+0x")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join([l for l in text.splitlines() if not _SIGNAL_NOISE.search(l)][-lines:])


def _write_json(path: Path, command: str, args: argparse.Namespace, build: dict, sides: list[Side]) -> None:
    record = {
        "args": {k: v for k, v in vars(args).items() if k not in ("build_worker", "trl_worker")},
        "build": build,
        "machine": dict(_machine(build, args.revision)),
        "sides": [asdict(s) for s in sides],
    }
    write_results("", record, command, out=None, json_path=path)


def _load_merged(paths: list[str]) -> list[Side]:
    sides: dict[str, Side] = {}
    for path in paths:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        for s in record["sides"]:
            side = Side(**s)
            side.note += f"; measured by an earlier invocation: `{record['command']}` ({path})"
            sides[side.key] = side
    return list(sides.values())


def _fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())

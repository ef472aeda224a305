"""Seconds per rollout and samples/s of rlkube's train loop beside TRL's GRPOTrainer, on CPU.

Both sides get the same tiny checkpoint (built once, here), the same prompts and exact-match
reward, the same group size, lengths, learning rate and optimizer settings, and take one
optimizer step per rollout. They run in the same invocation, one after the other, each in its
own process so each pays its own start-up:

  1. rlkube: `rlkube run <generated RLJob> --output-dir ...`; per-rollout seconds are
     `perf/step_time` from metrics.jsonl (generate + reward + train + weight sync).
  2. TRL: GRPOTrainer (transformers generation, no vLLM) in a child process of this script;
     per-rollout seconds are the time between consecutive `on_step_end` callbacks (generate +
     reward + train; there is no weight sync, the policy generates itself).

The first rollout of each is warm-up and left out of the per-rollout figures; the total wall
time includes it and the start-up. Usage (from the repository root):

    python benchmarks/train_loop_vs_trl.py --rollouts 10 --out benchmarks/results/train_loop_cpu.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_settings import grpo_settings  # noqa: E402  (the TRL settings both TRL benchmarks share)
from _harness import command_line, loadavg, read_jsonl, step_timer, timed_generation, timed_subprocess, write_results  # noqa: E402

TASK = "digit-successor"
LAST_K = 3  # rollouts averaged for the "reward at the end" column


@dataclass
class HalfResult:
    """One side of the comparison, as read back from its own logs."""

    name: str
    ok: bool
    wall_s: float
    step_s: list[float] = field(default_factory=list)  # one per rollout, warm-up included
    generate_s: list[float] = field(default_factory=list)  # generation + reward part of each rollout
    train_s: list[float] = field(default_factory=list)  # optimizer-step part of each rollout
    sync_s: list[float] = field(default_factory=list)  # weight push to the engines (rlkube only)
    reward: list[float] = field(default_factory=list)  # mean exact-match reward of each rollout
    response_len: list[float] = field(default_factory=list)  # mean response tokens of each rollout
    error: str = ""
    log_path: str = ""
    note: str = ""  # how it used the cores
    load: str = ""  # 1-minute load average before -> after this side ran


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.trl_worker:
        return _trl_worker(Path(args.trl_worker))
    _check_args(args)
    command = command_line(__file__)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlkube-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = _build_checkpoint(workdir / "tiny-model", seed=args.seed)
    print(f"tiny checkpoint: {checkpoint}", flush=True)

    load_before = loadavg()
    results = []
    shape = f"{args.rollouts} rollouts of {args.batch_size} x {args.n_samples}"
    if args.only in (None, "rlkube"):
        print(f"--- rlkube: {shape} ---", flush=True)
        results.append(_run_rlkube(args, checkpoint, workdir))
    if args.only in (None, "trl"):
        for threads in args.trl_threads:
            print(f"--- TRL ({threads or 'default'} torch threads): {shape} ---", flush=True)
            results.append(_run_trl(args, checkpoint, workdir, threads=threads))
    load_after = loadavg()

    report = _render_report(args, results, command=command, load_before=load_before, load_after=load_after)
    print(report)
    if args.out:
        write_results(report, {}, command, out=args.out, json_path=None)
        print(f"wrote {args.out}")
    return 0 if all(r.ok for r in results) else 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=10, help="rollouts (= optimizer steps) per side. Default 10.")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per rollout. Default 16 (local-tiny).")
    p.add_argument("--n-samples", type=int, default=8, help="samples per prompt (GRPO group size). Default 8.")
    p.add_argument("--max-response-len", type=int, default=4, help="max new tokens per sample. Default 4.")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of both sides. Default 1e-3 (local-tiny).")
    p.add_argument("--seed", type=int, default=1234, help="seed of the checkpoint and of both trainers. Default 1234.")
    p.add_argument("--out", default=None, help="write the Markdown report here as well as printing it.")
    p.add_argument("--workdir", default=None, help="checkpoint, job file, logs (default: a new temp directory).")
    p.add_argument("--only", choices=("rlkube", "trl"), default=None, help="run one side only (for debugging).")
    p.add_argument(
        "--trl-threads",
        type=lambda text: [int(t) for t in text.split(",")],
        default=[1, 0],
        help="torch thread counts to run TRL with, one TRL run each, 0 = torch's default (one per core). "
        "Default 1,0: 1 matches rlkube, whose trainer and engine run 1 thread each.",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds each side may take. Default 3600.")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: the TRL child process
    return p.parse_args(argv)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("rollouts", "batch_size", "max_response_len"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.n_samples < 2:
        sys.exit(f"--n-samples must be >= 2 (GRPO needs a group to compare against), got {args.n_samples}")
    if args.rollouts < 2:
        sys.exit(f"--rollouts must be >= 2 (the first one is warm-up and not counted), got {args.rollouts}")


def _build_checkpoint(out: Path, *, seed: int) -> Path:
    """The project's tiny Llama + character tokenizer over the task's alphabet; both sides load it."""
    from rlkube_runtime.tiny.model import build_tiny_checkpoint
    from rlkube_runtime.tiny.task import get_task

    if not (out / "config.json").exists():
        build_tiny_checkpoint(out, alphabet=get_task(TASK).alphabet, seed=seed)
    return out.resolve()


# --- rlkube -------------------------------------------------------------------------------------


def _rljob(args: argparse.Namespace, checkpoint: Path) -> dict:
    """local-tiny.yaml with the benchmark's numbers and the shared checkpoint instead of `preset: tiny`."""
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "bench-train-loop"},
        "spec": {
            "model": {"hfCheckpoint": str(checkpoint), "dtype": "float32"},
            "data": {"promptData": f"builtin:{TASK}"},
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
                "numRollout": args.rollouts,
                "globalBatchSize": args.batch_size * args.n_samples,  # one optimizer step per rollout
                "optimizer": {"lr": args.lr},
                "seed": args.seed,
            },
            # No periodic checkpoints (TRL saves none either); the driver still writes one after the
            # last rollout, which lands in that rollout's step time.
            "resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 1}},
        },
    }


def _run_rlkube(args: argparse.Namespace, checkpoint: Path, workdir: Path) -> HalfResult:
    import yaml

    job_path = workdir / "bench-rljob.yaml"
    job_path.write_text(yaml.safe_dump(_rljob(args, checkpoint), sort_keys=False), encoding="utf-8")
    out = workdir / "rlkube-run"
    shutil.rmtree(out, ignore_errors=True)
    exe = shutil.which("rlkube")
    cmd = ([exe] if exe else [sys.executable, "-m", "rlkube_runtime.cli"]) + [
        "run", str(job_path), "--output-dir", str(out), "--no-resume",
    ]
    log_path = workdir / "rlkube.log"
    rc, wall, error, load = _run_side(cmd, log_path, timeout=args.timeout)

    result = HalfResult("rlkube", ok=False, wall_s=wall, log_path=str(log_path), load=load)
    # driver.py: on CPU the trainer actor runs 1 torch thread; the engine actor runs beside it.
    result.note = "Ray local mode: trainer actor (1 torch thread) + built-in engine (1 thread) behind sglang-router"
    rows = read_jsonl(out / "metrics.jsonl")
    rows = sorted((r for r in rows if r.get("rollout", -1) >= 0), key=lambda r: r["rollout"])
    for r in rows:
        result.step_s.append(float(r["perf/step_time"]))
        result.generate_s.append(float(r.get("perf/rollout_time", math.nan)))
        result.train_s.append(float(r.get("perf/actor_train_time", math.nan)))
        result.sync_s.append(float(r.get("perf/update_weights_time", math.nan)))
        result.reward.append(float(r.get("rollout/raw_reward", math.nan)))
        result.response_len.append(float(r.get("rollout/response_len/mean", math.nan)))
    # Every rollout logged is a complete measurement even if the process then exits badly; say so.
    result.ok = len(rows) == args.rollouts
    if not result.ok:
        result.error = error or f"exit {rc}, {len(rows)} of {args.rollouts} rollouts in metrics.jsonl"
    elif rc != 0:
        result.note += f"; after logging its last rollout the process ended badly ({error}), see {log_path}"
    return result


# --- TRL ----------------------------------------------------------------------------------------


def _run_trl(args: argparse.Namespace, checkpoint: Path, workdir: Path, *, threads: int) -> HalfResult:
    tag = f"trl-threads{threads or 'default'}"
    config = {
        "checkpoint": str(checkpoint),
        "out_dir": str(workdir / tag),
        "result": str(workdir / f"{tag}-result.json"),
        "rollouts": args.rollouts,
        "batch_size": args.batch_size,
        "n_samples": args.n_samples,
        "max_response_len": args.max_response_len,
        "lr": args.lr,
        "seed": args.seed,
        "threads": threads,
    }
    config_path = workdir / f"{tag}-config.json"
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    Path(config["result"]).unlink(missing_ok=True)
    log_path = workdir / f"{tag}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(config_path)]
    rc, wall, error, load = _run_side(cmd, log_path, timeout=args.timeout)

    name = f"TRL GRPOTrainer, {threads} torch thread{'s' if threads > 1 else ''}" if threads else "TRL GRPOTrainer"
    result = HalfResult(name, ok=False, wall_s=wall, log_path=str(log_path), load=load)
    if Path(config["result"]).exists():
        data = json.loads(Path(config["result"]).read_text(encoding="utf-8"))
        for key in ("step_s", "generate_s", "train_s", "reward", "response_len"):
            setattr(result, key, data[key])
        n = data["torch_threads"]
        if not threads:
            result.name = f"TRL GRPOTrainer, {n} torch threads (torch default)"
        result.note = f"one process, {n} torch thread{'s' if n > 1 else ''}"
    result.ok = rc == 0 and len(result.step_s) == args.rollouts
    if not result.ok:
        result.error = error or f"exit {rc}, {len(result.step_s)} of {args.rollouts} steps timed"
    return result


def _trl_worker(config_path: Path) -> int:
    """The TRL side, in its own process: same checkpoint, prompts, reward and optimizer settings."""
    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    import torch
    from datasets import Dataset
    from rlkube_runtime.rewards.text_rules import exact_reward
    from rlkube_runtime.tiny.task import get_task
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    batch, n = cfg["batch_size"], cfg["n_samples"]
    # RepeatSampler drops an incomplete last batch of prompts, and the task has only 10 prompts:
    # repeat them so every step gets `batch` distinct-position prompts (rlkube's source wraps the
    # same way, epoch after epoch).
    records = get_task(TASK).make_records()
    rows = [records[i % len(records)] for i in range(batch * cfg["rollouts"])]
    dataset = Dataset.from_list(rows)

    def exact_match(completions: list[str], label: list[str], **_) -> list[float]:
        return [exact_reward(c, l) for c, l in zip(completions, label)]

    timings = {"step_s": [], "generate_s": [], "train_s": [], "reward": [], "response_len": []}

    def on_step(step: float) -> None:  # generate + reward + train + logging
        timings["step_s"].append(step)
        timings["train_s"].append(step - timings["generate_s"][-1])

    def on_log(logs: dict) -> None:
        if "reward" in logs:
            timings["reward"].append(float(logs["reward"]))
            timings["response_len"].append(float(logs.get("completions/mean_length", math.nan)))

    TimedGRPOTrainer = timed_generation(GRPOTrainer, timings["generate_s"].append)

    # Settings mirror rlkube's defaults (spec/training.py, spec/algorithm.py) where TRL differs.
    config = GRPOConfig(
        output_dir=cfg["out_dir"],
        use_cpu=True,
        bf16=False,  # GRPOConfig defaults to bf16; rlkube's tiny job trains in float32
        per_device_train_batch_size=batch * n,  # one optimizer step per rollout (globalBatchSize = batch x n)
        gradient_accumulation_steps=1,
        **grpo_settings(rollouts=cfg["rollouts"], lr=cfg["lr"], n_samples=n,
                        max_response_len=cfg["max_response_len"], seed=cfg["seed"]),
    )
    model = AutoModelForCausalLM.from_pretrained(cfg["checkpoint"], dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(cfg["checkpoint"])
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_timer(on_step, on_log)],
    )
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    timings["torch_threads"] = torch.get_num_threads()
    trainer.train()
    Path(cfg["result"]).write_text(json.dumps(timings), encoding="utf-8")
    return 0


# --- helpers ------------------------------------------------------------------------------------


def _run_side(cmd: list[str], log_path: Path, *, timeout: float) -> tuple[int, float, str, str]:
    """`timed_subprocess` plus what this report shows of a side: (exit code, wall seconds, last log
    line of a failure, 1-minute load average before -> after; each side ran under its own load)."""
    load_before = loadavg().split()[0]
    rc, wall = timed_subprocess(cmd, log_path, timeout=timeout)
    load = f"{load_before} -> {loadavg().split()[0]}"
    error = ""
    if rc != 0:
        lines = [l.strip() for l in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if l.strip()]
        error = f"exit {rc}" + (" (timed out)" if rc == 124 else "") + (f": {lines[-1][:200]}" if lines else "")
        print(f"  failed, {error}; full log: {log_path}", flush=True)
    return rc, wall, error, load


def _machine() -> list[tuple[str, str]]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = []
    for dist in ("torch", "transformers", "trl", "ray", "accelerate", "datasets"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} (not installed)")
    return [
        ("rlkube", _revision()),
        ("CPU", cpu),
        ("cores usable (nproc)", str(usable)),
        ("python", platform.python_version()),
        ("packages", ", ".join(versions)),
    ]


def _revision() -> str:
    """The commit measured, and whether the runtime had uncommitted changes at the time."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "runtime"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision (not a git checkout)"
    return f"commit {head}" + (f" plus {len(dirty)} uncommitted files under runtime/" if dirty else "")


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _stats(values: list[float]) -> tuple[float, float]:
    """(median, mean) of the rollouts after the warm-up one."""
    timed = [v for v in values[1:] if not math.isnan(v)]
    if not timed:
        return math.nan, math.nan
    return statistics.median(timed), statistics.fmean(timed)


def _render_report(args, results: list[HalfResult], *, command: str, load_before: str, load_after: str) -> str:
    samples = args.batch_size * args.n_samples
    k = min(LAST_K, args.rollouts)
    lines = [
        "# Train loop on CPU: rlkube vs TRL GRPOTrainer",
        "",
        (
            f"Tiny model (`rlkube_runtime.tiny`, {TASK}), {args.rollouts} rollouts of {args.batch_size} prompts x "
            f"{args.n_samples} samples = {samples} samples, max response {args.max_response_len} tokens, "
            f"lr {args.lr:g}, one optimizer step per rollout, seed {args.seed}. Per-rollout figures leave out "
            "rollout 0 (warm-up); samples/s = samples per rollout / mean seconds per rollout."
        ),
        "",
        (
            "| | s/rollout median | s/rollout mean | samples/s | generate s (median) | train s (median) "
            f"| weight sync s (median) | mean response tokens | reward rollout 0 | reward last {k} "
            "| total wall s | of which outside rollouts (start-up, shutdown) | load (1 min) before -> after |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        med, mean = _stats(r.step_s)
        gen, _ = _stats(r.generate_s)
        train, _ = _stats(r.train_s)
        sync, _ = _stats(r.sync_s)
        outside = r.wall_s - sum(r.step_s) if r.step_s else math.nan
        resp, _ = _stats(r.response_len)
        rate = samples / mean if mean and not math.isnan(mean) else math.nan
        first = r.reward[0] if r.reward else math.nan
        last = statistics.fmean(r.reward[-k:]) if len(r.reward) >= k else math.nan
        status = "" if r.ok else f" (FAILED: {r.error})"
        lines.append(
            f"| {r.name}{status} | {_fmt(med)} | {_fmt(mean)} | {_fmt(rate, 1)} | {_fmt(gen)} | {_fmt(train)} "
            f"| {_fmt(sync) if r.sync_s else '-'} | {_fmt(resp, 1)} | {_fmt(first)} | {_fmt(last)} "
            f"| {_fmt(r.wall_s, 1)} | {_fmt(outside, 1)} | {r.load} |"
        )
    ours = [r for r in results if r.name == "rlkube" and r.ok]
    if ours:
        lines.append("")
        _, a = _stats(ours[0].step_s)
        for other in (r for r in results if r.name != "rlkube" and r.ok):
            _, b = _stats(other.step_s)
            verdict = "faster" if a < b else "slower"
            lines.append(
                f"- By mean seconds per rollout, rlkube is {max(a, b) / min(a, b):.2f}x {verdict} than {other.name} "
                "on this run."
            )
    lines += [
        "",
        (
            "Per-rollout seconds: rlkube = `perf/step_time` from metrics.jsonl (generate + reward, train, weight "
            "sync to the engine; the last rollout also writes the final checkpoint); TRL = time between "
            "consecutive `on_step_end` callbacks (generate + reward, train, logging; no weight sync needed). "
            "Generate = rlkube `perf/rollout_time` / TRL `_generate_and_score_completions`; train = rlkube "
            "`perf/actor_train_time` / TRL step minus generate; weight sync = rlkube `perf/update_weights_time`. "
            "Outside rollouts = total wall time minus the sum of all per-rollout seconds: process start, imports, "
            "Ray and actor start-up, model load, shutdown."
        ),
        "",
        (
            "At this size a rollout is little work (a 2-layer, 64-wide model; answers of at most "
            f"{args.max_response_len} tokens), so fixed per-rollout costs weigh most: for rlkube, generation over "
            "HTTP through sglang-router to a separate engine, the weight push to that engine and the Ray calls "
            "between actors; TRL generates and trains in one process with no weight copy."
        ),
        "",
        *[f"- {r.name}: {r.note}" for r in results if r.note],
        "",
        "## Machine",
        "",
        *[f"- {k_}: {v}" for k_, v in _machine()],
        (
            f"- load average (1, 5, 15 min) before: {load_before}; after: {load_after}. The machine is shared "
            "with other work (a load above the core count means runnable processes waited for a core), so these "
            "numbers are noisy and each row ran under its own load (see the table); compare rows of one run, "
            "not runs with each other."
        ),
        "",
        "## Command",
        "",
        "```",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

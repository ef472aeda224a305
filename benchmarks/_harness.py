"""What every benchmark here does the same way: the command line it records, timing, and the
result files (a Markdown report and the figures as JSON)."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def display_path(path: Path) -> str:
    """`path` relative to the working directory when it is below it (what a reader re-runs)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that produced a result: `python <script> <args>`, quoted."""
    return "python " + " ".join(shlex.quote(a) for a in [display_path(Path(script)), *(argv if argv is not None else sys.argv[1:])])


def median_time(fn, repeat: int = 3, *, device: str):
    """(median seconds of `repeat` calls, the last call's value), synchronising a GPU around each."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeat):
        sync()
        started = time.monotonic()
        value = fn()
        sync()
        times.append(time.monotonic() - started)
    return statistics.median(times), value


def time_train_passes(backend, batch, flops: float, device: str) -> tuple[dict, dict[str, float]]:
    """The trainer measurement of every trainer benchmark: median seconds of the forward pass
    (old log-probs), forward+backward without a step, the optimizer step on those gradients and a
    whole train_step; model TFLOP/s and tokens/s of forward+backward (`flops` of it). Returns
    the figures and forward+backward's own metrics."""
    fwd_s, old = median_time(lambda: backend.log_probs(batch).log_probs, device=device)
    batch = batch.with_fields(old_log_probs=old)
    fwd_bwd_s, metrics = median_time(lambda: backend.accumulate_gradients(batch), device=device)
    optimizer_s, _ = median_time(backend.optimizer.step, device=device)  # on the gradients just accumulated
    step_s, _ = median_time(lambda: backend.train_step(batch), device=device)
    tokens = int(sum(batch.total_lengths))
    return {"samples": len(batch), "tokens": tokens, "forward_s": fwd_s, "forward_backward_s": fwd_bwd_s,
            "train_step_s": step_s, "optimizer_s": optimizer_s,
            "model_tflop_per_fwd_bwd": flops / 1e12, "tflops": flops / fwd_bwd_s / 1e12,
            "tokens_per_s": tokens / fwd_bwd_s}, metrics


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file (none when it does not exist); a line cut short by a killed
    run, or an empty one, is passed over."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def loadavg() -> str:
    """The machine's 1/5/15-minute load, for the result's notes (a busy machine measures slower)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def write_results(report: str, figures: dict[str, Any], command: str, *, out: str | None, json_path: str | None) -> None:
    """The report to `out` (Markdown) and the figures, with the command, to `json_path`, where given."""
    if out:
        Path(out).write_text(report, encoding="utf-8")
    if json_path:
        Path(json_path).write_text(json.dumps({"command": command, **figures}, indent=1, default=str), encoding="utf-8")

"""What every benchmark here does the same way: the command line it records, timing (of calls,
blocks, child processes and TRL's steps), and the result files (a Markdown report and the figures
as JSON)."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rlkube_runtime import proc


def display_path(path: Path) -> str:
    """`path` relative to the working directory when it is below it (what a reader re-runs)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that produced a result: `python <script> <args>`, quoted."""
    return "python " + " ".join(shlex.quote(a) for a in [display_path(Path(script)), *(argv if argv is not None else sys.argv[1:])])


def call_times(fn, repeat: int = 3, *, device: str) -> tuple[list[float], Any]:
    """(seconds of each of `repeat` calls, the last call's value), synchronising a GPU around each
    so that a call's queued kernels count in its own time."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeat):
        sync()
        with Stopwatch() as watch:
            value = fn()
            sync()
        times.append(watch.seconds)
    return times, value


def median_time(fn, repeat: int = 3, *, device: str):
    """(median seconds of `repeat` calls, the last call's value), as `call_times` times them."""
    times, value = call_times(fn, repeat, device=device)
    return statistics.median(times), value


class Stopwatch:
    """Wall seconds of a `with` block, for what is not one plain call (an awaited gather, a part
    that may raise): inside the block `.seconds` is the time so far, after it the block's time."""

    def __enter__(self) -> "Stopwatch":
        self.started = time.monotonic()
        self.ended: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.monotonic()

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started


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


def write_results(report: str, figures: dict[str, Any], command: str, *, out: str | Path | None,
                  json_path: str | Path | None) -> None:
    """The report to `out` (Markdown) and the figures, with the command, to `json_path`, where
    given; their folders are made first (a fresh machine or --out directory may lack them)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report, encoding="utf-8")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"command": command, **figures}, indent=1, default=str), encoding="utf-8")


# --- child processes ---------------------------------------------------------------------------


def timed_subprocess(cmd: list[str], log_path: Path, *, timeout: float, env: dict | None = None,
                     echo: re.Pattern | None = None) -> tuple[int, float]:
    """Run `cmd` to its end in its own process group (`rlkube_runtime.proc`, as the runtime starts
    its servers), the command line and then its stdout+stderr in `log_path`. Past `timeout`
    seconds the whole group is stopped, so a run's own children (Ray's raylet and workers, engine
    servers) do not outlive it, and the exit code is 124. Log lines
    matching `echo` are printed as they appear, with the seconds so far, to show a long run's
    progress. Returns (exit code, wall seconds)."""
    with Stopwatch() as watch, open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        child = proc.start(cmd, stdout=log, env=env)
        rc = None
        with open(log_path, encoding="utf-8", errors="replace") as follow:
            while rc is None:
                try:
                    rc = child.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    if watch.seconds > timeout:
                        proc.stop_group(child)
                        rc = 124
                if echo is not None:
                    for line in follow.readlines():
                        if echo.match(line):
                            print(f"  [{watch.seconds:5.0f}s] {line.rstrip()}", flush=True)
    return rc, watch.seconds


# --- TRL's GRPOTrainer (imported only where it is called: the TRL child processes) -------------


def step_timer(on_step: Callable[[float], None], on_log: Callable[[dict], None] | None = None, *,
               sync: Callable[[], None] = lambda: None):
    """A transformers TrainerCallback that calls `on_step(seconds)` at each optimizer step's end
    with the seconds since the previous one (the first: since training began), and `on_log(logs)`
    with each non-empty log. `sync` runs before each reading so a GPU's queued work counts in the
    step that queued it."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **_):
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            sync()
            now = time.perf_counter()
            step, self.last = now - self.last, now
            on_step(step)

        def on_log(self, args, state, control, logs=None, **_):
            if on_log is not None and logs:
                on_log(logs)

    return StepTimer()


def timed_generation(trainer_cls: type, on_generate: Callable[[float], None], *,
                     sync: Callable[[], None] = lambda: None) -> type:
    """`trainer_cls` (TRL's GRPOTrainer) with `on_generate(seconds)` called after each
    `_generate_and_score_completions` (generation, decoding, reward, advantages), the stage TRL
    does not time as a whole; `sync` runs before the reading."""

    class TimedGRPOTrainer(trainer_cls):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                sync()
                on_generate(time.perf_counter() - start)

    return TimedGRPOTrainer

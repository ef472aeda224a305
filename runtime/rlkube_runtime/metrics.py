"""Where each rollout's numbers go: a JSONL log, TensorBoard when installed, Prometheus, the
experiment trackers spec.observability configures (W&B, MLflow: `tracking.py`), and a progress line.

The loop produces one flat dict per rollout with slime's metric names (`rollout/raw_reward`,
`train/pg_clipfrac`, `perf/step_time`, ...) so slime users find familiar keys in the JSONL log
and TensorBoard. Prometheus gets a fixed, documented catalogue of `rlkube_` series instead of
one series per key, so dashboards and alerts can rely on the names.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from rlkube_runtime.serving.engine_metrics import EngineMetricsScrape

if TYPE_CHECKING:
    from rlkube_runtime.tracking import Tracker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromSeries:
    name: str
    help: str


# slime key -> Prometheus gauge. Every gauge carries the label `rljob` (the RLJob's name).
PROMETHEUS_GAUGES: dict[str, PromSeries] = {
    "rollout/raw_reward": PromSeries("rlkube_reward_mean", "Mean raw reward of the last rollout's samples."),
    "rollout/raw_reward_std": PromSeries("rlkube_reward_std", "Standard deviation of the last rollout's raw rewards."),
    "rollout/response_len/mean": PromSeries("rlkube_response_length_mean", "Mean response length in tokens."),
    "rollout/response_len/max": PromSeries("rlkube_response_length_max", "Longest response in tokens."),
    "rollout/truncated_ratio": PromSeries("rlkube_truncated_ratio", "Fraction of responses cut at maxResponseLen."),
    "train/loss": PromSeries("rlkube_train_loss", "Total training loss of the last rollout (mean over steps)."),
    "train/pg_loss": PromSeries("rlkube_pg_loss", "Policy-gradient loss."),
    "train/pg_clipfrac": PromSeries("rlkube_pg_clipfrac", "Fraction of tokens whose ratio was clipped."),
    "train/ppo_kl": PromSeries("rlkube_ppo_kl", "Mean (old - new) log-prob: drift within a rollout."),
    "train/kl_loss": PromSeries("rlkube_kl", "KL to the reference model (the configured estimator)."),
    "train/entropy_loss": PromSeries("rlkube_entropy", "Mean per-token entropy of the policy."),
    "train/grad_norm": PromSeries("rlkube_grad_norm", "Gradient norm before clipping."),
    "train/train_rollout_logprob_abs_diff": PromSeries(
        "rlkube_train_rollout_logprob_abs_diff",
        "Mean |engine logprob - trainer logprob| on the same tokens: how far rollout and training disagree.",
    ),
    "rollout/staleness/mean": PromSeries(
        "rlkube_sample_staleness_mean",
        "Mean weight syncs between the policy that generated a sample and the one trained on it (async mode: up to "
        "asyncBufferSize).",
    ),
    "rollout/staleness/max": PromSeries("rlkube_sample_staleness_max", "Largest sample staleness of the last rollout."),
    "train/tis": PromSeries(
        "rlkube_tis_ratio_mean", "Mean importance ratio trainer/engine before truncation (algorithm.tis enabled)."
    ),
    "train/tis_clipfrac": PromSeries("rlkube_tis_clipfrac", "Fraction of tokens whose importance ratio TIS truncated."),
    "train/opsm_clipfrac": PromSeries(
        "rlkube_opsm_masked_share", "Share of the policy loss off-policy sequence masking dropped (algorithm.opsm)."
    ),
    "train/moe_load_balancing_loss": PromSeries(
        "rlkube_moe_load_balancing_loss", "MoE load-balancing (aux) loss before its coefficient, mean over layers "
        "(megatronArgs moe-aux-loss-coeff; 1.0 is balanced)."),
    "train/moe_z_loss": PromSeries(
        "rlkube_moe_z_loss", "MoE router z-loss before its coefficient, mean over layers (megatronArgs moe-z-loss-coeff)."),
    "train/routing_replay_mismatch": PromSeries(
        "rlkube_routing_replay_mismatch", "Share of token-layer routes where the trainer's MoE routers would have "
        "picked other experts than the engine did (training.routingReplay replays the engine's)."),
    "perf/rollout_time": PromSeries("rlkube_rollout_seconds", "Seconds spent generating the last rollout."),
    "perf/actor_train_time": PromSeries("rlkube_train_seconds", "Seconds spent training on the last rollout."),
    "perf/update_weights_time": PromSeries("rlkube_weight_sync_seconds", "Seconds of the last weight sync."),
    "perf/update_weights_bytes": PromSeries(
        "rlkube_weight_sync_bytes", "Tensor bytes the last weight sync moved to each engine (rollout dtype, tied tensors once)."
    ),
    "perf/step_time": PromSeries("rlkube_step_seconds", "Seconds of the last whole rollout step."),
    "perf/tokens_per_sec": PromSeries("rlkube_rollout_tokens_per_second", "Generated tokens per second."),
    "progress/rollout": PromSeries("rlkube_rollout_id", "Id of the last finished rollout."),
    "progress/num_rollout": PromSeries("rlkube_num_rollout", "Rollouts the job will run in all."),
    "checkpoint/last_time": PromSeries(
        "rlkube_last_checkpoint_timestamp_seconds", "Unix time of the last complete checkpoint (age = now - this)."
    ),
}

ENGINE_RESTARTS = PromSeries("rlkube_engine_restarts_total", "Rollout engines restarted after a failure.")

# `eval/<dataset>/<key>` -> a gauge labelled `rljob` and `dataset`.
EVAL_GAUGES: dict[str, PromSeries] = {
    "reward": PromSeries("rlkube_eval_reward", "Mean reward of the last evaluation, per eval dataset."),
    "accuracy": PromSeries("rlkube_eval_accuracy", "Share of correct (reward > 0) eval responses, per eval dataset."),
    "response_len/mean": PromSeries("rlkube_eval_response_length_mean", "Mean eval response length in tokens, per dataset."),
}
# `eval/<dataset>/pass_at_<k>` -> one gauge labelled `rljob`, `dataset` and `k`.
EVAL_PASS_AT_K = PromSeries("rlkube_eval_pass_at_k", "Unbiased pass@k of the last evaluation, per eval dataset and k.")
_EVAL_KEY = re.compile(r"^eval/(?P<dataset>[^/]+)/(?:pass_at_(?P<k>\d+)|(?P<key>.+))$")


class PrometheusExporter:
    """Serves the catalogue above on its own registry (several runs in one process stay apart)."""

    def __init__(self, job_name: str, port: int | None):
        self.registry = CollectorRegistry()
        self.job_name = job_name
        self._gauges = {
            key: Gauge(series.name, series.help, ["rljob"], registry=self.registry)
            for key, series in PROMETHEUS_GAUGES.items()
        }
        self._engine_restarts = Counter(
            ENGINE_RESTARTS.name.removesuffix("_total"), ENGINE_RESTARTS.help, ["rljob"], registry=self.registry
        )
        self._engine_restarts.labels(job_name)  # the series exists (at 0) before the first restart
        self._eval = {
            key: Gauge(series.name, series.help, ["rljob", "dataset"], registry=self.registry)
            for key, series in EVAL_GAUGES.items()
        }
        self._pass_at_k = Gauge(EVAL_PASS_AT_K.name, EVAL_PASS_AT_K.help, ["rljob", "dataset", "k"], registry=self.registry)
        self.engines = EngineMetricsScrape(job_name)
        self.registry.register(self.engines)
        self.port = None
        if port is not None:
            server = serve_text_format(port, self.registry)
            self.port = server.server_port
            self.engines.start()

    def record(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            gauge = self._gauges.get(key)
            if gauge is not None and _is_number(value):
                gauge.labels(self.job_name).set(float(value))
            elif _is_number(value) and (match := _EVAL_KEY.match(key)):
                if match["k"] is not None:
                    self._pass_at_k.labels(self.job_name, match["dataset"], match["k"]).set(float(value))
                elif match["key"] in self._eval:
                    self._eval[match["key"]].labels(self.job_name, match["dataset"]).set(float(value))

    def count_engine_restarts(self, n: int = 1) -> None:
        self._engine_restarts.labels(self.job_name).inc(n)

    def watch_engines(self, urls: Sequence[str]) -> None:
        """Pass these engines' own series through (serving/engine_metrics.py)."""
        self.engines.watch(urls)

    def close(self) -> None:
        self.engines.stop()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - one line per scrape is noise
        pass


def serve_text_format(port: int, registry: CollectorRegistry) -> ThreadingWSGIServer:
    """/metrics on `port` in Prometheus' text format whatever the scraper asks for. prometheus_client
    0.26 writes OpenMetrics sample names with ':' as '_' (its HELP and TYPE lines keep them), so a
    Prometheus that negotiates OpenMetrics stored SGLang's `sglang:num_running_reqs` as
    `sglang_num_running_reqs`; the text format keeps the names as they are."""
    app = make_wsgi_app(registry)

    def text_only(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": "text/plain"}, start_response)

    server = make_server("0.0.0.0", port, text_only, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="rlkube-metrics-http", daemon=True).start()
    return server


class MetricsLogger:
    """One call per rollout fans the dict out to every sink; a broken sink never stops training."""

    def __init__(
        self,
        job_name: str,
        log_dir: str | os.PathLike,
        *,
        prometheus_port: int | None = None,
        tensorboard: bool = True,
        trackers: Sequence[Tracker] = (),
        stream=sys.stdout,
    ):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self.prometheus = PrometheusExporter(job_name, prometheus_port)
        self._stream = stream
        self._tb = _open_tensorboard(self.log_dir / "tensorboard") if tensorboard else None
        self._trackers = list(trackers)
        self._started = time.monotonic()

    def log(self, rollout_id: int, metrics: Mapping[str, Any]) -> None:
        record = {"rollout": rollout_id, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        self.prometheus.record(metrics)
        if self._tb is not None:
            for key, value in metrics.items():
                if _is_number(value):
                    self._tb.scalar(key, float(value), rollout_id)
            self._tb.flush()
        for tracker in self._trackers:
            try:
                tracker.log(rollout_id, metrics)
            except Exception as err:  # noqa: BLE001 - a tracker's outage must not stop training
                log.warning("%s could not log rollout %d: %s", type(tracker).__name__, rollout_id, err)
        self._stream.write(format_progress_line(rollout_id, metrics, time.monotonic() - self._started) + "\n")
        self._stream.flush()

    def close(self) -> None:
        self.prometheus.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001 - closing must not hide how the run ended
                log.warning("%s did not close cleanly: %s", type(tracker).__name__, err)


def format_progress_line(rollout_id: int, metrics: Mapping[str, Any], elapsed: float) -> str:
    """`rollout 12/60 | reward 0.625 | kl 0.0012 | len 1.0 | step 1.84s | 00:23` — one line a rollout."""
    total = metrics.get("progress/num_rollout")
    head = f"rollout {rollout_id + 1}/{int(total)}" if _is_number(total) else f"rollout {rollout_id + 1}"
    parts = [head]
    for label, key, fmt in (
        ("reward", "rollout/raw_reward", "{:.3f}"),
        ("eval", "eval/reward", "{:.3f}"),
        ("kl", "train/kl_loss", "{:.4f}"),
        ("len", "rollout/response_len/mean", "{:.1f}"),
        ("step", "perf/step_time", "{:.2f}s"),
    ):
        value = metrics.get(key)
        if _is_number(value):
            parts.append(f"{label} {fmt.format(float(value))}")
    minutes, seconds = divmod(int(elapsed), 60)
    parts.append(f"{minutes:02d}:{seconds:02d}")
    return " | ".join(parts)


class _TensorBoardScalars:
    """Scalars in a TensorBoard event file, written with tensorboard's own event writer: the
    records torch's SummaryWriter.add_scalar writes, without importing torch into the driver."""

    def __init__(self, path: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(path))

    def scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _open_tensorboard(path: Path) -> _TensorBoardScalars | None:
    try:
        return _TensorBoardScalars(path)
    except ImportError:  # tensorboard is optional
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

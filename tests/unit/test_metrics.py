"""Each rollout's metrics reach the JSONL log, the progress line and the Prometheus endpoint."""

import io
import json
import urllib.request

from rlkube_runtime.metrics import PROMETHEUS_GAUGES, MetricsLogger, format_progress_line


def test_a_logged_rollout_is_in_the_jsonl_log_the_progress_line_and_on_the_prometheus_endpoint(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger("demo", tmp_path, prometheus_port=0, tensorboard=False, stream=out)
    logger.log(4, {"rollout/raw_reward": 0.625, "perf/step_time": 1.5, "progress/num_rollout": 10, "train/kl_loss": 0.002})
    logger.prometheus.count_engine_restarts(2)

    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["rollout"] == 4 and record["rollout/raw_reward"] == 0.625
    assert out.getvalue().startswith("rollout 5/10 | reward 0.625 | kl 0.0020 | step 1.50s")

    body = urllib.request.urlopen(f"http://127.0.0.1:{logger.prometheus.port}/metrics", timeout=5).read().decode()
    assert 'rlkube_reward_mean{rljob="demo"} 0.625' in body
    assert 'rlkube_step_seconds{rljob="demo"} 1.5' in body
    assert 'rlkube_kl{rljob="demo"} 0.002' in body
    assert 'rlkube_engine_restarts_total{rljob="demo"} 2.0' in body
    logger.close()


def test_prometheus_names_are_unique_and_prefixed():
    names = [series.name for series in PROMETHEUS_GAUGES.values()]
    assert len(names) == len(set(names))
    assert all(name.startswith("rlkube_") for name in names)


def test_progress_line_without_a_total_or_numbers_still_reads():
    assert format_progress_line(0, {}, 65.0) == "rollout 1 | 01:05"


def test_tensorboard_gets_every_numeric_metric_at_its_rollout_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger("demo", tmp_path, prometheus_port=None, tensorboard=True, stream=io.StringIO())
    logger.log(0, {"rollout/raw_reward": 0.25, "perf/step_time": 2.0, "note": "not a number"})
    logger.log(1, {"rollout/raw_reward": 0.75, "perf/step_time": 1.0})
    logger.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"rollout/raw_reward", "perf/step_time"}
    assert [(e.step, e.value) for e in events.Scalars("rollout/raw_reward")] == [(0, 0.25), (1, 0.75)]


def test_eval_metrics_reach_prometheus_per_dataset_and_k(tmp_path):
    logger = MetricsLogger("demo", tmp_path, prometheus_port=0, tensorboard=False, stream=io.StringIO())
    logger.log(9, {
        "eval/math/reward": 0.25, "eval/math/accuracy": 0.375, "eval/math/pass_at_1": 0.375,
        "eval/math/pass_at_4": 1.0, "eval/math/response_len/mean": 4.0, "eval/code/pass_at_4": 0.5,
        "eval/reward": 0.25, "eval/math/num_prompts": 2.0,
    })
    body = urllib.request.urlopen(f"http://127.0.0.1:{logger.prometheus.port}/metrics", timeout=5).read().decode()
    # The exposition format lists labels in name order.
    assert 'rlkube_eval_reward{dataset="math",rljob="demo"} 0.25' in body
    assert 'rlkube_eval_accuracy{dataset="math",rljob="demo"} 0.375' in body
    assert 'rlkube_eval_response_length_mean{dataset="math",rljob="demo"} 4.0' in body
    assert 'rlkube_eval_pass_at_k{dataset="math",k="1",rljob="demo"} 0.375' in body
    assert 'rlkube_eval_pass_at_k{dataset="math",k="4",rljob="demo"} 1.0' in body
    assert 'rlkube_eval_pass_at_k{dataset="code",k="4",rljob="demo"} 0.5' in body
    assert "num_prompts" not in body
    logger.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_engines_own_series_pass_through_the_driver_labelled_with_job_and_engine(tmp_path):
    """One engine serving SGLang-named series (a real prometheus_client endpoint), one gone: after a
    fetch, the driver's endpoint carries the first's series with rljob and engine added, types
    kept, and says which engine answered."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    Gauge("sglang:num_running_reqs", "running", ["model_name"], registry=registry).labels("qwen").set(3)
    Counter("sglang:generation_tokens", "generated", ["model_name"], registry=registry).labels("qwen").inc(120)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    live, gone = f"127.0.0.1:{server.server_port}", f"127.0.0.1:{_closed_port()}"
    logger = MetricsLogger("demo", tmp_path, prometheus_port=0, tensorboard=False, stream=io.StringIO())
    try:
        logger.prometheus.watch_engines([f"http://{live}", f"http://{gone}"])
        logger.prometheus.engines.refresh()  # what its thread does every few seconds
        # Asked as Prometheus asks (OpenMetrics first), the names keep their colons: the text format.
        request = urllib.request.Request(f"http://127.0.0.1:{logger.prometheus.port}/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
        body = urllib.request.urlopen(request, timeout=10).read().decode()
        assert f'sglang:num_running_reqs{{engine="{live}"' in body
        families = {f.name: f for f in text_string_to_metric_families(body)}
        [running] = families["sglang:num_running_reqs"].samples
        assert running.labels == {"model_name": "qwen", "rljob": "demo", "engine": live} and running.value == 3
        assert families["sglang:generation_tokens"].type == "counter"
        assert {s.labels["engine"]: s.value for s in families["rlkube_engine_metrics_up"].samples} == {live: 1, gone: 0}

        logger.prometheus.watch_engines([])  # the engines went (the run's end): their series go too
        body = urllib.request.urlopen(f"http://127.0.0.1:{logger.prometheus.port}/metrics", timeout=10).read().decode()
        assert "sglang:" not in body
    finally:
        logger.close()
        server.shutdown()


def test_a_scrape_of_the_driver_never_waits_on_an_engine():
    """collect() serves the last fetch's answers: an engine that hangs holds up only the thread."""
    import threading
    import time

    from rlkube_runtime.serving.engine_metrics import EngineMetricsScrape

    release = threading.Event()

    def hanging_fetch(url):
        release.wait(10)
        return "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 2\n"

    scrape = EngineMetricsScrape("demo", fetch=hanging_fetch, interval_s=0.05)
    scrape.watch(["http://10.0.0.9:30000"])
    scrape.start()
    try:
        started = time.monotonic()
        assert [f.name for f in scrape.collect()] == ["rlkube_engine_metrics_up"]  # nothing fetched yet
        assert time.monotonic() - started < 1
        release.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(list(scrape.collect())) < 2:
            time.sleep(0.05)
        [running, up] = list(scrape.collect())
        assert running.samples[0].labels == {"rljob": "demo", "engine": "10.0.0.9:30000"}
        assert running.samples[0].value == 2 and up.samples[0].value == 1
    finally:
        release.set()
        scrape.stop()

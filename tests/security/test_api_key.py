"""Authenticated job traffic: the real sglang-router and the built-in engine (SGLang's HTTP protocol,
SGLang's auth rule) refuse every request without the job's API key, weight and admin endpoints
included; the runtime's clients and launcher pass it; and each job's NetworkPolicy admits only the
job's own pods (its spec evaluated here: whether a cluster enforces it is its network plugin's job).

SGLang itself (`--api-key`, sglang/srt/utils/auth.py) is checked by the launch line: the flag is on
it (tests/unit/engine), and the conformance test feeds it to SGLang's own parser."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from rlkube_operator import render
from rlkube_operator.settings import OperatorSettings
from rlkube_runtime.serving.client import EngineAdmin, EngineHTTPError, RolloutClient
from rlkube_runtime.serving.launch import start_engine
from rlkube_runtime.serving.router import RouterProcess
from rlkube_runtime.tiny.model import build_tiny_checkpoint

KEY = "job-key-5e3f"
# Generation and every weight and admin endpoint the runtime calls.
GUARDED = [
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "load_format": "direct"}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                            "world_size": 2, "group_name": "g", "backend": "gloo"}),
    ("POST", "/flush_cache", None),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("GET", "/get_weight_version", None),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
]


def call(method: str, url: str, body=None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A built-in engine and the real router, both started with the job's key, the engine registered."""
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), seed=0)
    logs = tmp_path_factory.mktemp("logs")
    engine = start_engine(model_path=str(checkpoint), log_dir=str(logs), name="keyed", seed=3,
                          engine_args={"num-threads": 1}, api_key=KEY)
    router = RouterProcess([engine.url], log_dir=str(logs), model_path=str(checkpoint), api_key=KEY).start()
    yield engine, router, logs
    router.stop()
    engine.stop()


@pytest.mark.slow
def test_the_engine_and_the_router_refuse_every_guarded_request_without_the_key(keyed):
    engine, router, _ = keyed
    for method, path, body in GUARDED:
        assert call(method, engine.url + path, body) == 401, f"engine {method} {path} without the key"
        assert call(method, engine.url + path, body, key="wrong") == 401, f"engine {method} {path}, wrong key"
    for method, path, body in [("POST", "/generate", GUARDED[0][2]), ("GET", "/workers", None),
                               ("POST", "/workers", {"url": "http://127.0.0.1:1"}), ("POST", "/flush_cache", None)]:
        assert call(method, router.url + path, body) == 401, f"router {method} {path} without the key"
    # Probes stay open, as in SGLang: a kubelet or the router's health check carries no key.
    assert call("GET", engine.url + "/health") == 200
    assert call("GET", router.url + "/health") == 200
    # So do the engine's own series, which the driver scrapes without the key (serving/engine_metrics.py).
    assert call("GET", engine.url + "/metrics") == 200


@pytest.mark.slow
def test_with_the_key_the_router_generates_through_the_engine_and_the_clients_pass_it(keyed, monkeypatch):
    engine, router, logs = keyed
    request = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    assert call("POST", router.url + "/generate", request, key=KEY) == 200  # the router passes the key on
    assert call("POST", engine.url + "/generate", request, key=KEY) == 200

    async def clients():
        async with RolloutClient(router.url, api_key=KEY) as client:
            out = await client.generate(request)
            assert out["meta_info"]["completion_tokens"] == 2
        async with EngineAdmin(engine.url, api_key=KEY) as admin:
            assert await admin.flush_cache()
            assert isinstance(await admin.get_weight_version(), str)
        async with EngineAdmin(engine.url, api_key="", max_attempts=1) as admin:  # an explicit empty key: none
            with pytest.raises(EngineHTTPError) as refused:
                await admin.get_weight_version()
            assert refused.value.status == 401

    asyncio.run(clients())
    # In a pod the key comes from RLKUBE_API_KEY (the operator's Secret), for every client made there.
    monkeypatch.setenv("RLKUBE_API_KEY", KEY)

    async def from_env():
        async with EngineAdmin(engine.url) as admin:
            return await admin.get_weight_version()

    assert isinstance(asyncio.run(from_env()), str)
    # The key never reaches a log: the launcher writes each command line with it redacted.
    for log in logs.glob("*.log"):
        assert KEY not in log.read_text(errors="replace"), log


# --- the NetworkPolicy of a job --------------------------------------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector with matchLabels only (what rlkube renders); {} selects everything."""
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admitted(policy: dict, policy_namespace: str, pod: dict, source: dict, port: int) -> bool:
    """Whether `policy` lets `source` ({namespace, labels, namespaceLabels}) reach `pod` on TCP `port`,
    by NetworkPolicy's rules: a pod it selects accepts only what one ingress rule admits; a peer
    with podSelector alone means pods of the policy's own namespace."""
    if pod["namespace"] != policy_namespace or not _selects(policy["spec"]["podSelector"], pod["labels"]):
        return True  # not selected: this policy says nothing about it
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        for peer in rule.get("from") or []:
            if "namespaceSelector" in peer:
                in_namespace = _selects(peer["namespaceSelector"], source["namespaceLabels"])
            else:
                in_namespace = source["namespace"] == policy_namespace
            if in_namespace and _selects(peer.get("podSelector") or {}, source["labels"]):
                return True
    return False


def test_a_jobs_network_policy_admits_its_own_pods_and_no_one_else():
    ref = render.JobRef("tiny", "team-a", "uid-1")
    policy = render.render_network_policy(ref, OperatorSettings())
    engine = {"namespace": "team-a", "labels": {"rlkube.io/rljob": "tiny", "rlkube.io/role": "rollout"}}

    def source(namespace, **labels):
        return {"namespace": namespace, "labels": labels, "namespaceLabels": {"kubernetes.io/metadata.name": namespace}}

    head = source("team-a", **{"rlkube.io/rljob": "tiny", "rlkube.io/role": "head"})
    for port in (30000, 6379, 8265, 9464):
        assert admitted(policy, "team-a", engine, head, port), port
    # Another job's pods, in the same namespace or another, and anything else in the cluster: no.
    strangers = [source("team-a", **{"rlkube.io/rljob": "other"}), source("team-b", **{"rlkube.io/rljob": "tiny"}),
                 source("team-a"), source("kube-system", app="debug")]
    for stranger in strangers:
        for port in (30000, 6379, 8265, 9464):
            assert not admitted(policy, "team-a", engine, stranger, port), (stranger, port)
    # Prometheus reaches the metrics port only; KubeRay's operator the Ray dashboard only.
    prometheus = source("monitoring", **{"app.kubernetes.io/name": "prometheus"})
    kuberay = source("ray-system", **{"app.kubernetes.io/name": "kuberay-operator"})
    assert admitted(policy, "team-a", engine, prometheus, 9464)
    assert not admitted(policy, "team-a", engine, prometheus, 30000)
    assert admitted(policy, "team-a", engine, kuberay, 8265)
    assert not admitted(policy, "team-a", engine, kuberay, 30000)

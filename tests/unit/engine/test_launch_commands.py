"""Command lines the launcher builds for engines and the router (no processes started here)."""

import sys

import pytest

from rlkube_runtime.serving.sglang_args import EngineNode
from rlkube_runtime.serving.launch import EngineLaunchSpec, engine_launch_spec, cli_flags, engine_command
from rlkube_runtime.serving.router import RouterProcess


def test_cli_flags_turn_a_dict_into_flags():
    args = {"tp_size": 2, "enable-torch-compile": True, "disable-radix-cache": False, "chunked_prefill_size": None,
            "worker-urls": ["a", "b"], "mem-fraction-static": 0.8}
    assert cli_flags(args) == ["--tp-size", "2", "--enable-torch-compile", "--worker-urls", "a", "b", "--mem-fraction-static", "0.8"]


def test_sglang_command_has_model_address_parallelism_seed_and_pass_through_args():
    spec = engine_launch_spec({"kind": "sglang", "model_path": "/m", "log_dir": "/l", "name": "e0", "seed": 3, "tp_size": 2,
                         "sglang_args": {"mem_fraction_static": 0.7, "enable-metrics": True, "log-requests": False}})
    command = engine_command(spec, port=30001, nccl_port=30002)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    joined = " ".join(command)
    for part in ["--model-path /m", "--host 127.0.0.1", "--port 30001", "--nccl-port 30002", "--tp-size 2",
                 "--random-seed 3", "--skip-server-warmup", "--mem-fraction-static 0.7", "--enable-metrics"]:
        assert part in joined
    assert "--log-requests" not in joined


def test_builtin_command_and_its_argument_checks():
    spec = engine_launch_spec({"model_path": "/m", "log_dir": "/l", "name": "e0", "seed": 5, "engine_args": {"max_running_requests": 8}})
    command = engine_command(spec, port=31000)
    assert command[:3] == [sys.executable, "-m", "rlkube_runtime.engine"]
    assert " ".join(command).endswith("--seed 5 --device cpu --max-running-requests 8")

    with pytest.raises(ValueError, match="chunked-prefill-size"):
        engine_command(EngineLaunchSpec(kind="builtin", model_path="/m", log_dir="/l", name="e",
                                        engine_args={"chunked-prefill-size": 4096}), 1)
    with pytest.raises(ValueError, match="tp_size=2"):
        engine_command(EngineLaunchSpec(kind="builtin", model_path="/m", log_dir="/l", name="e", tp_size=2), 1)
    with pytest.raises(ValueError, match="nnodes=2.*several nodes"):
        engine_command(EngineLaunchSpec(kind="builtin", model_path="/m", log_dir="/l", name="e",
                                        node=EngineNode(2, 1, "10.0.0.1:29600")), 1)
    with pytest.raises(ValueError, match="sglang_args"):
        engine_launch_spec({"model_path": "/m", "log_dir": "/l", "name": "e", "sglang_args": {"x": 1}})
    with pytest.raises(ValueError, match="kind"):
        engine_command(EngineLaunchSpec(kind="vllm", model_path="/m", log_dir="/l", name="e"), 1)


def test_router_command_lists_workers_ports_and_only_local_model_paths(tmp_path):
    router = RouterProcess(["http://a:1", "http://b:2"], log_dir=str(tmp_path), model_path=str(tmp_path), port=30000,
                           prometheus_port=29000, router_args={"policy": "round_robin", "disable_retries": True})
    command = " ".join(router.command())
    assert "-m rlkube_runtime.serving.router_main" in command
    for part in ["--port 30000", "--prometheus-port 29000", "--worker-urls http://a:1 http://b:2",
                 f"--model-path {tmp_path}", "--policy round_robin", "--disable-retries"]:
        assert part in command
    hub_name = RouterProcess([], log_dir=str(tmp_path), model_path="Qwen/Qwen2.5-0.5B")
    assert "--model-path" not in hub_name.command()

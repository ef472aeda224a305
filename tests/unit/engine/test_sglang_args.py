"""The SGLang launch line derived from the job (pure: no process, no SGLang installed)."""

import argparse

import pytest

from rlkube_runtime.actors.engine import EngineActor, engine_actor_options
from rlkube_runtime.serving.launch import builtin_engine_command, engine_launch_spec
from rlkube_runtime.serving.sglang_args import (
    COLOCATED_MEM_FRACTION_STATIC,
    EngineNode,
    SGLangServerConfig,
    engine_nodes,
    sglang_server_args,
)
from rlkube_runtime.spec import RLJobSpec

BASE = dict(model_path="/models/qwen", host="10.0.0.7", port=30000, nccl_port=30001, tp_size=2, seed=42, dtype="bfloat16")


def flags_of(argv: list[str]) -> list[str]:
    return [token for token in argv if token.startswith("--")]


def test_separate_engine_line_is_exactly_the_derived_flags_in_order():
    assert sglang_server_args(SGLangServerConfig(**BASE)) == [
        "--model-path", "/models/qwen", "--host", "10.0.0.7", "--port", "30000", "--nccl-port", "30001",
        "--tp-size", "2", "--random-seed", "42", "--dtype", "bfloat16", "--skip-server-warmup",
        "--enable-metrics",
    ]


def test_colocated_engine_saves_memory_and_leaves_room_for_the_trainer():
    argv = sglang_server_args(SGLangServerConfig(**BASE, colocated=True))
    assert argv[-3:] == ["--enable-memory-saver", "--mem-fraction-static", str(COLOCATED_MEM_FRACTION_STATIC)]


def test_trust_remote_code_only_when_asked():
    assert "--trust-remote-code" not in sglang_server_args(SGLangServerConfig(**BASE))
    assert "--trust-remote-code" in sglang_server_args(SGLangServerConfig(**BASE, trust_remote_code=True))


def test_the_jobs_api_key_is_on_the_line_when_there_is_one():
    assert "--api-key" not in sglang_server_args(SGLangServerConfig(**BASE))  # a local run: none
    argv = sglang_server_args(SGLangServerConfig(**BASE, api_key="k3y"))
    assert argv[argv.index("--api-key") + 1] == "k3y"


def test_the_launcher_takes_the_key_from_the_pods_environment_and_never_logs_it(monkeypatch, tmp_path):
    from rlkube_runtime.serving.auth import redacted
    from rlkube_runtime.serving.launch import engine_command
    from rlkube_runtime.serving.router import RouterProcess

    monkeypatch.setenv("RLKUBE_API_KEY", "k3y")
    for kind in ("builtin", "sglang"):
        spec = engine_launch_spec({"kind": kind, "model_path": "/m", "log_dir": str(tmp_path), "name": "e"})
        command = engine_command(spec, 30000, 30001)
        assert command[command.index("--api-key") + 1] == "k3y", kind
        assert "k3y" not in redacted(command)
    router = RouterProcess(log_dir=str(tmp_path))
    assert router.command()[router.command().index("--api-key") + 1] == "k3y"
    monkeypatch.delenv("RLKUBE_API_KEY")
    assert "--api-key" not in RouterProcess(log_dir=str(tmp_path)).command()


def test_a_key_that_starts_with_a_dash_reaches_the_engine_and_the_router_whole(monkeypatch, tmp_path):
    """secrets.token_urlsafe starts with '-' once in 64: as a separate word argparse takes it
    for an option ("--api-key: expected one argument") and the router never starts."""
    from rlkube_runtime.engine.__main__ import parse_args
    from rlkube_runtime.serving.launch import engine_command
    from rlkube_runtime.serving.router import RouterProcess

    monkeypatch.setenv("RLKUBE_API_KEY", "-Xk3y")
    spec = engine_launch_spec({"model_path": "/m", "log_dir": str(tmp_path), "name": "e"})
    command = engine_command(spec, 30000, 30001)
    assert parse_args(command[3:]).api_key == "-Xk3y"
    router = RouterProcess(log_dir=str(tmp_path)).command()
    assert "--api-key=-Xk3y" in router
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    assert parser.parse_known_args(router[3:])[0].api_key == "-Xk3y"


def test_user_args_come_last_replace_derived_flags_and_no_flag_appears_twice():
    user = {"mem_fraction_static": 0.55, "skip-server-warmup": False, "enable-metrics": True, "dtype": "float16"}
    argv = sglang_server_args(SGLangServerConfig(**BASE, colocated=True, user_args=user))
    flags = flags_of(argv)
    assert len(flags) == len(set(flags))
    assert "--skip-server-warmup" not in flags  # false drops the derived bare flag
    # The user's flags close the line, in the user's order, with the user's values.
    assert argv[-5:] == ["--mem-fraction-static", "0.55", "--enable-metrics", "--dtype", "float16"]
    assert "--enable-memory-saver" in flags


@pytest.mark.parametrize(("key", "governed_by"), [
    ("port", "chosen by rlkube"),
    ("model_path", "spec.model.hfCheckpoint"),
    ("tensor-parallel-size", "spec.rollout.gpusPerEngine"),  # an alias of --tp-size is caught too
    ("nccl-init-addr", "first node"),
    ("base-gpu-id", "CUDA_VISIBLE_DEVICES"),
    ("trust-remote-code", "spec.model.trustRemoteCode"),  # said once, for trainer and engines alike
    ("api_key", "the job's API key"),
])
def test_flags_rlkube_wires_itself_are_refused_from_sglang_args_naming_the_field(key, governed_by):
    with pytest.raises(ValueError, match=rf"spec\.rollout\.sglangArgs\.{key}: .*{governed_by}"):
        sglang_server_args(SGLangServerConfig(**BASE, user_args={key: 1}))


def test_one_flag_spelled_twice_in_sglang_args_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        sglang_server_args(SGLangServerConfig(**BASE, user_args={"mem-fraction-static": 0.5, "mem_fraction_static": 0.6}))


def test_a_dtype_sglang_does_not_take_is_refused_naming_it():
    with pytest.raises(ValueError, match="'fp8'.*bfloat16"):
        sglang_server_args(SGLangServerConfig(**{**BASE, "dtype": "fp8"}))


def test_base_gpu_id_only_when_given():
    assert "--base-gpu-id" not in sglang_server_args(SGLangServerConfig(**BASE))
    assert sglang_server_args(SGLangServerConfig(**BASE, base_gpu_id=4))[-2:] == ["--base-gpu-id", "4"]


def test_an_engine_of_one_node_has_no_multi_node_flags():
    assert engine_nodes(1, "") == [EngineNode()]
    flags = flags_of(sglang_server_args(SGLangServerConfig(**BASE)))
    assert not {"--nnodes", "--node-rank", "--dist-init-addr"} & set(flags)


def test_an_engine_over_two_pods_runs_one_server_per_node_meeting_at_node_zero():
    nodes = engine_nodes(2, "10.0.1.1:29600")
    assert nodes == [EngineNode(2, 0, "10.0.1.1:29600"), EngineNode(2, 1, "10.0.1.1:29600")]
    second = sglang_server_args(SGLangServerConfig(**{**BASE, "tp_size": 16}, node=nodes[1]))
    assert second[-6:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.1.1:29600"]


def test_a_node_without_its_meeting_address_or_an_uneven_split_is_refused():
    with pytest.raises(ValueError, match="dist_init_addr"):
        sglang_server_args(SGLangServerConfig(**BASE, node=EngineNode(nnodes=2, node_rank=1)))
    with pytest.raises(ValueError, match=r"gpusPerEngine\(3\) must split evenly over 2 nodes"):
        sglang_server_args(SGLangServerConfig(**{**BASE, "tp_size": 3}, node=EngineNode(2, 1, "10.0.1.1:29600")))
    with pytest.raises(ValueError, match="nodesPerEngine"):
        engine_nodes(0, "")


def _spec(model: dict | None = None, **rollout) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"hfCheckpoint": "/models/qwen", "dtype": "bfloat16", **(model or {})},
        "data": {"promptData": "/data/p.jsonl"},
        "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2, "gpusPerEngine": 2, **rollout},
        "reward": {"type": "exact"},
        "training": {"seed": 100, "globalBatchSize": 8, "numRollout": 1},
        "resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 4}},
    })


def test_engine_j_gets_seed_plus_j_the_placement_and_the_spec_fields():
    spec = _spec(sglangArgs={"enable-metrics": True}, model={"trustRemoteCode": True})
    options = [engine_actor_options(spec, j, model_path="/models/qwen", log_dir="/l", device="cuda") for j in range(2)]
    assert [o["seed"] for o in options] == [100, 101]
    assert options[0]["colocated"] is True and options[0]["trust_remote_code"] is True
    assert options[0]["dtype"] == "bfloat16" and options[0]["gpus_per_engine"] == 2
    launch = engine_launch_spec(EngineActor(**options[1], host="10.0.0.2").launch_options())
    assert (launch.seed, launch.host, launch.colocated, launch.trust_remote_code) == (101, "10.0.0.2", True, True)
    assert launch.engine_args == {"enable-metrics": True}


def test_an_engine_actor_outside_ray_listens_on_loopback():
    options = engine_actor_options(_spec(), 0, model_path="/m", log_dir="/l", device="cuda")
    assert EngineActor(**options).launch_options()["host"] == "127.0.0.1"


def test_the_builtin_engine_gets_trust_remote_code_only_when_asked():
    asked = engine_launch_spec({"model_path": "/m", "log_dir": "/l", "name": "e", "trust_remote_code": True})
    assert "--trust-remote-code" in builtin_engine_command(asked, 30000)
    plain = engine_launch_spec({"model_path": "/m", "log_dir": "/l", "name": "e"})
    assert "--trust-remote-code" not in builtin_engine_command(plain, 30000)


def test_the_builtin_engine_line_carries_the_dtype_once():
    launch = engine_launch_spec({"model_path": "/m", "log_dir": "/l", "name": "e", "dtype": "bfloat16",
                                 "engine_args": {"num-threads": 1}})
    command = builtin_engine_command(launch, 30000)
    assert command.count("--dtype") == 1 and command[-4:] == ["--dtype", "bfloat16", "--num-threads", "1"]


def test_gpus_given_by_id_reach_the_engine_process():
    options = engine_actor_options(_spec(), 0, model_path="/m", log_dir="/l", device="cuda", gpu_ids=(2, 3))
    launch = engine_launch_spec(EngineActor(**options).launch_options())
    assert launch.gpu_ids == (2, 3)


def _fp8_spec(engine: str) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"preset": "tiny", "rolloutDtype": "fp8"},
        "data": {"promptData": "builtin:digit-successor"},
        "rollout": {"engine": engine, "batchSize": 4, "nSamplesPerPrompt": 2},
        "reward": {"type": "exact"},
        "algorithm": {"tis": {"enabled": True}},
        "training": {"globalBatchSize": 8, "numRollout": 1},
    })


@pytest.mark.parametrize("engine", ["builtin", "sglang"])
def test_an_fp8_rollouts_engines_load_the_block_fp8_copy_of_the_model(engine):
    """Both engines read fp8 from the copy's config.json (SGLang builds its fp8 layers from it), so
    no --quantization is passed; bf16 (the default) loads the model itself."""
    options = engine_actor_options(_fp8_spec(engine), 0, model_path="/m", log_dir="/l", device="cuda",
                                   fp8_model_dir="/out/rollout-model-fp8")
    assert options["quantization"] == "fp8" and options["fp8_model_dir"] == "/out/rollout-model-fp8"
    launch = engine_launch_spec(EngineActor(**options).launch_options())
    assert launch.model_path == "/out/rollout-model-fp8"
    assert "quantization" not in launch.engine_args
    plain = engine_actor_options(_spec(gpusPerEngine=1, engine=engine), 0, model_path="/m", log_dir="/l", device="cpu",
                                 fp8_model_dir="/out/rollout-model-fp8")
    assert plain["quantization"] is None and plain["fp8_model_dir"] is None
    assert engine_launch_spec(EngineActor(**plain).launch_options()).model_path == "/m"
    with pytest.raises(ValueError, match="fp8_model_dir"):
        engine_actor_options(_fp8_spec(engine), 0, model_path="/m", log_dir="/l", device="cuda")


def test_an_fp8_engine_writes_the_copy_before_it_starts(tmp_path, monkeypatch):
    from rlkube_runtime.fp8_checkpoint import is_fp8_checkpoint
    from rlkube_runtime.serving import launch
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "model", seed=0)
    started = []

    class _Process:
        url, pid = "http://engine", 1

        def stop(self):
            pass

    def start_engine(**options):
        assert is_fp8_checkpoint(options["model_path"])  # whole before the engine reads it
        started.append(options["model_path"])
        return _Process()

    monkeypatch.setattr(launch, "start_engine", start_engine)
    options = engine_actor_options(_fp8_spec("sglang"), 0, model_path=str(model), log_dir=str(tmp_path / "logs"),
                                   device="cuda", fp8_model_dir=str(tmp_path / "out" / "rollout-model-fp8"))
    actor = EngineActor(**{**options, "host": "127.0.0.1", "gpu_ids": (0,)})
    assert actor.start() == "http://engine"
    assert actor.restart() == "http://engine"  # the copy made from the same model is kept
    assert started == [str(tmp_path / "out" / "rollout-model-fp8")] * 2

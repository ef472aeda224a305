"""The run's pure pieces: when the plan says a sync, save or eval is due; the weight-sync plan
a topology gives; how the ranks' sync reports merge; and the order of the colocated hand-off."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkube_runtime.run.handoff import Handoff
from rlkube_runtime.run.plan import RunPlan
from rlkube_runtime.spec import load_rljob
from rlkube_runtime.spec.eval import EvalDatasetSpec
from rlkube_runtime.topology import Topology
from rlkube_runtime.weight_sync import SyncPlan, SyncReport, plan_sync

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


def _plan(tmp_path, mode="train", train_ids=(), **spec_changes) -> RunPlan:
    job = load_rljob(LOCAL_TINY)
    spec = job.spec
    for section, values in spec_changes.items():
        spec = spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})
    job = job.model_copy(update={"spec": spec})
    return RunPlan(job, tmp_path, tmp_path / "checkpoints", (tmp_path / "checkpoints",), "unused", mode=mode,
                   train_rollout_ids=tuple(train_ids))


def test_syncs_are_due_every_interval_and_after_the_last_rollout(tmp_path):
    plan = _plan(tmp_path, training={"num_rollout": 7, "update_weights_interval": 3})
    # (k + 1) % 3 == 0 for k = 2, 5; and k = 6 is the last rollout.
    assert [k for k in range(7) if plan.sync_due(k)] == [2, 5, 6]


def test_checkpoints_are_due_every_interval_and_after_the_last_rollout(tmp_path):
    plan = _plan(tmp_path, training={"num_rollout": 5}, checkpoint={"interval": 2})
    assert [k for k in range(5) if plan.save_due(k)] == [1, 3, 4]
    assert [k for k in range(5) if _plan(tmp_path, training={"num_rollout": 5}, checkpoint={"interval": 0}).save_due(k)] == [4]


def test_eval_is_due_before_training_and_every_interval_only_with_datasets(tmp_path):
    without = _plan(tmp_path, eval={"interval": 2})
    assert not any(without.eval_due(k) for k in range(-1, 6))
    with_data = _plan(tmp_path, eval={"interval": 2,
                                      "datasets": [EvalDatasetSpec(name="d", path="builtin:digit-successor")]})
    assert [k for k in range(-1, 6) if with_data.eval_due(k)] == [-1, 1, 3, 5]


def test_train_only_counts_progress_up_to_the_last_dump(tmp_path):
    assert _plan(tmp_path, mode="train-only", train_ids=(0, 1, 4)).num_rollout == 5
    assert _plan(tmp_path, training={"num_rollout": 9}).num_rollout == 9


def _topology(*, placement, device, trainer_bundles, engine_bundles, gpus_per_engine=1) -> Topology:
    return Topology(device=device, placement=placement, trainer_world_size=len(trainer_bundles),
                    num_engines=len(engine_bundles), gpus_per_engine=gpus_per_engine, bundles=(),
                    trainer_bundles=tuple(trainer_bundles), engine_bundles=tuple(engine_bundles),
                    engine_node_bundles=tuple((b,) for b in engine_bundles), trainer_actor_resources={}, engine_actor_resources={})


def test_colocated_engines_are_pushed_by_the_rank_on_their_gpu_through_ipc_handles(tmp_path):
    spec = _plan(tmp_path, model={"dtype": "bfloat16"}).spec
    topo = _topology(placement="colocated", device="cuda", trainer_bundles=[0, 1, 2, 3], engine_bundles=[2, 0])
    plan = plan_sync(spec, topo, disk_dir="/w")
    assert (plan.transport, plan.pusher_of_engine, plan.pushing_ranks) == ("tensor", (2, 0), frozenset({0, 2}))
    assert (plan.dtype, plan.engine_ranks, plan.disk_dir) == ("bfloat16", 1, "/w")
    assert plan.bucket_bytes == spec.training.update_weight_buffer_mb * 2**20
    assert plan.by_pusher([0, 1]) == {2: [0], 0: [1]}


def test_a_colocated_engine_over_several_gpus_takes_a_payload_from_each_rank_on_them(tmp_path):
    spec = _plan(tmp_path, model={"dtype": "bfloat16"}, rollout={"gpus_per_engine": 2}).spec
    topo = _topology(placement="colocated", device="cuda", trainer_bundles=[0, 1, 2, 3], engine_bundles=[0, 2],
                     gpus_per_engine=2)
    plan = plan_sync(spec, topo, disk_dir="/w")
    assert (plan.transport, plan.pusher_of_engine, plan.engine_ranks) == ("tensor", (0, 2), 2)
    assert plan.handle_ranks == ((0, 1), (2, 3))
    # Every rank on an engine's GPUs pushes (so each stages the whole model first); a lost
    # engine's replacement is pushed by its own ranks alone.
    assert plan.pushing_ranks == frozenset({0, 1, 2, 3})
    assert plan.by_pusher([0, 1]) == {0: [0], 1: [0], 2: [1], 3: [1]}
    assert plan.by_pusher([1]) == {2: [1], 3: [1]}
    assert [plan.handle_group_of(r) for r in range(4)] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    # Where each engine takes one rank's payload there is no group.
    single = plan_sync(_plan(tmp_path).spec, _topology(placement="colocated", device="cuda", trainer_bundles=[0, 1],
                                                        engine_bundles=[0, 1]))
    assert (single.handle_ranks, single.handle_group_of(1)) == ((), None)


def test_separate_engines_are_pushed_by_rank_0_over_a_broadcast_in_float32_on_a_cpu(tmp_path):
    spec = _plan(tmp_path, resources={"placement": "separate"}).spec
    topo = _topology(placement="separate", device="cpu", trainer_bundles=[0], engine_bundles=[1, 2])
    plan = plan_sync(spec, topo)
    assert (plan.transport, plan.pusher_of_engine, plan.dtype) == ("distributed", (0, 0), "float32")


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_lora_job_syncs_its_adapter_alone_from_rank_0_wherever_the_engines_are(tmp_path, placement):
    from rlkube_runtime.spec.lora import LoraSpec

    spec = _plan(tmp_path, resources={"placement": placement}, training={"lora": LoraSpec(rank=8)}).spec
    topo = _topology(placement=placement, device="cuda", trainer_bundles=[0, 1],
                     engine_bundles=[0, 1] if placement == "colocated" else [2, 3])
    plan = plan_sync(spec, topo, disk_dir=str(tmp_path / "weights"))
    assert (plan.transport, plan.pusher_of_engine, plan.disk_dir) == ("adapter", (0, 0), str(tmp_path / "weights"))


def test_an_impossible_transport_is_refused_naming_the_field(tmp_path):
    spec = _plan(tmp_path, training={"update_weights_transport": "tensor"}).spec
    topo = _topology(placement="separate", device="cuda", trainer_bundles=[0], engine_bundles=[1])
    with pytest.raises(ValueError, match=r"spec\.training\.updateWeightsTransport: 'tensor'"):
        plan_sync(spec, topo)


def test_the_ranks_reports_merge_into_the_slowest_push_and_every_failure():
    merged = SyncReport.merged("distributed", "7", [
        SyncReport("distributed", "7", bytes_per_engine=100, seconds=0.5, requests_per_engine=2),
        SyncReport("distributed", "7", bytes_per_engine=100, seconds=0.75, requests_per_engine=2,
                   failed={"http://e:2": "ConnectionError"}),
    ])
    assert merged == SyncReport("distributed", "7", bytes_per_engine=100, seconds=0.75, requests_per_engine=2,
                                failed={"http://e:2": "ConnectionError"})
    assert merged.metrics() == {"perf/update_weights_push_time": 0.75, "perf/update_weights_bytes": 100.0,
                                "perf/update_weights_wait_time": 0.0}
    assert SyncPlan().pushing_ranks == frozenset()


class _Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def release(self, *args, **kwargs):
        self.calls.append((self.name, "release", args, kwargs))

    def restore(self, *args, **kwargs):
        self.calls.append((self.name, "restore", args, kwargs))


def test_colocated_turns_follow_slimes_order_weights_then_sync_then_kv_cache():
    calls: list = []
    handoff = Handoff(_Recorder("trainers", calls), _Recorder("engines", calls), takes_turns=True)
    handoff.start()
    assert "perf/handoff_to_train_time" in handoff.to_train()
    handoff.to_sync(syncing=True)
    assert "perf/handoff_to_rollout_time" in handoff.to_rollout(synced=True)
    assert [(who, what, args, kwargs) for who, what, args, kwargs in calls] == [
        ("trainers", "release", (), {}),  # start: the engines generate first
        ("engines", "release", (), {}),
        ("trainers", "restore", (), {}),
        ("trainers", "release", (), {"keep_weights": True}),  # the sync reads the weights on the device
        ("engines", "restore", (["weights"],), {}),
        ("trainers", "release", (), {}),
        ("engines", "restore", (["kv_cache", "cuda_graph"],), {}),
    ]


def test_separate_placement_takes_no_turns():
    calls: list = []
    handoff = Handoff(_Recorder("trainers", calls), _Recorder("engines", calls), takes_turns=False)
    handoff.start()
    assert handoff.to_train() == {} and handoff.to_rollout(synced=True) == {}
    handoff.to_sync(syncing=True)
    assert calls == []


def test_an_fp8_rollout_plans_quantized_syncs_and_bf16_none(tmp_path):
    topo = _topology(placement="colocated", device="cpu", trainer_bundles=[0], engine_bundles=[0])
    assert plan_sync(_plan(tmp_path).spec, topo).quantization is None
    fp8 = plan_sync(_plan(tmp_path, model={"rollout_dtype": "fp8"}).spec, topo)
    assert (fp8.quantization, fp8.dtype) == ("fp8", "float32")  # the rest still in the engine dtype


def test_an_engine_over_two_nodes_joins_the_weight_group_with_every_rank_of_both_nodes():
    """The sync's group for an engine has 1 + gpusPerEngine ranks: SGLang's tensor-parallel ranks
    on node 1 join it just as node 0's do (each SGLang rank receives the broadcast)."""
    from rlkube_runtime.topology import plan_topology

    spec = load_rljob(LOCAL_TINY.with_name("qwen3-235b-multi-node-engines.yaml")).spec
    res = spec.resources
    topology = plan_topology(placement="separate", trainer_nodes=res.trainer.nodes, trainer_gpus_per_node=8,
                             rollout_gpus=res.rollout.gpus, gpus_per_engine=spec.rollout.gpus_per_engine,
                             visible_gpus=64, cpus=256, nodes_per_engine=spec.rollout.nodes_per_engine)
    plan = plan_sync(spec, topology)
    assert (plan.transport, plan.engine_ranks, plan.pusher_of_engine) == ("distributed", 16, (0, 0))
    assert topology.engine_node_bundles == ((32, 33), (34, 35))

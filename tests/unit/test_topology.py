import pytest

from rlkube_runtime.topology import plan_topology


def plan(**kw):
    base = dict(placement="separate", trainer_nodes=1, trainer_gpus_per_node=4, rollout_gpus=4,
                gpus_per_engine=2, visible_gpus=8, cpus=32)
    return plan_topology(**{**base, **kw})


def test_separate_placement_gives_engines_their_own_bundles():
    t = plan()
    assert t.trainer_world_size == 4 and t.num_engines == 2
    assert t.trainer_bundles == (0, 1, 2, 3) and t.engine_bundles == (4, 5)
    assert [b["GPU"] for b in t.bundles] == [1, 1, 1, 1, 2, 2]


def test_colocated_engines_share_the_trainer_bundles():
    t = plan(placement="colocated", trainer_gpus_per_node=8, rollout_gpus=0)
    assert len(t.bundles) == 8 and t.num_engines == 4
    assert t.engine_bundles == (0, 2, 4, 6)
    assert t.trainer_actor_resources["GPU"] + t.engine_actor_resources["GPU"] <= 1


def test_without_gpus_one_trainer_and_one_engine_share_the_cpus():
    t = plan(visible_gpus=0, placement="colocated")
    assert (t.device, t.trainer_world_size, t.num_engines) == ("cpu", 1, 1)
    assert t.engine_bundles == t.trainer_bundles


@pytest.mark.parametrize("kw, text", [
    ({"visible_gpus": 6}, "needs 8 GPUs"),
    ({"rollout_gpus": 3}, "gpusPerEngine"),
])
def test_impossible_layouts_name_the_field(kw, text):
    with pytest.raises(ValueError, match=text):
        plan(**kw)


def test_in_a_kuberay_cluster_bundles_ask_for_the_pod_group_resources():
    t = plan(pod_resources=True)
    assert all(b.get("rlkube_trainer") == 1 for b in t.bundles[:4])
    assert all(b.get("rlkube_rollout") == 2 and "rlkube_trainer" not in b for b in t.bundles[4:])
    colocated = plan(placement="colocated", pod_resources=True)
    assert all(b.get("rlkube_trainer") == 1 for b in colocated.bundles)
    assert all("rlkube_trainer" not in b for b in plan().bundles)


def test_a_colocated_engine_over_two_gpus_gets_both_of_its_ranks_gpus():
    from rlkube_runtime.topology import colocated_engine_gpus

    ranks = [("10.0.0.1", [0]), ("10.0.0.1", [1]), ("10.0.0.1", [2]), ("10.0.0.1", [3])]
    assert colocated_engine_gpus(ranks, 2) == [(0, 1), (2, 3)]
    assert colocated_engine_gpus(ranks, 1) == [(0,), (1,), (2,), (3,)]


def test_a_colocated_engine_cannot_span_nodes():
    import pytest

    from rlkube_runtime.topology import colocated_engine_gpus

    with pytest.raises(ValueError, match=r"spec\.rollout\.gpusPerEngine: colocated engine 0"):
        colocated_engine_gpus([("10.0.0.1", [0]), ("10.0.0.2", [0])], 2)


def test_cpu_pods_get_one_rank_per_trainer_pod_and_the_specs_engines():
    t = plan(visible_gpus=0, pod_resources=True, trainer_nodes=2, rollout_gpus=2, gpus_per_engine=1)
    assert (t.device, t.trainer_world_size, t.num_engines) == ("cpu", 2, 2)
    assert [b.get("rlkube_trainer") for b in t.bundles[:2]] == [1, 1]
    assert [b.get("rlkube_rollout") for b in t.bundles[2:]] == [1, 1]
    assert t.engine_bundles == (2, 3)
    colocated = plan(visible_gpus=0, pod_resources=True, trainer_nodes=2, placement="colocated")
    assert colocated.engine_bundles == colocated.trainer_bundles == (0, 1)


def test_an_engine_over_two_nodes_gets_a_bundle_per_node_of_its_share_of_gpus():
    t = plan(rollout_gpus=32, gpus_per_engine=16, nodes_per_engine=2, visible_gpus=36, pod_resources=True)
    assert t.num_engines == 2 and t.gpus_per_engine == 16
    assert t.engine_node_bundles == ((4, 5), (6, 7)) and t.engine_bundles == (4, 6)
    assert [b["GPU"] for b in t.bundles] == [1, 1, 1, 1, 8, 8, 8, 8]
    assert all(b["rlkube_rollout"] == 8 for b in t.bundles[4:])
    assert t.engine_actor_resources["GPU"] == 8


def test_single_node_engines_have_one_bundle_each():
    assert plan().engine_node_bundles == ((4,), (5,))
    assert plan(placement="colocated", trainer_gpus_per_node=8, rollout_gpus=0).engine_node_bundles == ((0,), (2,), (4,), (6,))


def test_an_engine_cannot_span_nodes_when_colocated():
    with pytest.raises(ValueError, match="nodesPerEngine"):
        plan(placement="colocated", trainer_gpus_per_node=8, rollout_gpus=0, gpus_per_engine=4, nodes_per_engine=2)

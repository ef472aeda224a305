from rlkube_runtime.data.sample import Sample
from rlkube_runtime.plugins import load_callable
from rlkube_runtime.rollout.filters import check_reward_nonzero_std


def group(*rewards):
    return [Sample(group_index=0, index=i, reward=r) for i, r in enumerate(rewards)]


def test_groups_with_equal_rewards_are_dropped_and_mixed_ones_kept():
    assert not check_reward_nonzero_std(group(1.0, 1.0, 1.0))
    assert not check_reward_nonzero_std(group(0.0, 0.0))
    assert check_reward_nonzero_std(group(0.0, 1.0, 0.0))
    assert check_reward_nonzero_std(group({"reward": 0.5}, {"reward": 0.0}))


def test_the_filter_loads_by_the_path_the_examples_use():
    assert load_callable("rlkube_runtime.rollout.filters:check_reward_nonzero_std") is check_reward_nonzero_std


def test_slime_users_name_the_builtin_filter_as_slime_does():
    from rlkube_runtime.actors.rollout_manager import _sampling_filter
    from rlkube_runtime.spec.rollout import RolloutSpec

    for ref in ("check_reward_nonzero_std", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"):
        spec = RolloutSpec.model_validate({"batchSize": 4, "dynamicSamplingFilter": ref})
        assert _sampling_filter(spec.dynamic_sampling_filter) is check_reward_nonzero_std
    assert _sampling_filter("rlkube_runtime.rollout.filters:check_reward_nonzero_std") is check_reward_nonzero_std
    assert _sampling_filter(None) is None

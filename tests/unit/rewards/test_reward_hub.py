"""compute_reward / compute_rewards: dispatch by type, custom and per-sample functions, group
reward functions, settings from a spec, and failures that name their source."""

import asyncio
import itertools
import textwrap

import pytest
from rlkube_runtime.data import Sample
from rlkube_runtime.plugins import PluginLoadError
from rlkube_runtime.rewards import REWARD_TYPES, RewardConfig, compute_reward, compute_rewards

_names = itertools.count()

# Real plugin modules, written to disk and imported by path.
REWARDS_SOURCE = """
import asyncio

def length(sample):
    return len(sample.response)

async def async_is_yes(sample):
    await asyncio.sleep(0)
    return sample.response == "yes"

def constant_half(sample):
    return 0.5

def not_a_number(sample):
    return "good"

def broken(sample):
    raise KeyError("judge")

def rank_in_group(group):
    # relative reward: 1 for the longest response of its group, 0 for the others
    best = max(range(len(group)), key=lambda i: len(group[i].response))
    return [1.0 if i == best else 0.0 for i in range(len(group))]

async def centred(group):
    # length minus the group's mean length; never sees a per-sample reward
    assert all(s.reward is None for s in group)
    mean = sum(len(s.response) for s in group) / len(group)
    return [len(s.response) - mean for s in group]

async def hangs(sample):
    await asyncio.sleep(30)

def too_short(group):
    return [1.0]
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    name = f"rlkube_test_rewards_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(REWARDS_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def group(group_index: int, responses: list[str], label="4") -> list[Sample]:
    return [
        Sample(group_index=group_index, index=group_index * 10 + i, response=r, label=label)
        for i, r in enumerate(responses)
    ]


@pytest.mark.parametrize(
    "reward_type, response, label, expected",
    [
        ("math", r"\boxed{4}", "4", 1.0),
        ("dapo", "Answer: 5", "4", -1.0),
        ("deepscaler", r"<think>..</think>\boxed{4}", "4", 1.0),
        ("f1", "the cat", "cat", 1.0),
        ("exact", " yes ", "yes", 1.0),
    ],
)
async def test_each_rule_type_dispatches_to_its_rule(reward_type, response, label, expected):
    sample = Sample(response=response, label=label)
    assert await compute_reward(sample, reward_type=reward_type) == expected
    assert sample.reward is None  # compute_reward leaves the sample alone


async def test_custom_functions_may_be_sync_or_async(rewards_module):
    assert (
        await compute_reward(
            Sample(response="abc"), reward_type="custom", custom_path=f"{rewards_module}:length"
        )
        == 3.0
    )
    assert (
        await compute_reward(
            Sample(response="yes"),
            reward_type="custom",
            custom_path=f"{rewards_module}:async_is_yes",
        )
        == 1.0
    )


async def test_a_per_sample_reward_fn_in_metadata_overrides_the_type(rewards_module):
    samples = [
        Sample(response=r"\boxed{4}", label="4"),
        Sample(
            response=r"\boxed{4}",
            label="4",
            metadata={"reward_fn": f"{rewards_module}:constant_half"},
        ),
    ]
    assert await compute_rewards(samples, reward_type="math") == [1.0, 0.5]


async def test_a_per_sample_reward_type_in_metadata_overrides_the_type():
    samples = [
        Sample(response="Paris", label="paris"),
        Sample(response="Paris", label="paris", metadata={"reward_type": "f1"}),
    ]
    assert await compute_rewards(samples, reward_type="exact") == [0.0, 1.0]


async def test_an_unknown_per_sample_reward_type_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"sample index 3: unknown reward type 'judge' .* known: \['math'"
    ):
        await compute_reward(Sample(index=3, metadata={"reward_type": "judge"}), reward_type="math")


async def test_a_per_sample_remote_type_without_a_url_is_an_error():
    with pytest.raises(
        ValueError, match="sample index 2 asks for reward_type 'remote' .* reward.url is not set"
    ):
        await compute_reward(
            Sample(index=2, metadata={"reward_type": "remote"}), reward_type="math"
        )


async def test_compute_rewards_sets_sample_reward_and_returns_them_in_order(rewards_module):
    samples = [Sample(response="x" * n) for n in (3, 1, 2)]
    rewards = await compute_rewards(
        samples, reward_type="custom", custom_path=f"{rewards_module}:length"
    )
    assert rewards == [3.0, 1.0, 2.0] == [s.reward for s in samples]


async def test_group_reward_function_scores_each_group_instead_of_the_per_sample_type(
    rewards_module,
):
    # Groups interleaved on purpose: grouping is by group_index, not by position. The per-sample
    # type would fail (`broken`), so it must not run.
    a, b = group(0, ["aa", "a", "aaa"]), group(1, ["b", "bbbb"])
    samples = [a[0], b[0], a[1], b[1], a[2]]
    rewards = await compute_rewards(
        samples,
        reward_type="custom",
        custom_path=f"{rewards_module}:broken",
        group_reward_function=f"{rewards_module}:centred",
    )
    # a: mean length 2, b: mean length 2.5
    assert rewards == [0.0, -1.5, -1.0, 1.5, 1.0]
    assert [s.reward for s in samples] == rewards


async def test_a_group_reward_function_can_rank_within_each_group(rewards_module):
    samples = group(0, ["short", "the longest one", "mid size"]) + group(1, ["z", "zz"])
    rewards = await compute_rewards(
        samples, reward_type="exact", group_reward_function=f"{rewards_module}:rank_in_group"
    )
    assert rewards == [0.0, 1.0, 0.0, 0.0, 1.0]


async def test_a_group_reward_function_returning_the_wrong_count_is_an_error(rewards_module):
    with pytest.raises(ValueError, match=r"too_short' returned 1 for group_index 0 of 2 samples"):
        await compute_rewards(
            group(0, ["a", "b"]),
            reward_type="exact",
            group_reward_function=f"{rewards_module}:too_short",
        )


async def test_a_group_reward_function_needs_group_indices(rewards_module):
    with pytest.raises(ValueError, match="sample index 5 has no group_index"):
        await compute_rewards(
            [Sample(index=5)],
            reward_type="exact",
            group_reward_function=f"{rewards_module}:centred",
        )


async def test_settings_come_from_a_reward_spec_read_by_attribute(rewards_module):
    class Spec:  # the fields of rlkube_runtime.spec.RewardSpec
        type = "custom"
        custom_path = f"{rewards_module}:length"  # replaced by the group function
        url = None
        timeout_seconds = 5.0
        max_retries = 1
        group_reward_function = f"{rewards_module}:centred"

    assert await compute_rewards(group(0, ["a", "abc"]), Spec()) == [-1.0, 1.0]
    assert RewardConfig.from_spec(Spec()).max_retries == 1


async def test_a_spec_and_keyword_settings_together_are_refused():
    with pytest.raises(TypeError, match=r"not both \(got \['reward_type'\]\)"):
        await compute_rewards([], RewardConfig(reward_type="math"), reward_type="f1")
    with pytest.raises(TypeError, match="pass a RewardSpec or reward_type"):
        await compute_rewards([])


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"reward_type": "judge"},
            r"reward.type must be one of \['math', 'dapo', 'deepscaler', 'f1', 'exact', 'remote', 'custom'\], got 'judge'",
        ),
        ({"reward_type": "custom"}, "reward.customPath is not set"),
        ({"reward_type": "remote"}, "reward.url is not set"),
        (
            {"reward_type": "remote", "url": "http://x", "timeout_seconds": 0},
            "reward.timeoutSeconds must be > 0",
        ),
        ({"reward_type": "math", "max_retries": -1}, "reward.maxRetries must be >= 0"),
    ],
)
def test_invalid_settings_are_rejected_naming_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**settings)
    assert set(REWARD_TYPES) == {"math", "dapo", "deepscaler", "f1", "exact", "remote", "custom"}


async def test_a_custom_path_that_does_not_import_fails_before_any_sample_is_scored():
    with pytest.raises(
        PluginLoadError, match=r"custom reward function \(reward.customPath\) 'nope_mod:fn'"
    ):
        await compute_rewards([Sample()], reward_type="custom", custom_path="nope_mod:fn")


async def test_a_non_numeric_custom_reward_names_the_function(rewards_module):
    with pytest.raises(
        TypeError, match=rf"reward function '{rewards_module}:not_a_number' returned str 'good'"
    ):
        await compute_reward(
            Sample(), reward_type="custom", custom_path=f"{rewards_module}:not_a_number"
        )


async def test_an_exception_in_a_custom_function_carries_a_note_with_path_and_sample(
    rewards_module,
):
    with pytest.raises(KeyError) as info:
        await compute_rewards(
            [Sample(index=9)], reward_type="custom", custom_path=f"{rewards_module}:broken"
        )
    assert info.value.__notes__ == [
        f"in reward function '{rewards_module}:broken' for sample index 9"
    ]


async def test_a_failing_sample_cancels_the_rest_of_the_batch(rewards_module, tmp_path):
    # tmp_path is on sys.path through rewards_module
    (tmp_path / "rlkube_test_slow_reward.py").write_text(
        textwrap.dedent("""
        import asyncio
        DONE = []
        async def slow(sample):
            await asyncio.sleep(5)
            DONE.append(sample.index)
            return 1.0
    """)
    )
    samples = [
        Sample(index=1, metadata={"reward_fn": "rlkube_test_slow_reward:slow"}),
        Sample(index=2),
    ]
    started = asyncio.get_running_loop().time()
    with pytest.raises(KeyError):
        await compute_rewards(samples, reward_type="custom", custom_path=f"{rewards_module}:broken")
    import rlkube_test_slow_reward

    assert rlkube_test_slow_reward.DONE == []  # cancelled, never finished
    assert asyncio.get_running_loop().time() - started < 1.0


async def test_an_async_custom_function_that_hangs_fails_after_timeout_seconds(rewards_module):
    with pytest.raises(
        TimeoutError,
        match=rf"reward function '{rewards_module}:hangs' for sample index 4 gave no answer within 0.05 s",
    ):
        await compute_rewards(
            [Sample(index=4)],
            reward_type="custom",
            custom_path=f"{rewards_module}:hangs",
            timeout_seconds=0.05,
        )


async def test_an_unimportable_group_reward_function_is_named():
    with pytest.raises(
        PluginLoadError, match=r"group reward function \(reward.groupRewardFunction\) 'nope_mod:g'"
    ):
        await compute_rewards(
            group(0, ["a"]), reward_type="exact", group_reward_function="nope_mod:g"
        )


async def test_compute_rewards_accepts_the_rljob_reward_spec():
    from rlkube_runtime.spec.reward import RewardSpec

    spec = RewardSpec.model_validate({"type": "exact", "timeoutSeconds": 5})
    assert await compute_rewards(
        [Sample(response="4", label="4"), Sample(response="5", label="4")], spec
    ) == [1.0, 0.0]

"""Rollout generation against the real built-in engine, in process (no HTTP hop, same engine code)."""

from __future__ import annotations

import pytest

import rlkube_runtime.tiny.task  # noqa: F401  (registers builtin: prompt sets)
from rlkube_runtime.data.dataset import load_prompt_dataset
from rlkube_runtime.data.sample import SampleStatus
from rlkube_runtime.data.source import PromptSource
from rlkube_runtime.engine.engine import Engine, EngineConfig
from rlkube_runtime.rewards.hub import compute_rewards
from rlkube_runtime.data.sample import Sample
from rlkube_runtime.rollout.generate import GenerateContext, SamplingConfig, generate_rollout, restart_stale_partials
from rlkube_runtime.tiny.model import build_tiny_checkpoint
from rlkube_runtime.tiny.task import get_task


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), alphabet=get_task("add-mod10").alphabet, seed=3)


@pytest.fixture
async def engine(model_dir):
    engine = Engine.load(EngineConfig(model_path=str(model_dir), seed=7))
    engine.start()
    yield engine
    engine.stop()


def _source(n: int = 4) -> PromptSource:
    return PromptSource(load_prompt_dataset("builtin:add-mod10"), n_samples_per_prompt=n, seed=1)


def _context(engine: Engine, max_len: int = 3) -> GenerateContext:
    return GenerateContext(
        generate=engine.generate,
        sampling=SamplingConfig(max_response_len=max_len),
        tokenizer=engine.tokenizer,
        max_turns=1,
        rollout_id=0,
    )


def _tokenizing(source: PromptSource, tokenizer):
    drawn = []

    def get_groups(n):
        groups = source.get_samples(n)
        for g in groups:
            drawn.append(g[0].group_index)
            for s in g:
                s.tokens = s.tokens or tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        return groups

    return get_groups, drawn


async def _reward(group):
    return await compute_rewards(group, reward_type="exact")


async def test_a_rollout_returns_batch_size_rewarded_groups_with_per_token_logprobs(engine):
    source = _source()
    get_groups, _ = _tokenizing(source, engine.tokenizer)
    result = await generate_rollout(
        ctx=_context(engine), get_groups=get_groups, return_groups=source.add_samples,
        reward_group=_reward, num_groups=5,
    )
    assert len(result.groups) == 5
    assert [g[0].group_index for g in result.groups] == sorted(g[0].group_index for g in result.groups)
    for group in result.groups:
        assert len(group) == 4 and len({s.group_index for s in group}) == 1
        for s in group:
            assert 1 <= s.response_length <= 3
            assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
            assert all(lp <= 0 for lp in s.rollout_log_probs)
            assert s.reward in (0.0, 1.0)
            assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    assert result.metrics["rollout/response_len/mean"] > 0
    assert source.buffer_size == 0


async def test_dynamic_filter_with_over_sampling_keeps_only_accepted_groups_and_loses_no_prompt(engine):
    source = _source(n=2)
    get_groups, drawn = _tokenizing(source, engine.tokenizer)
    seen = []

    def keep_even_groups(group):
        seen.append(group[0].group_index)
        return group[0].group_index % 2 == 0

    result = await generate_rollout(
        ctx=_context(engine), get_groups=get_groups, return_groups=source.add_samples,
        reward_group=_reward, num_groups=3, over_sampling_groups=6, keep_group=keep_even_groups,
    )
    kept = [g[0].group_index for g in result.groups]
    assert len(kept) == 3 and all(i % 2 == 0 for i in kept)
    rejected = [i for i in seen if i % 2]
    handed_back = [g[0].group_index for g in source.get_samples(source.buffer_size)] if source.buffer_size else []
    # Every drawn group is kept, rejected by the filter, or back in the buffer: none vanishes.
    assert sorted(kept + rejected + handed_back) == sorted(drawn)
    assert result.metrics["rollout/dynamic_filter_rejected_groups"] == len(rejected)


async def test_groups_cut_short_go_back_to_the_buffer_reset_and_pending(engine):
    source = _source(n=2)
    get_groups, drawn = _tokenizing(source, engine.tokenizer)

    async def abort_all():
        await engine.abort({"abort_all": True})

    result = await generate_rollout(
        ctx=_context(engine, max_len=3), get_groups=get_groups, return_groups=source.add_samples,
        reward_group=_reward, num_groups=2, over_sampling_groups=12, abort_in_flight=abort_all,
    )
    assert len(result.groups) == 2
    returned = source.get_samples(source.buffer_size) if source.buffer_size else []
    assert len(result.groups) + len(returned) == len(drawn)
    for group in returned:
        for s in group:
            assert s.status == SampleStatus.PENDING and s.response_length == 0 and s.reward is None
            assert s.tokens == engine.tokenizer(s.prompt, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("mask_off_policy", [False, True])
async def test_a_continued_partial_response_trains_only_its_new_tokens_when_off_policy_is_masked(engine, mask_off_policy):
    """A group partial rollout handed back with two response tokens from an earlier rollout: the
    engine continues it by one token (max 3); with maskOffPolicyInPartialRollout only that token
    has loss mask 1 (slime's --mask-offpolicy-in-partial-rollout), without it all three do."""
    source = _source(n=2)
    get_groups, _ = _tokenizing(source, engine.tokenizer)
    [group] = get_groups(1)
    for s in group:
        s.tokens = list(s.tokens) + [s.tokens[0], s.tokens[-1]]  # two tokens "generated" earlier
        s.response_length, s.response = 2, "xx"
        s.loss_mask, s.rollout_log_probs, s.weight_versions = [1, 1], [-0.5, -0.25], ["3"]
        s.status = SampleStatus.ABORTED
    source.add_samples([group])
    result = await generate_rollout(
        ctx=_context(engine, max_len=3), get_groups=get_groups, return_groups=source.add_samples,
        reward_group=_reward, num_groups=1, partial_rollout=True, mask_off_policy=mask_off_policy,
    )
    [continued] = result.groups
    for s in continued:
        assert s.response_length == 3 and s.rollout_log_probs[:2] == [-0.5, -0.25]
        assert s.loss_mask == ([0, 0, 1] if mask_off_policy else [1, 1, 1])
        assert s.weight_versions[0] == "3"


def _kept(versions: list[str], prompt=(5, 6)) -> Sample:
    """A sample partial rollout kept: prompt tokens, then one response token per version."""
    return Sample(prompt="p", tokens=[*prompt, *(9 for _ in versions)], response="x" * len(versions),
                  response_length=len(versions), loss_mask=[1] * len(versions),
                  rollout_log_probs=[-0.5] * len(versions), weight_versions=list(versions), status=SampleStatus.PENDING)


def test_rollout_max_staleness_restarts_only_responses_older_than_the_bound_by_their_oldest_tokens():
    # Trained by rollout 5 (version 5), bound 2: versions 3 and newer may stay.
    fresh, edge, old, spanning, initial = _kept(["4"]), _kept(["3"]), _kept(["2"]), _kept(["2", "4"]), _kept(["default"])
    unstarted = Sample(prompt="p", tokens=[5, 6])
    restarted = restart_stale_partials([[fresh, edge], [old, spanning], [initial, unstarted]], trained_at=5, max_staleness=2)
    assert restarted == 3  # old (3 behind), spanning (its oldest token 3 behind), initial (version 0: 5 behind)
    for s in (fresh, edge):
        assert s.response_length == 1 and s.tokens == [5, 6, 9] and s.weight_versions
    for s in (old, spanning, initial):
        assert (s.tokens, s.response, s.response_length, s.loss_mask, s.rollout_log_probs, s.weight_versions) == \
            ([5, 6], "", 0, None, None, [])
    assert unstarted.tokens == [5, 6]
    assert restart_stale_partials([[_kept(["default"])]], trained_at=0, max_staleness=0) == 0


async def test_a_partial_response_past_rollout_max_staleness_is_generated_again_from_its_prompt(engine):
    """The rollout manager's draw with rollout.maxStaleness 2: groups drawn for rollout 6 lose the
    responses kept from version 1 (5 syncs behind) and generate from their prompts, counted."""
    import types

    from rlkube_runtime.actors.rollout_manager import RolloutManager

    source = _source(n=2)
    manager = RolloutManager.__new__(RolloutManager)  # its draw alone: no engines, no Ray
    manager.spec = types.SimpleNamespace(rollout=types.SimpleNamespace(max_staleness=2))
    manager.source, manager.tokenizer, manager._stale_restarted = source, engine.tokenizer, 0
    manager.engines = types.SimpleNamespace(generating=6)
    [group] = manager._draw_groups(1)
    prompt_tokens = [list(s.tokens) for s in group]
    for s in group:
        s.tokens = list(s.tokens) + [s.tokens[0], s.tokens[-1]]
        s.response_length, s.response = 2, "xx"
        s.loss_mask, s.rollout_log_probs, s.weight_versions = [1, 1], [-0.5, -0.25], ["1"]
        s.status = SampleStatus.ABORTED
    source.add_samples([group])

    result = await generate_rollout(
        ctx=_context(engine, max_len=3), get_groups=manager._draw_groups, return_groups=source.add_samples,
        reward_group=_reward, num_groups=1, partial_rollout=True,
    )
    [regenerated] = result.groups
    assert manager._stale_restarted == len(group)
    for s, prompt in zip(regenerated, prompt_tokens):
        assert s.tokens[:len(prompt)] == prompt and len(s.tokens) == len(prompt) + s.response_length
        assert s.rollout_log_probs[:2] != [-0.5, -0.25] and "1" not in s.weight_versions

"""PromptSource: seeded epochs, groups with consecutive indices, the hand-back buffer, and a resume
that continues exactly where an uninterrupted run would be."""

import json

import pytest
from rlkube_runtime.data import PromptSource, Sample

PROMPTS = [f"p{i}" for i in range(7)]


def make_source(
    n: int = 2, *, shuffle: bool = True, seed: int = 11, prompts=PROMPTS
) -> PromptSource:
    return PromptSource(
        [Sample(prompt=p, label=p.upper()) for p in prompts],
        n_samples_per_prompt=n,
        shuffle=shuffle,
        seed=seed,
    )


def trace(groups: list[list[Sample]]) -> list[tuple]:
    """What a run saw: prompt, group index and sample indices of each group."""
    return [(g[0].prompt, g[0].group_index, tuple(s.index for s in g)) for g in groups]


def test_each_group_is_n_copies_with_consecutive_global_indices_and_one_group_index():
    groups = make_source(n=3).get_samples(4)
    assert [[(s.group_index, s.index) for s in g] for g in groups] == [
        [(0, 0), (0, 1), (0, 2)],
        [(1, 3), (1, 4), (1, 5)],
        [(2, 6), (2, 7), (2, 8)],
        [(3, 9), (3, 10), (3, 11)],
    ]
    assert all(len({s.prompt for s in g}) == 1 for g in groups)


def test_group_members_are_independent_copies_of_the_prompt():
    source = make_source(n=2, shuffle=False)
    a, b = source.get_samples(1)[0]
    a.metadata["seen"] = True
    a.tokens.append(1)
    assert b.metadata == {} and b.tokens == []
    assert source.get_samples(len(PROMPTS))[-1][0].metadata == {}  # the stored prompt is untouched


def test_every_epoch_visits_every_prompt_exactly_once_and_wraps_into_the_next():
    source = make_source()
    seen = [g[0].prompt for g in source.get_samples(3 * len(PROMPTS))]
    epochs = [seen[i : i + len(PROMPTS)] for i in range(0, len(seen), len(PROMPTS))]
    assert all(sorted(e) == sorted(PROMPTS) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # epoch e reshuffles with seed + e
    assert source.epoch == 2


def test_a_request_crossing_an_epoch_boundary_continues_in_the_next_epoch():
    source = make_source()
    uninterrupted = [g[0].prompt for g in make_source().get_samples(10)]
    crossing = [g[0].prompt for g in source.get_samples(5) + source.get_samples(5)]
    assert crossing == uninterrupted
    assert (source.epoch, source.offset) == (1, 3)


def test_same_seed_gives_the_same_order_and_another_seed_another():
    first = [g[0].prompt for g in make_source(seed=1).get_samples(7)]
    assert first == [g[0].prompt for g in make_source(seed=1).get_samples(7)]
    assert first != [g[0].prompt for g in make_source(seed=2).get_samples(7)]


def test_without_shuffle_prompts_come_in_file_order_every_epoch():
    source = make_source(shuffle=False)
    assert [g[0].prompt for g in source.get_samples(9)] == PROMPTS + PROMPTS[:2]


def test_handed_back_groups_are_served_first_oldest_first_with_their_indices():
    source = make_source()
    first = source.get_samples(3)
    source.add_samples([first[2], first[0]])
    assert source.buffer_size == 2
    again = source.get_samples(3)
    assert again[0] is first[2] and again[1] is first[0]
    assert again[2][0].group_index == 3  # then fresh prompts continue the numbering
    assert source.buffer_size == 0


def test_a_request_smaller_than_the_buffer_leaves_the_rest_buffered():
    source = make_source()
    groups = source.get_samples(3)
    source.add_samples(groups)
    assert source.get_samples(1) == groups[:1]
    assert source.buffer_size == 2


def test_add_samples_rejects_a_group_of_the_wrong_size():
    source = make_source(n=2)
    group = source.get_samples(1)[0]
    with pytest.raises(
        ValueError, match=r"group 0 has 1 samples; every group must have n_samples_per_prompt=2"
    ):
        source.add_samples([group[:1]])


def test_add_samples_rejects_a_flat_list_of_samples():
    source = make_source(n=1)
    with pytest.raises(TypeError, match="group 0 must be a list of Sample, got Sample"):
        source.add_samples(source.get_samples(1)[0])


def test_an_empty_prompt_set_or_a_bad_group_size_is_refused():
    with pytest.raises(ValueError, match="needs at least one prompt"):
        PromptSource([], n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="n_samples_per_prompt must be an integer >= 1, got 0"):
        PromptSource([Sample(prompt="p")], n_samples_per_prompt=0)


# --- resume -----------------------------------------------------------------------------------


def run_schedule(source: PromptSource, batches: range, log: list) -> None:
    """The loop's use of the source: take 3 groups per rollout; on odd rollouts the last group is
    'aborted' (partial rollout) and handed back, with a marker on it to show it survives."""
    for step in batches:
        groups = source.get_samples(3)
        log.extend(trace(groups))
        if step % 2 == 1:
            aborted = groups[-1]
            for s in aborted:
                s.response = f"partial from step {step}"
                s.tokens = [1, 2, 3]
                s.response_length = 1
                s.status = Sample.Status.ABORTED
                s.weight_versions.append(str(step))
            source.add_samples([aborted])


def test_resume_from_state_continues_exactly_like_an_uninterrupted_run():
    # Run B: 9 rollouts of 3 groups over 7 prompts -> about 3.5 epochs, with hand-backs.
    log_b: list = []
    run_schedule(make_source(), range(9), log_b)

    # Run A: 4 rollouts (rollout 3 handed a group back, so the buffer is non-empty; the source is
    # inside epoch 1), save, then a fresh process loads the state and does the rest.
    log_a: list = []
    first = make_source()
    run_schedule(first, range(4), log_a)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert len(state["buffer"]) == 1 and state["epoch"] == 1
    resumed = make_source()
    resumed.load_state_dict(state)
    run_schedule(resumed, range(4, 9), log_a)

    assert log_a == log_b
    # None twice, none skipped: apart from handed-back groups served again, the fresh groups are
    # consecutive, and every epoch's worth of fresh prompts is a permutation of the prompt set.
    fresh = [entry for i, entry in enumerate(log_b) if entry not in log_b[:i]]
    assert [e[1] for e in fresh] == list(range(len(fresh)))
    prompts = [e[0] for e in fresh]
    for start in range(0, len(prompts) - len(PROMPTS) + 1, len(PROMPTS)):
        assert sorted(prompts[start : start + len(PROMPTS)]) == sorted(PROMPTS)


def test_resumed_buffer_keeps_the_partial_rollout_of_the_handed_back_group():
    first = make_source()
    run_schedule(first, range(2), [])
    resumed = make_source()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    [group] = resumed.get_samples(1)
    assert all(
        (s.response, s.tokens, s.status, s.weight_versions)
        == ("partial from step 1", [1, 2, 3], Sample.Status.ABORTED, ["1"])
        for s in group
    )
    assert group[0].group_index == 5  # the last group of rollout 1


def test_resume_at_an_epoch_boundary_starts_the_next_epoch():
    first = make_source()
    first.get_samples(len(PROMPTS))
    resumed = make_source()
    resumed.load_state_dict(first.state_dict())
    assert trace(resumed.get_samples(2)) == trace(first.get_samples(2))
    assert resumed.epoch == 1


@pytest.mark.parametrize(
    "change, named",
    [
        ({"prompts": PROMPTS[:-1]}, "prompts_fingerprint"),
        ({"prompts": PROMPTS[:-1] + ["other"]}, "prompts_fingerprint"),
        ({"seed": 12}, "seed: saved 11, now 12"),
        ({"shuffle": False}, "shuffle: saved True, now False"),
        ({"n": 4}, "n_samples_per_prompt: saved 2, now 4"),
    ],
)
def test_loading_state_saved_over_other_prompts_or_settings_is_refused(change, named):
    first = make_source()
    first.get_samples(2)
    with pytest.raises(ValueError, match=rf"cannot resume the prompt source: .*{named}"):
        make_source(**change).load_state_dict(first.state_dict())


def test_from_spec_builds_a_source_from_the_rljob_data_spec():
    from rlkube_runtime.spec.data import DataSpec

    spec = DataSpec.model_validate({"promptData": "builtin:digit-successor", "seed": 3})
    source = PromptSource.from_spec(spec, n_samples_per_prompt=4)
    groups = source.get_samples(10)
    assert len(source) == 10 and source.seed == 3 and source.shuffle
    assert sorted(g[0].prompt for g in groups) == [f"{d}>" for d in range(10)]
    assert all(len(g) == 4 for g in groups)

"""Async mode with a buffer deeper than one: which rollouts the loop asks for while one trains,
the engines' turns (one rollout at a time, in order, syncs between), and the staleness it reports."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlkube_runtime.actors.generation_turns import GenerationTurns
from rlkube_runtime.run.loop import generate_and_train, staleness_metrics
from rlkube_runtime.run.stop import StopRequest
from rlkube_runtime.weight_sync.coordinator import SyncReport


class _Recorder:
    """The job's rollout, trainer, hand-off and report sides, each call noted in order."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []

    # rollouts
    def generate(self, rollout_id):
        self.events.append(("ask", rollout_id))
        return rollout_id

    def take(self, ref, stop):
        self.events.append(("take", ref))
        return [{"weight_versions": ["default"]}], {}

    def take_engine_restarts(self):
        return 0

    def engine_urls(self):
        return ["http://127.0.0.1:1"]

    # trainers
    def train(self, rollout_id, samples):
        self.events.append(("train", rollout_id))
        return {}

    def push_weights(self, rollouts, version):
        return SyncReport(transport="http", version=str(version))

    # hand-off and report
    def to_train(self):
        return {}

    def to_sync(self, syncing):
        pass

    def to_rollout(self, synced):
        return {}

    def trained_samples(self, rollout_id, samples):
        pass

    def dump(self, rollout_id, samples, trainers):
        pass

    def rollout(self, rollout_id, metrics, saved, *, seconds, new_engine_restarts=0):
        pass

    def watch_engines(self, urls):
        pass


def _loop_events(mode: str, buffer: int, num_rollout: int = 6) -> list[tuple[str, int]]:
    side = _Recorder()
    training = SimpleNamespace(num_rollout=num_rollout, mode=mode, async_buffer_size=buffer)
    rollout = SimpleNamespace(mask_off_policy_in_partial_rollout=False)
    plan = SimpleNamespace(
        spec=SimpleNamespace(training=training, rollout=rollout), trains=True,
        eval_due=lambda k: False, sync_due=lambda k: True, hf_export_due=lambda k: False, save_due=lambda k: False,
    )
    job = SimpleNamespace(plan=plan, rollouts=side, trainers=side, handoff=side, report=side)
    generate_and_train(job, StopRequest(), resume=False)
    return side.events


def test_sync_mode_asks_for_the_next_rollout_after_training_this_one():
    assert _loop_events("sync", 1, 3) == [
        ("ask", 0), ("take", 0), ("train", 0), ("ask", 1), ("take", 1), ("train", 1), ("ask", 2), ("take", 2), ("train", 2),
    ]


def test_async_mode_keeps_one_rollout_generating_while_one_trains():
    assert _loop_events("async", 1, 3) == [
        ("ask", 0), ("take", 0), ("ask", 1), ("train", 0), ("take", 1), ("ask", 2), ("train", 1), ("take", 2), ("train", 2),
    ]


def test_a_deeper_buffer_keeps_that_many_rollouts_asked_for_while_one_trains():
    assert _loop_events("async", 3, 6) == [
        ("ask", 0), ("take", 0), ("ask", 1), ("ask", 2), ("ask", 3), ("train", 0),
        ("take", 1), ("ask", 4), ("train", 1),
        ("take", 2), ("ask", 5), ("train", 2),
        ("take", 3), ("train", 3), ("take", 4), ("train", 4), ("take", 5), ("train", 5),
    ]


async def test_rollouts_take_their_turns_in_order_one_at_a_time_whatever_order_they_are_asked():
    turns, log = GenerationTurns(), []

    async def rollout(k):
        async with turns.rollout(k):
            log.append(("start", k))
            await asyncio.sleep(0.01)
            log.append(("end", k))

    first = asyncio.create_task(rollout(0))
    await asyncio.sleep(0)
    await asyncio.gather(rollout(3), rollout(1), rollout(2))
    await first
    assert log == [(e, k) for k in range(4) for e in ("start", "end")]


async def test_a_sync_waits_for_the_rollout_in_flight_and_goes_before_the_next():
    turns, log = GenerationTurns(), []

    async def rollout(k):
        async with turns.rollout(k):
            log.append(("start", k))
            await asyncio.sleep(0.02)
            log.append(("end", k))

    async def sync():
        async with turns.sync():
            log.append(("sync", None))
            await asyncio.sleep(0.02)
            log.append(("synced", None))

    tasks = [asyncio.create_task(rollout(0))]
    await asyncio.sleep(0.005)  # rollout 0 in flight, 1 and 2 asked for, then the sync
    tasks += [asyncio.create_task(rollout(1)), asyncio.create_task(rollout(2))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(sync()))
    await asyncio.gather(*tasks)
    assert log == [("start", 0), ("end", 0), ("sync", None), ("synced", None),
                   ("start", 1), ("end", 1), ("start", 2), ("end", 2)]


async def test_a_rollout_that_fails_hands_the_turn_on():
    turns = GenerationTurns()
    with pytest.raises(ValueError):
        async with turns.rollout(0):
            raise ValueError("engine gone")
    async with turns.rollout(1):
        pass
    with pytest.raises(RuntimeError, match="rollout 1 asked for a turn after rollout 1 had one"):
        async with turns.rollout(1):
            pass


def test_staleness_counts_the_syncs_between_a_samples_oldest_version_and_the_trained_policy():
    samples = [
        {"weight_versions": ["default"]},  # the engine's initial weights: version 0
        {"weight_versions": ["3"]},
        {"weight_versions": ["3", "4"]},  # generation spanned a sync (partial rollout): its oldest counts
        {"weight_versions": ["5"]},
    ]
    assert staleness_metrics(samples, trained_at=5) == {
        "rollout/staleness/mean": (5 + 2 + 2 + 0) / 4,
        "rollout/staleness/max": 5.0,
        "rollout/staleness/share_0": 0.25,
        "rollout/staleness/share_2": 0.5,
        "rollout/staleness/share_5": 0.25,
    }
    # With the older tokens masked out of the loss, what trains of the spanning sample is version 4's.
    assert staleness_metrics(samples, trained_at=5, only_newest_trains=True)["rollout/staleness/mean"] == (5 + 2 + 1 + 0) / 4

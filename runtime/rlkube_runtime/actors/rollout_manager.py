"""The rollout side of a job, as one Ray actor: prompts, generation, rewards, eval.

It owns the prompt source (so its position and buffer are checkpointed with the job) and turns a
rollout id into rewarded samples through the router. The engines behind the router (start,
health, replacement, weight pushes, memory hand-off) are its `EnginePool`; requests in flight on
an engine that dies are retried by the client through the router until the pool has replaced it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.data.source import PromptSource
from rlkube_runtime.data.tokenizer import load_tokenizer
from rlkube_runtime.plugins import load_callable
from rlkube_runtime.rewards.hub import compute_rewards
from rlkube_runtime.rewards.pass_at_k import eval_dataset_metrics
from rlkube_runtime.actors.engine_pool import EnginePool, EngineRestartLimitExceeded, PoolConfig
from rlkube_runtime.actors.generation_turns import GenerationTurns
from rlkube_runtime.rollout.generate import (
    GenerateContext,
    SamplingConfig,
    generate_rollout,
    generate_sample,
    naming_adapter,
    restart_stale_partials,
)
from rlkube_runtime.spec import RLJobSpec
from rlkube_runtime.spec.base import builtin_filter_name
from rlkube_runtime.weight_sync.coordinator import SyncReport
from rlkube_runtime.weight_sync.plan import SyncPlan

log = logging.getLogger(__name__)

__all__ = ["EngineRestartLimitExceeded", "RolloutManager"]


class RolloutManager:
    def __init__(self, spec: dict[str, Any], pool: PoolConfig):
        """`pool`: where the engines go and what they load."""
        self.spec = RLJobSpec.model_validate(spec)
        self.model_path = pool.model_path
        self.engines = EnginePool(self.spec, pool)
        self._client = None
        self._data_states: dict[int, dict[str, Any]] = {}
        self._turns = GenerationTurns()  # rollouts one at a time, in order; syncs between them
        self._reward_client = None  # a RemoteRewardClient when reward.url is set
        self._stale_restarted = 0  # this rollout's partial responses discarded by rollout.maxStaleness

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        spec = self.spec
        # An engine takes the longest to start (its process imports torch and transformers and
        # loads the model): launch the engines and the router first, and get the prompts ready
        # meanwhile (a thread: importing transformers and loading the tokenizer take seconds of
        # CPU that the router's start need not wait for).
        router = asyncio.create_task(self.engines.start_router(self.engines.launch()))
        try:
            await asyncio.to_thread(self._load_prompts)
        except BaseException:
            router.cancel()
            raise
        router_url = await router
        # Requests that hit a dying engine are retried through the router until its replacement
        # is registered (a restart takes seconds to a minute), as slime retries up to 60 times.
        from rlkube_runtime.serving.client import RolloutClient

        self._client = RolloutClient(router_url, max_attempts=60)
        if spec.reward.url:
            from rlkube_runtime.rewards.remote import RemoteRewardClient

            # One connection pool for the whole run instead of one per group.
            self._reward_client = RemoteRewardClient(
                spec.reward.url, timeout_seconds=spec.reward.timeout_seconds, max_retries=spec.reward.max_retries
            )
        return {"router": router_url, "engines": self.engines.urls}

    def _load_prompts(self) -> None:
        """The tokenizer, the prompt source, the sampling settings, the filter and the custom generate."""
        import rlkube_runtime.tiny.task  # noqa: F401  (registers the builtin: prompt sets)

        spec = self.spec
        self.tokenizer = load_tokenizer(self.model_path, trust_remote_code=spec.model.trust_remote_code)
        self.source = PromptSource.from_spec(
            spec.data, n_samples_per_prompt=spec.rollout.n_samples_per_prompt, tokenizer=self.tokenizer
        )
        self.sampling = SamplingConfig.from_spec(spec.rollout)
        self._filter = _sampling_filter(spec.rollout.dynamic_sampling_filter)
        self._custom_generate = (
            load_callable(spec.rollout.custom_generate_function, what="spec.rollout.customGenerateFunction")
            if spec.rollout.custom_generate_function
            else None
        )

    async def shutdown(self) -> None:
        for client in (self._client, self._reward_client):
            if client is not None:
                await client.close()
        await self.engines.shutdown()

    # -- one rollout ----------------------------------------------------------------------

    async def generate(self, rollout_id: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Rewarded samples of one rollout (as dicts, ordered by group) and the rollout metrics.
        Several may be asked for at once (async mode): they generate one after another, in order."""
        async with self._turns.rollout(rollout_id):
            return await self._generate(rollout_id)

    async def _generate(self, rollout_id: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
        self.engines.raise_if_failed()
        # Taken before any prompt is drawn: a checkpoint written while this rollout is still in
        # flight or waiting (async mode) resumes by generating it again from the same prompts.
        self._data_states[rollout_id] = self.source.state_dict()
        self.engines.generating = rollout_id
        self._stale_restarted = 0
        # A checkpoint after rollout k asks for k+1's, and up to asyncBufferSize rollouts after k
        # may have started by then.
        oldest_asked = rollout_id - self.spec.training.async_buffer_size - 1
        for old in [k for k in self._data_states if k < oldest_asked]:
            del self._data_states[old]
        rollout = self.spec.rollout
        result = await self.engines.unless_failed(generate_rollout(
            ctx=self._context(rollout_id, self.sampling),
            get_groups=self._draw_groups,
            return_groups=self.source.add_samples,
            reward_group=self._reward_group,
            num_groups=rollout.batch_size,
            over_sampling_groups=rollout.over_sampling_batch_size,
            keep_group=self._filter,
            abort_in_flight=lambda: self._client.abort(f"r{rollout_id}-"),  # this rollout's requests only
            partial_rollout=rollout.partial_rollout,
            mask_off_policy=rollout.mask_off_policy_in_partial_rollout,
            custom_generate=self._custom_generate,
        ))
        samples = [s for group in result.groups for s in group]
        for s in samples:
            s.rollout_id = rollout_id
        if rollout.max_staleness is not None:
            result.metrics["rollout/partial/stale_restarted"] = float(self._stale_restarted)
        return [s.to_dict() for s in samples], result.metrics

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Per eval dataset `eval/<name>/{reward, accuracy, pass_at_<k>, response_len/mean, truncated_ratio,
        num_prompts}`, and the mean reward over all datasets (`eval/reward`)."""
        from rlkube_runtime.data.dataset import load_prompt_dataset_from_spec

        spec = self.spec
        metrics: dict[str, float] = {}
        for dataset in spec.eval.datasets:
            prompts = load_prompt_dataset_from_spec(dataset.data_spec(spec.data), tokenizer=self.tokenizer)
            source = PromptSource(prompts, n_samples_per_prompt=dataset.n_samples, shuffle=False)
            samples = [s for group in source.get_samples(len(prompts)) for s in group]
            self._tokenize(samples)
            ctx = self._context(rollout_id, self.sampling.for_eval(dataset), request_prefix="e")
            generate_one = self._custom_generate or generate_sample
            await self.engines.unless_failed(asyncio.gather(*(generate_one(ctx, s) for s in samples)))
            rewards = await compute_rewards(samples, spec.reward, remote_client=self._reward_client)
            by_prompt: dict[Any, list[float]] = {}
            for s, r in zip(samples, rewards):
                by_prompt.setdefault(s.group_index, []).append(float(r))
            metrics.update(eval_dataset_metrics(
                dataset.name,
                list(by_prompt.values()),
                response_lengths=[s.response_length for s in samples],
                truncated=[s.status == Sample.Status.TRUNCATED for s in samples],
                pass_k=dataset.pass_k,
            ))
        names = [d.name for d in spec.eval.datasets]
        if names:
            metrics["eval/reward"] = sum(metrics[f"eval/{n}/reward"] for n in names) / len(names)
        return metrics

    # -- the engines, for the driver ----------------------------------------------------

    async def set_weight_pushers(self, pushers: list[Any], plan: SyncPlan) -> None:
        self.engines.set_weight_pushers(pushers, plan)

    async def update_weights(self, version: str) -> SyncReport:
        """After the rollout in flight, before the next one (each rollout has one weight version)."""
        asked = time.monotonic()
        async with self._turns.sync():
            waited = time.monotonic() - asked
            report = await self.engines.update_weights(version)
        return dataclasses.replace(report, waited_seconds=waited)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.engines.release_memory(tags)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.engines.resume_memory(tags)

    async def take_engine_restarts(self) -> int:
        """Engine restarts since the last call (the driver counts them into its metrics)."""
        return self.engines.take_restarts()

    async def engine_urls(self) -> list[str]:
        """Where the engines serve now (a restart moves one): the driver fetches their /metrics."""
        return self.engines.urls

    # -- data position --------------------------------------------------------------------

    async def data_state(self, next_rollout_id: int) -> dict[str, Any]:
        """The prompt source as it must be to generate `next_rollout_id` next."""
        if next_rollout_id in self._data_states:
            return self._data_states[next_rollout_id]
        return self.source.state_dict()

    async def load_data_state(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    # -- helpers --------------------------------------------------------------------------

    def _context(self, rollout_id: int, sampling: SamplingConfig, request_prefix: str = "r") -> GenerateContext:
        # Training requests under routing replay ask for routed experts, which the router drops.
        replay = self.spec.training.routing_replay and request_prefix == "r"
        generate = self._client.generate_on_engines if replay else self._client.generate
        if self.spec.training.lora is not None and self.engines.synced:
            # Every request, a custom generate function's too, asks for the policy's adapter.
            generate = functools.partial(naming_adapter, generate)
        return GenerateContext(
            generate=generate,
            sampling=sampling,
            tokenizer=self.tokenizer,
            max_turns=self.spec.rollout.max_turns,
            rollout_id=rollout_id,
            request_prefix=request_prefix,
            return_routed_experts=replay,  # training rollouts only: eval samples are never trained on
        )

    def _draw_groups(self, num_groups: int) -> list[list[Sample]]:
        groups = self.source.get_samples(num_groups)
        bound = self.spec.rollout.max_staleness
        if bound is not None:  # before tokenizing: a discarded response leaves its prompt's tokens
            self._stale_restarted += restart_stale_partials(groups, trained_at=self.engines.generating,
                                                            max_staleness=bound)
        self._tokenize([s for g in groups for s in g])
        return groups

    def _tokenize(self, samples: list[Sample]) -> None:
        for s in samples:
            if s.tokens:
                continue  # a partial rollout handed back keeps its tokens
            if not isinstance(s.prompt, str):
                raise ValueError(
                    "spec.data.applyChatTemplate: the prompt is a list of messages; set applyChatTemplate: true "
                    "so the tokenizer's chat template turns it into text"
                )
            s.tokens = list(self.tokenizer(s.prompt, add_special_tokens=False)["input_ids"])

    async def _reward_group(self, group: list[Sample]) -> list[float]:
        return await compute_rewards(group, self.spec.reward, remote_client=self._reward_client)


def _sampling_filter(ref: str | None):
    """The group filter `spec.rollout.dynamicSamplingFilter` names: a built-in one, or user code."""
    if not ref:
        return None
    builtin = builtin_filter_name(ref)
    if builtin is not None:
        from rlkube_runtime.rollout import filters

        return getattr(filters, builtin)
    return load_callable(ref, what="spec.rollout.dynamicSamplingFilter")

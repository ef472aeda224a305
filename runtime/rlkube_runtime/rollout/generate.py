"""One rollout: prompts in, rewarded groups of samples out, through the router's `/generate`.

Follows slime's `generate_rollout_async`: keep `overSamplingBatchSize` groups in flight, reward
each group as soon as all its samples finish, keep the groups the dynamic-sampling filter
accepts, and once `batchSize` groups are kept abort the rest. Nothing is lost: groups still in
flight when the rollout is full go back to the data source's buffer (with their partial
responses when partial rollout is on, reset otherwise), so every prompt is trained on exactly
once unless a filter rejects it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from rlkube_runtime.data.sample import Sample, SampleStatus, syncs_behind
from rlkube_runtime.lora import ADAPTER_NAME

# POST /generate with a SGLang request body, returning the SGLang response body.
GenerateCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# Rewards for one group of samples, in order.
GroupRewardFn = Callable[[list[Sample]], Awaitable[list[float]]]
# Dynamic-sampling filter: keep this (rewarded) group?
GroupFilter = Callable[[list[Sample]], bool]


@dataclass(frozen=True)
class SamplingConfig:
    max_response_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_spec(cls, rollout) -> SamplingConfig:
        """From spec.rollout (an RolloutSpec)."""
        return cls(max_response_len=rollout.max_response_len, temperature=rollout.temperature, top_p=rollout.top_p,
                   top_k=rollout.top_k, stop=tuple(rollout.stop))

    def for_eval(self, dataset) -> SamplingConfig:
        """With an eval dataset's overrides (spec.eval.datasets[]: maxResponseLen, temperature, topP)."""
        return dataclasses.replace(
            self,
            max_response_len=dataset.max_response_len or self.max_response_len,
            temperature=self.temperature if dataset.temperature is None else dataset.temperature,
            top_p=dataset.top_p or self.top_p,
        )

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": max_new_tokens,
            "skip_special_tokens": True,
            # Keep a matched stop string in the text, as slime does: `output_ids` hold its tokens too,
            # so text and tokens describe the same response.
            "no_stop_trim": True,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass
class GenerateContext:
    """What a custom generate function (`spec.rollout.customGenerateFunction`) gets to work with."""

    generate: GenerateCall
    sampling: SamplingConfig
    tokenizer: Any
    max_turns: int
    rollout_id: int
    # Request ids start with f"{request_prefix}{rollout_id}-": training and eval requests never
    # share an id, and `/abort_request` by prefix reaches exactly one rollout's requests.
    request_prefix: str = "r"
    # Set when the rollout has what it needs and aborts the rest: a multi-turn generate function
    # checks it between turns, since a request it sends after the abort would not be aborted.
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    # Routing replay (spec.training.routingReplay): requests ask for every token's routed experts.
    return_routed_experts: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


# async def custom_generate(ctx: GenerateContext, sample: Sample) -> Sample
CustomGenerateFn = Callable[[GenerateContext, Sample], Awaitable[Sample]]


def request_id(ctx: GenerateContext, sample: Sample) -> str:
    """Unique per attempt; `/abort_request` matches by prefix, so `r{rollout}-` aborts a rollout."""
    return f"{ctx.request_prefix}{ctx.rollout_id}-g{sample.group_index}-s{sample.index}-t{sample.response_length}"


async def generate_sample(ctx: GenerateContext, sample: Sample) -> Sample:
    """One `/generate` call; continues a partial response when the sample already has one."""
    budget = ctx.sampling.max_response_len - sample.response_length
    if budget <= 0:
        sample.status = SampleStatus.TRUNCATED
        return sample
    payload = {
        "input_ids": list(sample.tokens),
        "sampling_params": ctx.sampling.sampling_params(budget),
        "return_logprob": True,
        "rid": request_id(ctx, sample),
        **routes_request(ctx),
    }
    response = await ctx.generate(payload)
    append_response(sample, response, loss_mask_value=1)
    return sample


async def naming_adapter(generate: GenerateCall, request: dict[str, Any]) -> Any:
    """`generate(request)` asking for the job's LoRA adapter (spec.training.lora), which the engines
    serve under one name once the first weight sync has loaded it."""
    return await generate({**request, "lora_path": ADAPTER_NAME})


def routes_request(ctx: GenerateContext) -> dict[str, Any]:
    """The /generate field that asks for routed experts, when routing replay needs them."""
    return {"return_routed_experts": True} if ctx.return_routed_experts else {}


def append_response(sample: Sample, response: dict[str, Any], *, loss_mask_value: int) -> None:
    """Fold a SGLang `/generate` response into the sample (tokens, text, logprobs, mask, status)."""
    meta = response.get("meta_info", {})
    output_ids = list(response.get("output_ids") or [])
    logprob_entries = meta.get("output_token_logprobs") or []
    if len(logprob_entries) != len(output_ids):
        raise RuntimeError(
            f"engine returned {len(output_ids)} tokens but {len(logprob_entries)} logprobs for rid {meta.get('id')}; "
            "rollouts need return_logprob"
        )
    sample.tokens = list(sample.tokens) + output_ids
    sample.response = (sample.response or "") + response.get("text", "")
    sample.response_length += len(output_ids)
    sample.loss_mask = list(sample.loss_mask or []) + [loss_mask_value] * len(output_ids)
    sample.rollout_log_probs = list(sample.rollout_log_probs or []) + [float(e[0]) for e in logprob_entries]
    if "routed_experts" in meta:  # the whole sequence's, prompt and earlier turns included
        sample.routed_experts = meta["routed_experts"]
    if "weight_version" in meta:
        sample.weight_versions = list(sample.weight_versions or []) + [str(meta["weight_version"])]
    finish = (meta.get("finish_reason") or {}).get("type")
    sample.status = {
        "stop": SampleStatus.COMPLETED,
        "length": SampleStatus.TRUNCATED,
        "abort": SampleStatus.ABORTED,
    }.get(finish, SampleStatus.COMPLETED)


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    metrics: dict[str, float]


async def generate_rollout(
    *,
    ctx: GenerateContext,
    get_groups: Callable[[int], list[list[Sample]]],
    return_groups: Callable[[list[list[Sample]]], None],
    reward_group: GroupRewardFn,
    num_groups: int,
    over_sampling_groups: int | None = None,
    keep_group: GroupFilter | None = None,
    abort_in_flight: Callable[[], Awaitable[None]] | None = None,
    partial_rollout: bool = False,
    mask_off_policy: bool = False,
    custom_generate: CustomGenerateFn | None = None,
) -> RolloutResult:
    """Generate until `num_groups` groups pass the filter; return those, ordered by group index."""
    start = time.monotonic()
    submit_size = max(num_groups, over_sampling_groups or num_groups)
    generate_one = custom_generate or generate_sample
    kept: list[list[Sample]] = []
    rejected = 0
    in_flight: dict[asyncio.Task, list[Sample]] = {}

    async def run_group(group: list[Sample]) -> list[Sample]:
        if partial_rollout and mask_off_policy:
            for s in group:
                mask_earlier_response(s)
        done = await asyncio.gather(*(generate_one(ctx, s) for s in group))
        if any(s.status == SampleStatus.ABORTED for s in done):
            return list(done)
        rewards = await reward_group(list(done))
        for s, r in zip(done, rewards):
            s.reward = r
        return list(done)

    def top_up() -> None:
        # slime's rule: whenever kept + in-flight groups fall short of the batch, submit another
        # over-sampling batch (rejected groups are what make them fall short).
        while len(kept) + len(in_flight) < num_groups:
            for group in get_groups(submit_size):
                in_flight[asyncio.create_task(run_group(group))] = group

    top_up()
    while len(kept) < num_groups:
        done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            in_flight.pop(task)
            group = task.result()
            if any(s.status == SampleStatus.ABORTED for s in group):
                return_groups([_reset_for_retry(group, partial_rollout)])
            elif keep_group is not None and not keep_group(group):
                rejected += 1
            else:
                kept.append(group)
        if len(kept) < num_groups:
            top_up()

    ctx.aborted.set()
    leftovers = await _drain(in_flight, abort_in_flight)
    # Groups beyond the batch size and groups cut short are handed back, not dropped.
    overflow = kept[num_groups:]
    kept = kept[:num_groups]
    handed_back = [_reset_for_retry(g, partial_rollout) for g in overflow + leftovers]
    if handed_back:
        return_groups(handed_back)
    kept.sort(key=lambda g: g[0].group_index)
    return RolloutResult(kept, rollout_metrics(kept, time.monotonic() - start, rejected, len(handed_back)))


async def _drain(
    in_flight: dict[asyncio.Task, list[Sample]], abort_in_flight: Callable[[], Awaitable[None]] | None
) -> list[list[Sample]]:
    if not in_flight:
        return []
    if abort_in_flight is not None:
        await abort_in_flight()
    results = await asyncio.gather(*in_flight, return_exceptions=True)
    drained = []
    for result, original in zip(results, in_flight.values()):
        drained.append(original if isinstance(result, BaseException) else result)
    return drained


def mask_earlier_response(sample: Sample) -> None:
    """The response a partial rollout kept came from older weights: none of it trains (slime's
    --mask-offpolicy-in-partial-rollout); what is generated from here on appends with mask 1."""
    if sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length


def _reset_for_retry(group: list[Sample], keep_partial: bool) -> list[Sample]:
    """A group going back to the buffer: keep partial responses only when partial rollout is on."""
    reset = []
    for sample in group:
        s = copy.deepcopy(sample)
        s.reward = None
        if not keep_partial or s.status not in (SampleStatus.ABORTED, SampleStatus.PENDING):
            discard_response(s)
        s.status = SampleStatus.PENDING
        reset.append(s)
    return reset


def discard_response(sample: Sample) -> None:
    """Back to its prompt alone: whatever was generated for it goes, so it is generated again."""
    prompt_len = len(sample.tokens) - sample.response_length
    sample.tokens = list(sample.tokens[:prompt_len])
    sample.response = ""
    sample.response_length = 0
    sample.loss_mask = None
    sample.rollout_log_probs = None
    sample.routed_experts = None
    sample.weight_versions = []


def restart_stale_partials(groups: Sequence[list[Sample]], *, trained_at: int, max_staleness: int) -> int:
    """Partial responses kept from weights more than `max_staleness` syncs older than the policy
    that will train on them (rollout `trained_at`: version `trained_at`; run/loop.py's
    staleness_metrics measures the same way, by a sample's oldest version) are discarded, so those
    samples generate again from their prompts. Returns how many were restarted."""
    restarted = 0
    for group in groups:
        for s in group:
            if s.response_length and s.weight_versions and syncs_behind(s.weight_versions, trained_at) > max_staleness:
                discard_response(s)
                restarted += 1
    return restarted


def rollout_metrics(groups: Sequence[list[Sample]], seconds: float, rejected: int, handed_back: int) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    if not samples:
        return {"perf/rollout_time": seconds}
    rewards = [float(s.reward) for s in samples]
    lengths = [s.response_length for s in samples]
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    tokens = sum(lengths)
    # Routing replay: what the samples' routed experts add to a rollout on its way to the trainer.
    routes = {"rollout/routed_experts_bytes": float(sum(len(s.routed_experts) for s in samples))} \
        if any(s.routed_experts for s in samples) else {}
    return {
        **routes,
        "rollout/raw_reward": mean,
        "rollout/raw_reward_std": var**0.5,
        "rollout/response_len/mean": tokens / len(samples),
        "rollout/response_len/max": float(max(lengths)),
        "rollout/response_len/min": float(min(lengths)),
        "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/dynamic_filter_rejected_groups": float(rejected),
        "rollout/handed_back_groups": float(handed_back),
        "perf/rollout_time": seconds,
        "perf/tokens_per_sec": tokens / seconds if seconds > 0 else 0.0,
    }

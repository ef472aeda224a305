"""The reward step: score each sample by the configured type, or each group by a group function.

Reward types (RewardSpec.type):
  math, dapo, deepscaler   math answer equivalence through math-verify (see math_rules)
  f1, exact                text answers (see text_rules)
  remote                   POST to a reward server (see remote)
  custom                   a user function named by `custom_path`

Plugin signatures (one each, sync or async; paths are `package.module:function`):
  custom reward            fn(sample: Sample) -> float
  group reward             fn(group: list[Sample]) -> list[float]   one reward per sample, in order
A group reward function replaces per-sample scoring (as RewardSpec documents): it alone scores
every group. It can call the rules here (e.g. `math_reward`) when it wants them. An async plugin
that takes longer than `timeout_seconds` fails with TimeoutError; a sync one cannot be interrupted.

Per-sample overrides, for prompt sets that mix tasks, read from `sample.metadata` (not used when
a group reward function is set):
  "reward_fn"    a custom reward function path for this sample (takes precedence over the type)
  "reward_type"  another reward type for this sample (remote and custom still need url/custom_path)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.plugins import call_plugin, load_callable
from rlkube_runtime.rewards.math_rules import dapo_reward, deepscaler_reward, math_reward
from rlkube_runtime.rewards.remote import RemoteRewardClient
from rlkube_runtime.rewards.text_rules import exact_reward, f1_reward
from rlkube_runtime.spec.base import spec_default
from rlkube_runtime.spec.reward import RewardSpec
from rlkube_runtime.rewards.values import to_reward_value

RuleReward = Callable[[str, Any], float]

RULE_REWARDS: dict[str, RuleReward] = {
    "math": math_reward,
    "dapo": dapo_reward,
    "deepscaler": deepscaler_reward,
    "f1": f1_reward,
    "exact": exact_reward,
}
REWARD_TYPES: tuple[str, ...] = (*RULE_REWARDS, "remote", "custom")

REWARD_FN_KEY = "reward_fn"
REWARD_TYPE_KEY = "reward_type"


@dataclass(frozen=True)
class RewardConfig:
    """The settings of the reward step (RewardSpec's fields); checked on creation, never changed."""

    reward_type: str
    custom_path: str | None = None
    url: str | None = None
    timeout_seconds: float = spec_default(RewardSpec, "timeout_seconds")
    max_retries: int = spec_default(RewardSpec, "max_retries")
    group_reward_function: str | None = None

    def __post_init__(self) -> None:
        if self.reward_type not in REWARD_TYPES:
            raise ValueError(
                f"reward.type must be one of {list(REWARD_TYPES)}, got {self.reward_type!r}."
            )
        if self.reward_type == "custom" and not self.custom_path:
            raise ValueError(
                "reward.type is 'custom' but reward.customPath is not set; name the function as "
                "'package.module:function'."
            )
        if self.reward_type == "remote" and not self.url:
            raise ValueError("reward.type is 'remote' but reward.url is not set.")
        if self.timeout_seconds <= 0:
            raise ValueError(f"reward.timeoutSeconds must be > 0, got {self.timeout_seconds}.")
        if self.max_retries < 0:
            raise ValueError(f"reward.maxRetries must be >= 0, got {self.max_retries}.")

    @classmethod
    def from_spec(cls, spec: Any) -> RewardConfig:
        """Read a RewardSpec (or anything with its attributes; a RewardConfig passes through)."""
        if isinstance(spec, cls):
            return spec
        return cls(
            reward_type=spec.type,
            custom_path=getattr(spec, "custom_path", None),
            url=getattr(spec, "url", None),
            timeout_seconds=getattr(spec, "timeout_seconds", cls.timeout_seconds),
            max_retries=getattr(spec, "max_retries", cls.max_retries),
            group_reward_function=getattr(spec, "group_reward_function", None),
        )


async def compute_reward(
    sample: Sample,
    *,
    reward_type: str,
    custom_path: str | None = None,
    url: str | None = None,
    timeout_seconds: float = 30.0,
    max_retries: int = 3,
    remote_client: RemoteRewardClient | None = None,
) -> float:
    """The reward of one sample (group reward functions need a batch: see compute_rewards).

    Does not modify the sample.
    """
    config = RewardConfig(
        reward_type=reward_type,
        custom_path=custom_path,
        url=url or (remote_client.url if remote_client else None),
        timeout_seconds=timeout_seconds,
        max_retries=max_retries,
    )
    async with _Scorer(config, remote_client) as scorer:
        return await scorer.score(sample)


async def compute_rewards(
    samples: Sequence[Sample],
    spec: Any = None,
    *,
    reward_type: str | None = None,
    custom_path: str | None = None,
    url: str | None = None,
    timeout_seconds: float | None = None,
    max_retries: int | None = None,
    group_reward_function: str | None = None,
    max_concurrency: int = 64,
    remote_client: RemoteRewardClient | None = None,
) -> list[float]:
    """Score a batch: settings come from `spec` (a RewardSpec) or from the keywords, not both.

    Sets `sample.reward` on every sample and returns the rewards in order. At most
    `max_concurrency` remote or custom calls run at once. With a group reward function, the
    samples are grouped by `group_index` (in order of first appearance) and the function scores
    each group instead of the per-sample type. If any call fails, the others are cancelled and the
    error propagates (with a note naming the function and sample or group).
    """
    config = _config_from(
        spec,
        reward_type=reward_type,
        custom_path=custom_path,
        url=url or (remote_client.url if remote_client and spec is None else None),
        timeout_seconds=timeout_seconds,
        max_retries=max_retries,
        group_reward_function=group_reward_function,
    )
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
    limit = asyncio.Semaphore(max_concurrency)

    if config.group_reward_function:
        path = config.group_reward_function
        group_fn = load_callable(path, what="group reward function (reward.groupRewardFunction)")

        async def score_group(group: list[Sample]) -> None:
            where = f"group reward function {path!r} for group_index {group[0].group_index}"
            async with limit:
                rewards = await _call_plugin_noting(group_fn, group, where, config.timeout_seconds)
            _assign_group_rewards(group, rewards, path)

        await _gather_or_cancel([score_group(g) for g in _groups(samples)])
    else:
        async with _Scorer(config, remote_client) as scorer:

            async def score_one(sample: Sample) -> None:
                async with limit:
                    sample.reward = await scorer.score(sample)

            await _gather_or_cancel([score_one(s) for s in samples])

    return [s.reward for s in samples]  # type: ignore[misc]  # all set above


# --- internals -------------------------------------------------------------------------------


class _Scorer:
    """Scores one sample at a time; holds the loaded functions and the remote client of a batch."""

    def __init__(self, config: RewardConfig, remote_client: RemoteRewardClient | None) -> None:
        self.config = config
        self._functions: dict[str, Callable[..., Any]] = {}
        # Load the configured function now, so a bad path fails before any sample is scored.
        if config.custom_path:
            self._function(config.custom_path, "custom reward function (reward.customPath)")
        self._owns_client = remote_client is None and config.url is not None
        self._client = remote_client
        if self._owns_client:
            self._client = RemoteRewardClient(
                config.url, timeout_seconds=config.timeout_seconds, max_retries=config.max_retries
            )

    async def __aenter__(self) -> _Scorer:  # noqa: PYI034
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._owns_client and self._client is not None:
            await self._client.close()

    async def score(self, sample: Sample) -> float:
        metadata = sample.metadata or {}
        if path := metadata.get(REWARD_FN_KEY):
            fn = self._function(path, f"reward function in metadata[{REWARD_FN_KEY!r}]")
            return await self._custom(fn, path, sample)
        reward_type = metadata.get(REWARD_TYPE_KEY) or self.config.reward_type
        if rule := RULE_REWARDS.get(reward_type):
            return rule(sample.response, sample.label)
        if reward_type == "remote":
            if self._client is None:
                raise ValueError(
                    f"sample index {sample.index} asks for reward_type 'remote' in its metadata "
                    "but reward.url is not set."
                )
            return await self._client.score(sample)
        if reward_type == "custom":
            if not self.config.custom_path:
                raise ValueError(
                    f"sample index {sample.index} asks for reward_type 'custom' in its metadata "
                    "but reward.customPath is not set."
                )
            fn = self._function(self.config.custom_path, "custom reward function")
            return await self._custom(fn, self.config.custom_path, sample)
        raise ValueError(
            f"sample index {sample.index}: unknown reward type {reward_type!r} in "
            f"metadata[{REWARD_TYPE_KEY!r}]; known: {list(REWARD_TYPES)}."
        )

    async def _custom(self, fn: Callable[..., Any], path: str, sample: Sample) -> float:
        where = f"reward function {path!r} for sample index {sample.index}"
        value = await _call_plugin_noting(fn, sample, where, self.config.timeout_seconds)
        return to_reward_value(value, source=f"reward function {path!r}")

    def _function(self, path: str, what: str) -> Callable[..., Any]:
        if path not in self._functions:
            self._functions[path] = load_callable(path, what=what)
        return self._functions[path]


def _config_from(spec: Any, **settings: Any) -> RewardConfig:
    given = {k: v for k, v in settings.items() if v is not None}
    if spec is not None:
        if given:
            raise TypeError(
                f"compute_rewards: pass a RewardSpec or keyword settings, not both (got {sorted(given)})."
            )
        return RewardConfig.from_spec(spec)
    if "reward_type" not in given:
        raise TypeError("compute_rewards: pass a RewardSpec or reward_type=...")
    return RewardConfig(**given)


async def _call_plugin_noting(fn: Callable[..., Any], arg: Any, where: str, timeout: float) -> Any:
    """Call a user function; its exceptions get a note saying `where`, a hang a TimeoutError."""
    try:
        return await asyncio.wait_for(call_plugin(fn, arg), timeout)
    except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
        raise TimeoutError(
            f"{where} gave no answer within {timeout} s; raise reward.timeoutSeconds if it is "
            "just slow."
        ) from None
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"in {where}")
        raise


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        if sample.group_index is None:
            raise ValueError(
                f"sample index {sample.index} has no group_index; a group reward function needs "
                "samples from the prompt source, which sets it."
            )
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


def _assign_group_rewards(group: list[Sample], rewards: Any, path: str) -> None:
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(group):
        size = len(rewards) if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise ValueError(
            f"group reward function {path!r} returned {size} for group_index "
            f"{group[0].group_index} of {len(group)} samples; it must return one reward per sample."
        )
    for sample, value in zip(group, rewards):
        sample.reward = to_reward_value(value, source=f"group reward function {path!r}")


async def _gather_or_cancel(coros: list[Awaitable[None]]) -> None:
    """Run all; on the first failure cancel the rest (asyncio.gather would leave them running)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

"""Client for a reward server: POST one sample as JSON, read back a number.

Protocol (the same one slime's remote_rm speaks, plus metadata):
  request   POST <url>  {"prompt": ..., "response": ..., "label": ..., "metadata": {...}}
  response  a JSON number, or {"reward": <number>}

Connection errors, timeouts and 5xx answers are retried with exponential backoff and jitter
(tenacity), since reward servers restart and shed load; a 4xx means the request itself is wrong,
so it fails at once with the URL and status.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.rewards.values import to_reward_value


class RemoteRewardError(RuntimeError):
    """The reward server could not produce a reward for a sample."""


class _ServerStatusError(Exception):
    """A 5xx answer: the server is there but failing, worth another try."""


_RETRYABLE = (
    aiohttp.ClientConnectionError,  # refused, reset, DNS, server disconnected
    aiohttp.ClientPayloadError,  # the answer was cut off
    asyncio.TimeoutError,  # no answer within timeout_seconds
    _ServerStatusError,
)


class RemoteRewardClient:
    """One HTTP session (connection pool) shared by every request of a batch.

    Use as `async with RemoteRewardClient(url) as client: await client.score(sample)`, or call
    `close()`; the session is opened on the first request, inside the running event loop.
    `max_retries` counts the tries after the first, so a request is sent at most max_retries + 1
    times.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_seconds: float = 30.0,
        max_retries: int = 3,
        retry_wait_seconds: float = 0.5,
        max_retry_wait_seconds: float = 10.0,
        max_connections: int = 64,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward server url must start with http:// or https://, got {url!r}.")
        if timeout_seconds <= 0:
            raise ValueError(f"reward server timeout_seconds must be > 0, got {timeout_seconds}.")
        if max_retries < 0:
            raise ValueError(f"reward server max_retries must be >= 0, got {max_retries}.")
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.max_retries = max_retries
        # retry_wait_seconds * 2^k capped at the max, plus up to one base wait of jitter so that
        # many samples failing together do not retry in lockstep.
        self._wait = wait_exponential(
            multiplier=retry_wait_seconds, max=max_retry_wait_seconds
        ) + wait_random(0, retry_wait_seconds)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RemoteRewardClient:  # noqa: PYI034
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score(self, sample: Sample) -> float:
        """The server's reward for `sample`; raises RemoteRewardError when no answer comes."""
        payload = {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        attempts = self.max_retries + 1
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(attempts),
                wait=self._wait,
                retry=retry_if_exception_type(_RETRYABLE),
            ):
                with attempt:
                    return await self._post(payload)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            raise RemoteRewardError(
                f"reward server {self.url} failed {attempts} time(s) for sample index "
                f"{sample.index}; last error: {self._describe(last)}. Check that the server is "
                "up and reachable from the rollout workers, or raise reward.timeoutSeconds / "
                "reward.maxRetries."
            ) from last
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _post(self, payload: dict[str, Any]) -> float:
        async with self._get_session().post(self.url, json=payload) as resp:
            body = await resp.text()
        if resp.status >= 500:
            raise _ServerStatusError(f"HTTP {resp.status}: {body[:200]!r}")
        if resp.status >= 400:
            raise RemoteRewardError(
                f"reward server {self.url} rejected the request with HTTP {resp.status}: "
                f"{body[:200]!r}. Retrying will not help; check that the server accepts "
                '{"prompt", "response", "label", "metadata"}.'
            )
        try:
            answer = json.loads(body)
        except json.JSONDecodeError:
            raise RemoteRewardError(
                f"reward server {self.url} answered {body[:200]!r}, which is not JSON; it must "
                'answer a number or {"reward": <number>}.'
            ) from None
        if isinstance(answer, dict):
            if "reward" not in answer:
                raise RemoteRewardError(
                    f"reward server {self.url} answered an object without 'reward': {body[:200]!r}."
                )
            answer = answer["reward"]
        return to_reward_value(answer, source=f"reward server {self.url}")

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_seconds),
                connector=aiohttp.TCPConnector(limit=self._max_connections),
            )
        return self._session

    def _describe(self, exc: BaseException | None) -> str:
        if isinstance(exc, asyncio.TimeoutError) and not str(exc):
            return f"no answer within {self.timeout_seconds} s"
        return f"{type(exc).__name__}: {exc}"

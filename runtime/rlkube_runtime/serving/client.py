"""Async HTTP clients for rollout engines: one for generation, one for administering an engine.

`RolloutClient` sends SGLang `/generate` requests to the router (or to one engine) and aborts
in-flight requests on every engine behind it. `EngineAdmin` drives one engine's control API:
health, pause/continue, cache flush, weight updates, memory release. The same code serves SGLang
servers and the built-in engine, because both speak SGLang's HTTP protocol.

Both keep one pooled `aiohttp.ClientSession` (created on first use, inside the running loop),
retry connection errors and 5xx answers with exponential backoff, and raise `EngineHTTPError`
(with the server's message) for 4xx answers, which retrying cannot fix. Use them as async
context managers or call `close()`. Both send the job's API key (serving/auth.py), which the
router and engines of a job on Kubernetes require.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from rlkube_runtime.serving.auth import auth_headers, job_api_key
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

GenerateResponse = dict[str, Any]


class EngineHTTPError(RuntimeError):
    """A non-2xx answer: `status`, the server's `message` and the `url` that gave it."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url

    def __reduce__(self):
        # Rebuilt from its fields: Ray pickles an actor's exception to hand it to the caller, and
        # the default (the formatted message as the only argument) cannot call this __init__.
        return type(self), (self.status, self.message, self.url)


log = logging.getLogger(__name__)


def _retryable(error: BaseException) -> bool:
    if isinstance(error, EngineHTTPError):
        return error.status >= 500
    return isinstance(error, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


class _HTTP:
    """The shared session, timeouts and retry policy of both clients."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float, max_attempts: int, max_connections: int,
                 api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        # The job's key (RLKUBE_API_KEY unless given): the router and engines refuse requests without it.
        self._headers = auth_headers(api_key if api_key is not None else job_api_key())
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._max_attempts = max_attempts
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def request(
        self, method: str, path: str, body: Any = None, *, base_url: str | None = None, max_attempts: int | None = None
    ) -> Any:
        """JSON (or text) of a successful answer, after retries; raises EngineHTTPError otherwise."""
        url = (base_url or self.base_url).rstrip("/") + path
        async for attempt in self.retrying(max_attempts):
            with attempt:
                return await self._once(method, url, body)

    def retrying(self, max_attempts: int | None = None) -> AsyncRetrying:
        """The retry policy: connection errors and 5xx answers, exponential backoff with jitter."""
        return AsyncRetrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(max_attempts or self._max_attempts),
            wait=wait_exponential(multiplier=0.2, max=5.0) + wait_random(0, 0.2),
            reraise=True,
        )

    async def _once(self, method: str, url: str, body: Any) -> Any:
        session = self._get_session()
        async with session.request(method, url, json=body) as response:
            text = await response.text()
            if response.status >= 400:
                raise EngineHTTPError(response.status, _error_message(text), url)
            if not text:
                return None
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


class RolloutClient:
    """Generation through the router (or straight to one engine).

    ```
    async with RolloutClient("http://127.0.0.1:30000") as client:  # an engine on this machine
        out = await client.generate({"input_ids": ids, "sampling_params": {...}, "return_logprob": True})
        await client.abort("r12-")   # every request whose rid starts with r12-, on every engine
    ```
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        max_attempts: int = 5,
        max_connections: int = 1024,
        api_key: str | None = None,
    ):
        self._http = _HTTP(
            base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, max_attempts=max_attempts,
            max_connections=max_connections, api_key=api_key,
        )
        self._engines: list[str] = []  # generate_on_engines: the router's engines not yet seen failing
        self._in_flight: dict[str, int] = {}

    @property
    def base_url(self) -> str:
        return self._http.base_url

    async def generate(self, request: Mapping[str, Any]) -> GenerateResponse | list[GenerateResponse]:
        """POST /generate with an SGLang request body; returns the SGLang response body.

        A request without `rid` gets one, so retries after a connection error or 5xx are the same
        request (same rid, so the same seeded tokens on the built-in engine) and can be aborted.
        A batch request (lists of prompts, or `n > 1`) answers with a list.
        """
        body = dict(request)
        if body.get("rid") is None:
            body["rid"] = f"rlkube-{uuid.uuid4().hex}"
        return await self._http.request("POST", "/generate", body)

    async def generate_on_engines(self, request: Mapping[str, Any]) -> GenerateResponse | list[GenerateResponse]:
        """POST /generate straight to one of the engines the router lists (the one with the fewest
        of this client's requests in flight), for request fields sglang-router 0.3.2 drops from what
        it forwards: `return_routed_experts`, which rollout routing replay needs (slime sends such
        requests through its own router for the same reason). An engine that fails is left out
        until the list is read from the router again, which happens once every engine listed has
        failed (a replaced engine registers at a new URL); retries and backoff as `generate`'s."""
        body = dict(request)
        if body.get("rid") is None:
            body["rid"] = f"rlkube-{uuid.uuid4().hex}"
        async for attempt in self._http.retrying():
            with attempt:
                if not self._engines:
                    self._engines = await self.worker_urls()
                    if not self._engines:
                        raise EngineHTTPError(503, "the router lists no engine", self.base_url)
                url = min(self._engines, key=lambda u: self._in_flight.get(u, 0))
                self._in_flight[url] = self._in_flight.get(url, 0) + 1
                try:
                    return await self._http.request("POST", "/generate", body, base_url=url, max_attempts=1)
                except Exception as err:
                    if _retryable(err) and url in self._engines:
                        self._engines.remove(url)
                    raise
                finally:
                    self._in_flight[url] -= 1

    async def worker_urls(self) -> list[str]:
        """The engines behind the router (`GET /workers`), or the base URL itself when it is an engine."""
        try:
            answer = await self._http.request("GET", "/workers")
        except EngineHTTPError as err:
            if err.status == 404:
                return [self.base_url]
            raise
        return [worker["url"] for worker in answer["workers"]]

    async def abort(self, rid_prefix: str | None = None) -> int:
        """Abort matching requests on every engine (all of them when `rid_prefix` is None).

        The router does not forward `/abort_request`, so it goes to each engine directly. Aborted
        requests still answer their callers, with finish_reason abort and the tokens they had.
        Returns how many requests the engines report aborted (SGLang reports none, counted 0).
        """
        body = {"abort_all": True} if rid_prefix is None else {"rid": rid_prefix}
        urls = await self.worker_urls()
        answers = await asyncio.gather(
            *(self._http.request("POST", "/abort_request", body, base_url=u, max_attempts=3) for u in urls),
            return_exceptions=True,
        )
        for url, answer in zip(urls, answers):
            if isinstance(answer, BaseException):
                if not _retryable(answer):
                    raise answer
                # An engine that cannot be reached runs nothing that needs aborting; the health
                # check replaces it.
                log.warning("abort_request to %s failed: %s", url, answer)
        return sum(int(a.get("num_aborted", 0)) for a in answers if isinstance(a, dict))

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class EngineAdmin:
    """The control API of one engine (an SGLang server or the built-in engine).

    Weight sync in the order slime uses: `pause_generation()`, `flush_cache()`, the updates
    (`update_weights_from_tensor`, `..._from_distributed` after `init_weights_update_group`, or
    `..._from_disk`; `rlkube_runtime.weight_sync` sends them), `continue_generation()`, then
    `get_weight_version()` to confirm.
    """

    def __init__(self, url: str, *, timeout: float = 600.0, connect_timeout_s: float = 10.0, max_attempts: int = 3,
                 api_key: str | None = None):
        self._http = _HTTP(url, timeout_s=timeout, connect_timeout_s=connect_timeout_s, max_attempts=max_attempts,
                           max_connections=16, api_key=api_key)

    @property
    def url(self) -> str:
        return self._http.base_url

    async def health(self) -> bool:
        """`GET /health` answered 200 (the server is up; says nothing about the model)."""
        return await self._ok("/health")

    async def health_generate(self) -> bool:
        """`GET /health_generate` answered 200: the engine could generate a token."""
        return await self._ok("/health_generate")

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Stop generating. abort: running requests end with finish_reason abort; retract: they
        drop their KV cache and resume later; in_place: they keep it. New requests wait."""
        return await self._http.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._http.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """True if flushed; False if the engine refused because requests are running or waiting."""
        try:
            await self._http.request("POST", "/flush_cache")
        except EngineHTTPError as err:
            if err.status == 400:
                return False
            raise
        return True

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, Any], *, version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        """Push `name → tensor` (any subset of the state dict) as bytes, in the built-in engine's
        `rlkube_safetensors` format (a small-update helper; runs push through `weight_sync`)."""
        from rlkube_runtime.engine.weights import encode_named_tensors

        payload = await asyncio.to_thread(encode_named_tensors, dict(tensors))
        return await self.update_weights_from_tensor([payload], load_format="rlkube_safetensors", version=version,
                                                     flush_cache=flush_cache)

    async def update_weights_from_tensor(
        self, serialized: Sequence[str], *, load_format: str | None, version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        """SGLang's /update_weights_from_tensor: one serialized entry per tensor-parallel rank."""
        body = {"serialized_named_tensors": list(serialized), "load_format": load_format, "flush_cache": flush_cache,
                "weight_version": version}
        return await self._http.request("POST", "/update_weights_from_tensor", body)

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> dict[str, Any]:
        """Join rank 0's process group for /update_weights_from_distributed."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._http.request("POST", "/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self, *, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], group_name: str,
        version: str | None = None, flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Receive these tensors, in this order, from rank 0's broadcasts in `group_name`."""
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes], "group_name": group_name,
                "flush_cache": flush_cache, "weight_version": version}
        return await self._http.request("POST", "/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self._http.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(self, model_path: str, *, version: str | None = None) -> dict[str, Any]:
        """Load an HF checkpoint directory the engine can read (same architecture)."""
        return await self._http.request("POST", "/update_weights_from_disk", {"model_path": model_path, "weight_version": version})

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Serve the peft adapter directory `lora_path` (the engine reads it) to requests naming `lora_name`."""
        return await self._http.request("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._http.request("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, version: str) -> dict[str, Any]:
        """Report `version` from now on (after an adapter load, which sets none)."""
        return await self._http.request("POST", "/update_weight_version", {"new_version": version})

    async def get_weight_version(self) -> str:
        return str((await self._http.request("GET", "/get_weight_version"))["weight_version"])

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Free `tags` (weights, kv_cache, cuda_graph; default all) until resumed."""
        return await self._http.request("POST", "/release_memory_occupation", {"tags": list(tags) if tags else None})

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        return await self._http.request("POST", "/resume_memory_occupation", {"tags": list(tags) if tags else None})

    async def abort(self, rid_prefix: str | None = None) -> Any:
        body = {"abort_all": True} if rid_prefix is None else {"rid": rid_prefix}
        return await self._http.request("POST", "/abort_request", body)

    async def model_info(self) -> dict[str, Any]:
        return await self._http.request("GET", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._http.request("GET", "/get_server_info")

    async def load(self) -> list[dict[str, Any]]:
        """`GET /get_load`: per data-parallel rank, num_reqs, num_waiting_reqs and num_tokens."""
        return await self._http.request("GET", "/get_load")

    async def _ok(self, path: str) -> bool:
        try:
            await self._http.request("GET", path)
        except (EngineHTTPError, aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> EngineAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:1000]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return text.strip()[:1000]


def engine_unreachable(error: BaseException) -> bool:
    """Connection failures and 5xx answers after the client's retries: the engine is gone (and is
    replaced), unlike a 4xx, which is a request the engine refused."""
    if isinstance(error, EngineHTTPError):
        return error.status >= 500
    return isinstance(error, (aiohttp.ClientConnectionError, asyncio.TimeoutError))

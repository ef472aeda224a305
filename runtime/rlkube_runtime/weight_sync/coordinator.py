"""Running a sync: every engine paused and flushed, each pushing trainer rank loading the engines
it serves (all at once, their reports merged into one), every engine resumed and checked to hold
the new version. Engines lost on the way are the engine pool's to replace (`SyncTarget`); what a
push does on the wire is `sender.WeightSender`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rlkube_runtime.serving.client import engine_unreachable
from rlkube_runtime.weight_sync.plan import SyncPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SyncReport:
    """What one sync did: the weight version, the transport, tensor bytes sent to each engine,
    seconds (the slowest pushing rank's), requests per engine, and the engines that failed
    (URL -> error), which the caller replaces; in async mode, how long the sync waited for the
    rollout in flight to finish (not part of the sync's own time)."""

    transport: str
    version: str = ""
    bytes_per_engine: int = 0
    seconds: float = 0.0
    requests_per_engine: int = 0
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    waited_seconds: float = 0.0

    @classmethod
    def merged(cls, transport: str, version: str, reports: list[SyncReport]) -> SyncReport:
        """Several ranks' pushes of one version as one report: the largest figures, every failure."""
        out = cls(transport=transport, version=version)
        for report in reports:
            out.bytes_per_engine = max(out.bytes_per_engine, report.bytes_per_engine)
            out.requests_per_engine = max(out.requests_per_engine, report.requests_per_engine)
            out.seconds = max(out.seconds, report.seconds)
            out.failed.update(report.failed)
        return out

    def metrics(self) -> dict[str, float]:
        """The loop's perf/ figures of this sync."""
        return {"perf/update_weights_push_time": self.seconds, "perf/update_weights_bytes": float(self.bytes_per_engine),
                "perf/update_weights_wait_time": self.waited_seconds}


Push = Callable[[int, list[str], SyncPlan, str], Awaitable[SyncReport]]


async def run_sync(plan: SyncPlan, push: Push, urls: dict[int, str], version: str) -> SyncReport:
    """Push `version` to the engines `urls` ({engine index: URL}), each from its rank in `plan`:
    `push(rank, urls, plan, version)` has that rank's WeightSender push as the plan says."""
    groups = plan.by_pusher(sorted(urls))
    reports = await asyncio.gather(*(
        push(rank, [urls[j] for j in engines], plan, version) for rank, engines in groups.items()
    ))
    return SyncReport.merged(plan.transport, version, list(reports))


class SyncTarget(Protocol):
    """The engines a sync loads (the engine pool): their URLs now, each one's control client
    (`serving.client.EngineAdmin`), and the replacement of engine j, lost during the sync of
    `version`, by one that holds `version` when it joins."""

    @property
    def urls(self) -> list[str]: ...

    def admin(self, url: str) -> Any: ...

    async def replace_lost(self, j: int, version: str) -> None: ...


async def sync_engines(plan: SyncPlan, push: Push, engines: SyncTarget, version: str) -> SyncReport:
    """Pause and flush every engine, push `version` to those that answered, replace those that did
    not or failed to load it, then resume every engine and check that it reports `version`."""
    urls = engines.urls
    paused = await asyncio.gather(*(pause(engines.admin(url)) for url in urls), return_exceptions=True)
    lost = {j for j, result in enumerate(paused) if isinstance(result, BaseException)}
    for j in lost:
        if not engine_unreachable(paused[j]):
            raise paused[j]
    report = await run_sync(plan, push, {j: url for j, url in enumerate(urls) if j not in lost}, version)
    for j in sorted(lost | {urls.index(url) for url in report.failed}):
        log.warning("engine %s did not take weights version %s; replacing it", urls[j], version)
        await engines.replace_lost(j, version)
    await asyncio.gather(*(resume_and_check(engines.admin(url), url, version) for url in engines.urls))
    return report


async def pause(admin: Any) -> None:
    """Stop the engine generating and drop its KV cache (it was computed with the old weights)."""
    await admin.pause_generation()
    await admin.flush_cache()


async def resume_and_check(admin: Any, url: str, version: str) -> None:
    await admin.continue_generation()
    got = await admin.get_weight_version()
    if got != version:
        raise RuntimeError(f"engine {url} reports weight version {got!r} after loading {version!r}")

"""Running a sync plan: each pushing trainer rank loads the engines it serves, all at once, and
their reports become one.

The engine pool calls `run_sync` with the engines paused and flushed (and resumes them after);
what a push does on the wire is `sender.WeightSender`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from rlkube_runtime.weight_sync.plan import SyncPlan


@dataclasses.dataclass
class SyncReport:
    """What one sync did: the weight version, the transport, tensor bytes sent to each engine,
    seconds (the slowest pushing rank's), requests per engine, and the engines that failed
    (URL -> error), which the caller replaces."""

    transport: str
    version: str = ""
    bytes_per_engine: int = 0
    seconds: float = 0.0
    requests_per_engine: int = 0
    failed: dict[str, str] = dataclasses.field(default_factory=dict)

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
        return {"perf/update_weights_push_time": self.seconds, "perf/update_weights_bytes": float(self.bytes_per_engine)}


Push = Callable[[int, list[str], SyncPlan, str], Awaitable[SyncReport]]


async def run_sync(plan: SyncPlan, push: Push, urls: dict[int, str], version: str) -> SyncReport:
    """Push `version` to the engines `urls` ({engine index: URL}), each from its rank in `plan`:
    `push(rank, urls, plan, version)` has that rank's WeightSender push as the plan says."""
    groups = plan.by_pusher(sorted(urls))
    reports = await asyncio.gather(*(
        push(rank, [urls[j] for j in engines], plan, version) for rank, engines in groups.items()
    ))
    return SyncReport.merged(plan.transport, version, list(reports))

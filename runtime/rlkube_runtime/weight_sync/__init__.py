"""The whole trainer -> engine weight sync, in SGLang's API shapes.

`plan` decides who sends what to whom (`SyncPlan`: each engine's pushing trainer rank and the
transport); `coordinator` runs a sync (engines paused, the plan run over the pushing ranks,
engines resumed at the new version) and merges what the ranks did into one `SyncReport`; `sender`
is one rank's push through one of four transports: CUDA IPC / shared-memory handles (`tensor`), a
NCCL or gloo broadcast (`distributed`), bytes over HTTP (`http`) or an HF directory on shared
storage (`disk`); `handle_group` gathers the payloads of the ranks on one engine's GPUs for its
pusher (`tensor` into an engine over several GPUs); `buckets` plans which tensors (or blocks of rows) travel together. The loop, the
actors and the backends call these; none of them pushes weights itself.
"""

from importlib import import_module
from typing import TYPE_CHECKING

# Each name's module, imported on first use: `sender` imports torch (seconds), and the rollout
# side (the engine actors, the rollout manager) needs only `plan` and `coordinator`.
_HOMES = {
    "Piece": "buckets", "plan_buckets": "buckets",
    "SyncReport": "coordinator", "SyncTarget": "coordinator", "run_sync": "coordinator",
    "sync_engines": "coordinator",
    "HandleGroup": "handle_group", "HandleGroupError": "handle_group",
    "TRANSPORTS": "plan", "SyncPlan": "plan", "engine_dtype": "plan", "plan_sync": "plan",
    "weight_sync_transport": "plan",
    "WeightSender": "sender",
}
__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from rlkube_runtime.weight_sync.buckets import Piece, plan_buckets
    from rlkube_runtime.weight_sync.coordinator import SyncReport, SyncTarget, run_sync, sync_engines
    from rlkube_runtime.weight_sync.handle_group import HandleGroup, HandleGroupError
    from rlkube_runtime.weight_sync.plan import TRANSPORTS, SyncPlan, engine_dtype, plan_sync, weight_sync_transport
    from rlkube_runtime.weight_sync.sender import WeightSender


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)

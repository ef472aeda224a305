"""The whole trainer -> engine weight sync, in SGLang's API shapes.

`plan` decides who sends what to whom (`SyncPlan`: each engine's pushing trainer rank and the
transport); `coordinator` runs a plan over the pushing ranks and merges what they did into one
`SyncReport`; `sender` is one rank's push through one of four transports: CUDA IPC /
shared-memory handles (`tensor`), a NCCL or gloo broadcast (`distributed`), bytes over HTTP
(`http`) or an HF directory on shared storage (`disk`); `buckets` plans which tensors (or blocks
of rows) travel together. The loop, the actors and the backends call these; none of them pushes
weights itself.
"""

from rlkube_runtime.weight_sync.buckets import Piece, plan_buckets
from rlkube_runtime.weight_sync.coordinator import SyncReport, run_sync
from rlkube_runtime.weight_sync.plan import TRANSPORTS, SyncPlan, engine_dtype, plan_sync, weight_sync_transport
from rlkube_runtime.weight_sync.sender import WeightSender

__all__ = ["Piece", "plan_buckets", "TRANSPORTS", "SyncPlan", "SyncReport", "WeightSender", "engine_dtype", "plan_sync", "run_sync",
           "weight_sync_transport"]

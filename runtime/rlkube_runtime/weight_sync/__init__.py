"""Moving the trainer's weights into the rollout engines, in SGLang's API shapes.

`buckets` plans which tensors (or blocks of rows) travel together; `sender` pushes them through
one of four transports: CUDA IPC / shared-memory handles (`tensor`), a NCCL or gloo broadcast
(`distributed`), bytes over HTTP (`http`) or an HF directory on shared storage (`disk`).
"""

from rlkube_runtime.weight_sync.buckets import Piece, plan_buckets
from rlkube_runtime.weight_sync.sender import TRANSPORTS, SyncReport, WeightSender

__all__ = ["Piece", "plan_buckets", "TRANSPORTS", "SyncReport", "WeightSender"]

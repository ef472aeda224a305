"""Trainer backends and what they share: the batch type, packing, lr schedule, checkpoints.

`TrainerBackend` (backend.py) is the interface the loop calls; `TorchBackend` (torch_backend.py)
implements it on transformers models, `MegatronBackend` (megatron/, imported from there: it needs
megatron-core) on megatron-core. Checkpoint files are written by checkpoint.py, which
knows nothing of models.
"""

from .backend import LogProbs, TrainerBackend
from .batch import TrainBatch
from .checkpoint import Checkpoint, load_latest_checkpoint, save_checkpoint
from .config import (
    BatchingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)
from .torch_backend import TorchBackend

__all__ = [
    "BatchingConfig",
    "Checkpoint",
    "LogProbs",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TorchBackend",
    "TrainBatch",
    "TrainerBackend",
    "TrainerConfig",
    "load_latest_checkpoint",
    "save_checkpoint",
]

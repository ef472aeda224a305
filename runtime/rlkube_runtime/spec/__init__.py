"""The RLJob spec, defined once.

The typed models here are the single definition the CRD schema (`crd.py`), `rlkube validate`
(`validate.py`, `load.py`), the operator's rendering and the runtime's config all derive from.
"""

from .algorithm import AdvantageEstimator, AlgorithmSpec, KlLossType, TisSpec
from .base import API_GROUP, API_VERSION, API_VERSION_NAME, KIND, PLURAL, SHORT_NAMES, SINGULAR, SpecModel
from .checkpoint import CheckpointSpec
from .data import DataSpec, builtin_task_name
from .eval import EvalDatasetSpec, EvalSpec
from .fault_tolerance import FaultToleranceSpec, HealthCheckSpec
from .load import SpecError, load_rljob, load_rljobs, parse_rljob
from .model import ModelSpec
from .observability import MlflowSpec, ObservabilitySpec, WandbSpec
from .parallelism import ParallelismSpec
from .resources import ResourcesSpec, RolloutResources, TrainerResources
from .reward import RewardSpec, RewardType
from .rljob import ObjectMeta, RLJob, RLJobSpec, batch_violations
from .rollout import RolloutSpec
from .status import (
    TERMINAL_PHASES,
    Condition,
    LastCheckpoint,
    LastMetrics,
    Progress,
    Restarts,
    RLJobPhase,
    RLJobStatus,
    SpecRefusal,
    format_progress,
)
from .training import OptimizerSpec, TrainingSpec

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "API_VERSION_NAME",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "TERMINAL_PHASES",
    "AdvantageEstimator",
    "AlgorithmSpec",
    "CheckpointSpec",
    "Condition",
    "DataSpec",
    "EvalDatasetSpec",
    "EvalSpec",
    "FaultToleranceSpec",
    "HealthCheckSpec",
    "KlLossType",
    "LastCheckpoint",
    "LastMetrics",
    "MlflowSpec",
    "ModelSpec",
    "ObjectMeta",
    "ObservabilitySpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "Progress",
    "RLJob",
    "RLJobPhase",
    "RLJobSpec",
    "RLJobStatus",
    "Restarts",
    "ResourcesSpec",
    "RewardSpec",
    "RewardType",
    "RolloutResources",
    "RolloutSpec",
    "SpecError",
    "SpecRefusal",
    "SpecModel",
    "TisSpec",
    "TrainerResources",
    "TrainingSpec",
    "WandbSpec",
    "batch_violations",
    "builtin_task_name",
    "format_progress",
    "load_rljob",
    "load_rljobs",
    "parse_rljob",
]

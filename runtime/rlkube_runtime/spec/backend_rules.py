"""What each trainer backend (spec.training.backend) can honour of spec.parallelism and
spec.model.megatronArgs, refused with one message per field rather than ignored, and which
backend `auto` (the default) chooses.

torch trains data-parallel replicas of the whole model: every setting that splits the model
(tensor, pipeline, sequenceParallel), selective recompute and Megatron arguments need the
megatron backend, which `auto` chooses when any of them is set. megatron puts one model replica
on tensor x pipeline GPUs, so that product must divide the trainer's GPUs (resources.trainer.nodes
x gpusPerNode); sequence parallelism splits along the tensor ranks. Expert parallelism (megatron)
splits a mixture of experts' experts over ranks carved out of the data-parallel ones, so
expert x tensor x pipeline must divide the trainer's GPUs too (whether the model has experts, and
as many as the size divides, is checked where its config.json can be read: model_fit.py).
Neither backend builds context parallelism (megatron-core's needs TransformerEngine's attention):
its size must be 1, whichever backend is asked for.

Each rule is written once as a message template with %d placeholders: Python fills it with `%`
(`backend_violations`, run by `rlkube validate`, the operator and the runtime) and the CRD's CEL
with `.format()` (`BACKEND_RULES`), so the API server and `rlkube validate` refuse the same specs in
the same words. megatronArgs has no CEL side: its values are untyped in the CRD, which hides the
map from CEL ("undefined field"). So the API server takes a spec whose megatronArgs name an
unknown key, or whose megatronArgs alone make `auto` choose megatron where megatron refuses
float16; the operator, which validates with these models, fails it at once with reason InvalidSpec.
"""

from __future__ import annotations

from typing import Any, Mapping

from .lora import LORA_MEGATRON_MESSAGE
from .megatron_args import megatron_args_violations

_P = "self.parallelism"
_T = "self.resources.trainer"
_IS_TORCH = "self.training.backend == 'torch'"
_TRAINER_GPUS = f"{_T}.nodes * {_T}.gpusPerNode"
_USE_MEGATRON = "set spec.training.backend: megatron (or auto)"

# The sizes that split the model over GPUs; the torch backend has none of them.
MODEL_SPLIT_SIZES = ("tensor", "pipeline", "context", "expert")

TORCH_SIZE_MESSAGE = (
    "{field}(%d) > 1 splits the model over GPUs, which the torch backend cannot do (it trains whole-model "
    f"data-parallel replicas); {_USE_MEGATRON}"
)
TORCH_SEQUENCE_PARALLEL_MESSAGE = (
    "sequenceParallel splits activations along tensor-parallel ranks, which the torch backend does not have; "
    f"{_USE_MEGATRON}"
)
TORCH_SELECTIVE_RECOMPUTE_MESSAGE = (
    "recompute: selective (attention only) is not available in the torch backend, which recomputes whole layers "
    f"(recompute: full); {_USE_MEGATRON}"
)
TORCH_MEGATRON_ARGS_MESSAGE = (
    f"holds %d Megatron-core argument(s), which the torch backend does not read; {_USE_MEGATRON}, or remove them"
)
REPLICA_FIT_MESSAGE = (
    "tensor(%d) x pipeline(%d) = %d GPUs per model replica must divide the trainer GPUs, "
    "resources.trainer.nodes(%d) x gpusPerNode(%d) = %d"
)
SEQUENCE_PARALLEL_MESSAGE = (
    "sequenceParallel splits activations along the tensor-parallel ranks and needs tensor > 1, got tensor(%d)"
)
CONTEXT_MESSAGE = (
    "context(%d) > 1: context parallelism is not built (Megatron-core needs TransformerEngine attention for it; "
    "the megatron backend runs the local layer spec on torch SDPA); use 1"
)
EXPERT_FIT_MESSAGE = (
    "expert(%d) x expertTensor(%d) x pipeline(%d) = %d GPUs must divide the trainer GPUs, "
    "resources.trainer.nodes(%d) x gpusPerNode(%d) = %d (expert-parallel ranks are data-parallel ranks that "
    "split the experts among them; expertTensor is the tensor size unless set)"
)
TORCH_EXPERT_TENSOR_MESSAGE = (
    "expertTensor(%d) > 1 splits each expert over GPUs, which the torch backend cannot do; "
    f"{_USE_MEGATRON}"
)
TORCH_ROUTING_REPLAY_MESSAGE = (
    "routingReplay has the trainer's routers take the engine's experts, which the torch backend (transformers' "
    f"own MoE layers) cannot do; {_USE_MEGATRON}"
)
PIPELINE_ROUTING_REPLAY_MESSAGE = (
    "routingReplay with parallelism.pipeline(%d) > 1 is not built (the pipeline schedule interleaves micro-batches, "
    "so the routers of every stage would need the routes of the micro-batch they run); use pipeline 1"
)
FLOAT16_MESSAGE = (
    "float16 needs loss scaling, which the megatron backend does not do; use bfloat16 (or float32), or the torch "
    "backend"
)

# CEL: the spec's backend is megatron, or auto with something only megatron does (megatronArgs
# aside: CEL cannot see them).
_ROUTING_REPLAY = "(has(self.training.routingReplay) && self.training.routingReplay)"
_CHOOSES_MEGATRON = (
    f"(self.training.backend == 'megatron' || (self.training.backend == 'auto' && ({_ROUTING_REPLAY} || "
    "(has(self.parallelism) && ("
    + " || ".join(f"{_P}.{size} > 1" for size in MODEL_SPLIT_SIZES)
    + f" || {_P}.sequenceParallel || {_P}.recompute == 'selective'"
    + f" || (has({_P}.expertTensor) && {_P}.expertTensor > 1))))))"
)


def _cel_message(template: str, args: list[str]) -> str:
    return f"'{template}'.format([{', '.join(args)}])"


def _fits(group: str) -> str:
    """CEL: `group` GPUs divide the trainer's (a group of 1 always fits)."""
    return f"{group} == 1 || ({_TRAINER_GPUS} >= {group} && ({_TRAINER_GPUS}) % ({group}) == 0)"


_REPLICA = f"{_P}.tensor * {_P}.pipeline"
_EXPERT_TENSOR = f"(has({_P}.expertTensor) ? {_P}.expertTensor : {_P}.tensor)"
_EXPERT_GROUP = f"{_P}.expert * {_EXPERT_TENSOR} * {_P}.pipeline"

BACKEND_RULES: tuple[dict[str, str], ...] = (
    *(
        {
            "rule": f"!has(self.parallelism) || !({_IS_TORCH}) || {_P}.{size} == 1",
            "messageExpression": _cel_message(TORCH_SIZE_MESSAGE.format(field=size), [f"{_P}.{size}"]),
            "fieldPath": f".parallelism.{size}",
        }
        for size in ("tensor", "pipeline", "expert")
    ),
    {
        "rule": f"!has(self.parallelism) || !({_IS_TORCH}) || !has({_P}.expertTensor) || {_P}.expertTensor == 1",
        "messageExpression": _cel_message(TORCH_EXPERT_TENSOR_MESSAGE, [f"{_P}.expertTensor"]),
        "fieldPath": ".parallelism.expertTensor",
    },
    {
        "rule": f"!has(self.parallelism) || {_P}.context == 1",
        "messageExpression": _cel_message(CONTEXT_MESSAGE, [f"{_P}.context"]),
        "fieldPath": ".parallelism.context",
    },
    {
        "rule": f"!has(self.parallelism) || !({_IS_TORCH}) || !{_P}.sequenceParallel",
        "message": TORCH_SEQUENCE_PARALLEL_MESSAGE,
        "fieldPath": ".parallelism.sequenceParallel",
    },
    {
        "rule": f"!has(self.parallelism) || !({_IS_TORCH}) || {_P}.recompute != 'selective'",
        "message": TORCH_SELECTIVE_RECOMPUTE_MESSAGE,
        "fieldPath": ".parallelism.recompute",
    },
    {
        "rule": f"!has(self.parallelism) || !{_CHOOSES_MEGATRON} || {_fits(_REPLICA)}",
        "messageExpression": _cel_message(
            REPLICA_FIT_MESSAGE,
            [f"{_P}.tensor", f"{_P}.pipeline", _REPLICA, f"{_T}.nodes", f"{_T}.gpusPerNode", _TRAINER_GPUS],
        ),
        "fieldPath": ".parallelism",
    },
    {
        "rule": f"!has(self.parallelism) || !{_CHOOSES_MEGATRON} || {_P}.expert == 1 || {_fits(_EXPERT_GROUP)}",
        "messageExpression": _cel_message(
            EXPERT_FIT_MESSAGE,
            [f"{_P}.expert", _EXPERT_TENSOR, f"{_P}.pipeline", _EXPERT_GROUP, f"{_T}.nodes", f"{_T}.gpusPerNode",
             _TRAINER_GPUS],
        ),
        "fieldPath": ".parallelism.expert",
    },
    {
        "rule": f"!has(self.parallelism) || !{_CHOOSES_MEGATRON} || !{_P}.sequenceParallel || {_P}.tensor > 1",
        "messageExpression": _cel_message(SEQUENCE_PARALLEL_MESSAGE, [f"{_P}.tensor"]),
        "fieldPath": ".parallelism.sequenceParallel",
    },
    {
        "rule": f"!({_IS_TORCH}) || !{_ROUTING_REPLAY}",
        "message": TORCH_ROUTING_REPLAY_MESSAGE,
        "fieldPath": ".training.routingReplay",
    },
    {
        "rule": f"!has(self.parallelism) || {_P}.pipeline == 1 || !{_ROUTING_REPLAY}",
        "messageExpression": _cel_message(PIPELINE_ROUTING_REPLAY_MESSAGE, [f"{_P}.pipeline"]),
        "fieldPath": ".training.routingReplay",
    },
    {
        "rule": f"!has(self.training.lora) || !{_CHOOSES_MEGATRON}",
        "message": LORA_MEGATRON_MESSAGE,
        "fieldPath": ".training.lora",
    },
    {
        "rule": f"!{_CHOOSES_MEGATRON} || !has(self.model) || !has(self.model.dtype) || self.model.dtype != 'float16'",
        "message": FLOAT16_MESSAGE,
        "fieldPath": ".model.dtype",
    },
)


def chosen_backend(spec: Any, model_config: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """(backend, why): spec.training.backend, or for `auto` megatron when anything only megatron
    does is asked for, or when the model (its config.json, where it can be read) is a mixture of
    experts (megatron runs its experts as one layer, the torch backend one expert after another);
    torch otherwise."""
    backend = spec.training.backend
    if backend != "auto":
        return backend, "spec.training.backend"
    par = spec.parallelism
    for size in MODEL_SPLIT_SIZES:
        if getattr(par, size) > 1:
            return "megatron", f"spec.parallelism.{size} is {getattr(par, size)}"
    if par.sequence_parallel:
        return "megatron", "spec.parallelism.sequenceParallel is on"
    if (par.expert_tensor or 1) > 1:
        return "megatron", f"spec.parallelism.expertTensor is {par.expert_tensor}"
    if par.recompute == "selective":
        return "megatron", "spec.parallelism.recompute is selective"
    if spec.model.megatron_args:
        return "megatron", "spec.model.megatronArgs is set"
    if spec.training.routing_replay:
        return "megatron", "spec.training.routingReplay is on"
    if spec.training.lora is not None:
        return "torch", "spec.training.lora is set (peft trains the adapter)"
    if model_config is not None:
        from .model_fit import expert_count_key

        key = expert_count_key(model_config)
        if key:
            return "megatron", f"the model is a mixture of experts (config.json {key}: {model_config[key]})"
    return "torch", "no parallelism size above 1, no megatronArgs, a dense model"


def with_backend(spec: Any, backend: str) -> Any:
    """A copy of `spec` (an RLJobSpec) whose training.backend is `backend`: what `auto` chose,
    made explicit for the trainer ranks, which do not read the model's config to choose."""
    return spec.model_copy(update={"training": spec.training.model_copy(update={"backend": backend})})


def _divides(group: int, gpus: int) -> bool:
    """`group` GPUs divide the trainer's `gpus` (a group of 1 always does): `_fits` in Python."""
    return group == 1 or (gpus >= group and gpus % group == 0)


def backend_violations(spec: Any) -> list[tuple[str, str]]:
    """The settings of `spec` (an RLJobSpec) its trainer backend cannot honour, as (path relative to
    spec, message) pairs in BACKEND_RULES' order; empty when it can honour them all."""
    par, trainer = spec.parallelism, spec.resources.trainer
    backend, _ = chosen_backend(spec)
    violations: list[tuple[str, str]] = []
    if backend == "torch":
        for size in ("tensor", "pipeline", "expert"):
            value = getattr(par, size)
            if value != 1:
                violations.append((f"parallelism.{size}", TORCH_SIZE_MESSAGE.format(field=size) % value))
        if (par.expert_tensor or 1) != 1:
            violations.append(("parallelism.expertTensor", TORCH_EXPERT_TENSOR_MESSAGE % par.expert_tensor))
    if par.context != 1:
        violations.append(("parallelism.context", CONTEXT_MESSAGE % par.context))
    if backend == "torch":
        if par.sequence_parallel:
            violations.append(("parallelism.sequenceParallel", TORCH_SEQUENCE_PARALLEL_MESSAGE))
        if par.recompute == "selective":
            violations.append(("parallelism.recompute", TORCH_SELECTIVE_RECOMPUTE_MESSAGE))
        if spec.model.megatron_args:
            violations.append(("model.megatronArgs", TORCH_MEGATRON_ARGS_MESSAGE % len(spec.model.megatron_args)))
        if spec.training.routing_replay:
            violations.append(("training.routingReplay", TORCH_ROUTING_REPLAY_MESSAGE))
    if spec.training.routing_replay and par.pipeline != 1:
        violations.append(("training.routingReplay", PIPELINE_ROUTING_REPLAY_MESSAGE % par.pipeline))
    if backend == "megatron" and spec.training.lora is not None:
        violations.append(("training.lora", LORA_MEGATRON_MESSAGE))
    if backend == "megatron":
        gpus = trainer.nodes * trainer.gpus_per_node
        group = par.tensor * par.pipeline
        if not _divides(group, gpus):
            violations.append(("parallelism", REPLICA_FIT_MESSAGE % (
                par.tensor, par.pipeline, group, trainer.nodes, trainer.gpus_per_node, gpus)))
        expert_tensor = par.expert_tensor or par.tensor
        experts = par.expert * expert_tensor * par.pipeline
        if par.expert != 1 and not _divides(experts, gpus):
            violations.append(("parallelism.expert", EXPERT_FIT_MESSAGE % (
                par.expert, expert_tensor, par.pipeline, experts, trainer.nodes, trainer.gpus_per_node, gpus)))
        if par.sequence_parallel and par.tensor == 1:
            violations.append(("parallelism.sequenceParallel", SEQUENCE_PARALLEL_MESSAGE % par.tensor))
        if spec.model.dtype == "float16":
            violations.append(("model.dtype", FLOAT16_MESSAGE))
        violations += megatron_args_violations(spec.model.megatron_args, pipeline=par.pipeline, expert=par.expert)
    return violations

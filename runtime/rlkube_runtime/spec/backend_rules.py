"""What each trainer backend (spec.training.backend) can honour of spec.parallelism and
spec.model.megatronArgs, refused with one message per field rather than ignored.

torch trains data-parallel replicas of the whole model: every setting that splits the model
(tensor, pipeline, context, expert, sequenceParallel), selective recompute and Megatron arguments
need the megatron backend. megatron puts one model replica on tensor x pipeline x context GPUs, so
that product must divide the trainer's GPUs (resources.trainer.nodes x gpusPerNode); its expert
groups take expert x tensor x pipeline GPUs (Megatron-core's expert tensor size defaults to
tensor), which must divide them too; sequence parallelism splits along the tensor ranks.

Each rule is written once as a message template with %d placeholders: Python fills it with `%`
(`backend_violations`, run by `rlkube validate`, the operator and the runtime) and the CRD's CEL
with `.format()` (`BACKEND_RULES`), so the API server and `rlkube validate` refuse the same specs in
the same words. One rule has no CEL side: megatronArgs' values are untyped in the CRD, which hides
the map from CEL ("undefined field"); the API server takes such a spec and the operator, which
validates with these models, fails it at once with reason InvalidSpec.
"""

from __future__ import annotations

from typing import Any

_P = "self.parallelism"
_T = "self.resources.trainer"
_NOT_TORCH = "self.training.backend != 'torch'"
_NOT_MEGATRON = "self.training.backend != 'megatron'"
_TRAINER_GPUS = f"{_T}.nodes * {_T}.gpusPerNode"
_USE_MEGATRON = "set spec.training.backend: megatron"

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
    "tensor(%d) x pipeline(%d) x context(%d) = %d GPUs per model replica must divide the trainer GPUs, "
    "resources.trainer.nodes(%d) x gpusPerNode(%d) = %d"
)
EXPERT_FIT_MESSAGE = (
    "expert(%d) x tensor(%d) x pipeline(%d) = %d GPUs per expert-parallel group must divide the trainer GPUs, "
    "resources.trainer.nodes(%d) x gpusPerNode(%d) = %d"
)
SEQUENCE_PARALLEL_MESSAGE = (
    "sequenceParallel splits activations along the tensor-parallel ranks and needs tensor > 1, got tensor(%d)"
)


def _cel_message(template: str, args: list[str]) -> str:
    return f"'{template}'.format([{', '.join(args)}])"


def _fits(group: str) -> str:
    """CEL: `group` GPUs divide the trainer's (a group of 1 always fits)."""
    return f"{group} == 1 || ({_TRAINER_GPUS} >= {group} && ({_TRAINER_GPUS}) % ({group}) == 0)"


def _fit_rule(
    template: str, sizes: tuple[str, str, str], field_path: str, *, unless: str | None = None
) -> dict[str, str]:
    """A group of sizes[0] x sizes[1] x sizes[2] GPUs must divide the trainer's (`unless` CEL holds)."""
    group = " * ".join(f"{_P}.{s}" for s in sizes)
    args = [*(f"{_P}.{s}" for s in sizes), group, f"{_T}.nodes", f"{_T}.gpusPerNode", _TRAINER_GPUS]
    return {
        "rule": " || ".join(c for c in ("!has(self.parallelism)", _NOT_MEGATRON, unless, _fits(group)) if c),
        "messageExpression": _cel_message(template, args),
        "fieldPath": field_path,
    }


BACKEND_RULES: tuple[dict[str, str], ...] = (
    *(
        {
            "rule": f"!has(self.parallelism) || {_NOT_TORCH} || {_P}.{size} == 1",
            "messageExpression": _cel_message(TORCH_SIZE_MESSAGE.format(field=size), [f"{_P}.{size}"]),
            "fieldPath": f".parallelism.{size}",
        }
        for size in MODEL_SPLIT_SIZES
    ),
    {
        "rule": f"!has(self.parallelism) || {_NOT_TORCH} || !{_P}.sequenceParallel",
        "message": TORCH_SEQUENCE_PARALLEL_MESSAGE,
        "fieldPath": ".parallelism.sequenceParallel",
    },
    {
        "rule": f"!has(self.parallelism) || {_NOT_TORCH} || {_P}.recompute != 'selective'",
        "message": TORCH_SELECTIVE_RECOMPUTE_MESSAGE,
        "fieldPath": ".parallelism.recompute",
    },
    _fit_rule(REPLICA_FIT_MESSAGE, ("tensor", "pipeline", "context"), ".parallelism"),
    # With expert 1 the expert group divides a replica, which the rule above checks.
    _fit_rule(EXPERT_FIT_MESSAGE, ("expert", "tensor", "pipeline"), ".parallelism.expert", unless=f"{_P}.expert == 1"),
    {
        "rule": f"!has(self.parallelism) || {_NOT_MEGATRON} || !{_P}.sequenceParallel || {_P}.tensor > 1",
        "messageExpression": _cel_message(SEQUENCE_PARALLEL_MESSAGE, [f"{_P}.tensor"]),
        "fieldPath": ".parallelism.sequenceParallel",
    },
)


def backend_violations(spec: Any) -> list[tuple[str, str]]:
    """The settings of `spec` (an RLJobSpec) its trainer backend cannot honour, as (path relative to
    spec, message) pairs in BACKEND_RULES' order; empty when it can honour them all."""
    par, trainer, backend = spec.parallelism, spec.resources.trainer, spec.training.backend
    violations: list[tuple[str, str]] = []
    if backend == "torch":
        for size in MODEL_SPLIT_SIZES:
            value = getattr(par, size)
            if value != 1:
                violations.append((f"parallelism.{size}", TORCH_SIZE_MESSAGE.format(field=size) % value))
        if par.sequence_parallel:
            violations.append(("parallelism.sequenceParallel", TORCH_SEQUENCE_PARALLEL_MESSAGE))
        if par.recompute == "selective":
            violations.append(("parallelism.recompute", TORCH_SELECTIVE_RECOMPUTE_MESSAGE))
        if spec.model.megatron_args:
            violations.append(("model.megatronArgs", TORCH_MEGATRON_ARGS_MESSAGE % len(spec.model.megatron_args)))
    if backend == "megatron":
        gpus = trainer.nodes * trainer.gpus_per_node
        for template, sizes, path, checked in (
            (REPLICA_FIT_MESSAGE, (par.tensor, par.pipeline, par.context), "parallelism", True),
            (EXPERT_FIT_MESSAGE, (par.expert, par.tensor, par.pipeline), "parallelism.expert", par.expert != 1),
        ):
            group = sizes[0] * sizes[1] * sizes[2]
            if checked and group != 1 and (gpus < group or gpus % group):
                violations.append((path, template % (*sizes, group, trainer.nodes, trainer.gpus_per_node, gpus)))
        if par.sequence_parallel and par.tensor == 1:
            violations.append(("parallelism.sequenceParallel", SEQUENCE_PARALLEL_MESSAGE % par.tensor))
    return violations

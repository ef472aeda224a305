"""One set of rules: which backend `auto` chooses, the megatronArgs keys the spec knows without
megatron-core, and the model's own shape checked wherever its config.json can be read, so
`rlkube validate` refuses what `rlkube run` would."""

from __future__ import annotations

import json

import pytest
import yaml

from rlkube_runtime.cli import main as rlkube
from rlkube_runtime.spec.backend_rules import backend_violations, chosen_backend
from rlkube_runtime.spec.load import parse_rljob
from rlkube_runtime.spec.megatron_args import megatron_arg_problem, megatron_arg_target
from rlkube_runtime.spec.model_fit import expert_count_key, model_fit_violations, split_violations

# Qwen3-0.6B's shape: 16 heads, 8 key/value heads, 28 layers.
QWEN3_SMALL = {"model_type": "qwen3", "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936,
               "intermediate_size": 3072, "num_hidden_layers": 28}


def _spec(good_doc, **sections):
    for name, values in sections.items():
        good_doc["spec"][name] = {**good_doc["spec"].get(name, {}), **values}
    return parse_rljob(good_doc).spec


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({}, ("torch", "no parallelism size above 1, no megatronArgs, a dense model")),
        ({"parallelism": {"tensor": 2}}, ("megatron", "spec.parallelism.tensor is 2")),
        ({"parallelism": {"pipeline": 2}}, ("megatron", "spec.parallelism.pipeline is 2")),
        ({"parallelism": {"recompute": "selective"}}, ("megatron", "spec.parallelism.recompute is selective")),
        ({"model": {"megatronArgs": {"attention-softmax-in-fp32": True}}}, ("megatron", "spec.model.megatronArgs is set")),
        ({"training": {"backend": "torch"}}, ("torch", "spec.training.backend")),
        ({"training": {"backend": "megatron"}}, ("megatron", "spec.training.backend")),
    ],
)
def test_auto_chooses_megatron_only_for_what_only_megatron_does(good_doc, sections, expected):
    assert parse_rljob(good_doc).spec.training.backend == "auto"
    assert chosen_backend(_spec(good_doc, **sections)) == expected


def test_auto_chooses_megatron_for_a_mixture_of_experts_and_then_holds_it_to_megatrons_rules(good_doc):
    moe = {**QWEN3_SMALL, "model_type": "qwen3_moe", "num_experts": 8}
    spec = parse_rljob(good_doc).spec
    assert chosen_backend(spec, QWEN3_SMALL)[0] == "torch"
    assert chosen_backend(spec, moe) == ("megatron", "the model is a mixture of experts (config.json num_experts: 8)")
    # float16 is fine for the torch backend; auto on this model chose megatron, which refuses it.
    half = _spec(good_doc, model={"dtype": "float16"})
    assert model_fit_violations(half, QWEN3_SMALL) == []
    assert [path for path, _ in model_fit_violations(half, moe)] == ["model.dtype"]
    assert chosen_backend(_spec(good_doc, training={"backend": "torch"}), moe) == ("torch", "spec.training.backend")
    assert model_fit_violations(_spec(good_doc, training={"backend": "torch"}), moe) == []


def test_expert_tensor_parallelism_fits_the_experts_and_a_split_mixture_of_experts_needs_sequence_parallelism(good_doc):
    import copy

    moe = {**QWEN3_SMALL, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 768}

    def spec(**parallelism):
        return _spec(copy.deepcopy(good_doc), parallelism=parallelism, resources={"trainer": {"nodes": 1, "gpusPerNode": 2}})

    whole_experts = spec(tensor=2, expert=2, expertTensor=1, sequenceParallel=True)  # 2 x 1 x 1 fits 2 GPUs
    assert backend_violations(whole_experts) == [] and model_fit_violations(whole_experts, moe) == []
    assert [path for path, _ in model_fit_violations(whole_experts, QWEN3_SMALL)] == ["parallelism.expert"]  # dense
    assert chosen_backend(spec(expertTensor=2))[0] == "megatron"
    odd = spec(tensor=2, expertTensor=5, sequenceParallel=True)
    assert ("parallelism.expertTensor", "5 does not divide the model's 768 expert MLP channels "
            "(moe_intermediate_size)") in model_fit_violations(odd, moe)
    no_sp = spec(tensor=2)
    assert ("parallelism.sequenceParallel", "megatron-core trains a mixture of experts over tensor (2) ranks only "
            "with sequence parallelism; set it true") in model_fit_violations(no_sp, moe)
    assert model_fit_violations(no_sp, QWEN3_SMALL) == []  # a dense model splits without it
    # Converting a checkpoint trains nothing: there the split needs no sequence parallelism.
    assert split_violations(2, 1, moe, sequence_parallel=None) == []
    assert [path for path, _ in split_violations(2, 1, moe, sequence_parallel=False)] == ["parallelism.sequenceParallel"]


def test_load_balancing_losses_are_refused_on_a_dense_model_and_accepted_on_a_mixture_of_experts(good_doc):
    moe = {**QWEN3_SMALL, "model_type": "qwen3_moe", "num_experts": 8}
    spec = _spec(good_doc, model={"megatronArgs": {"moe-aux-loss-coeff": 0.01, "moe_z_loss_coeff": 0.001}})
    assert model_fit_violations(spec, moe) == []
    assert model_fit_violations(spec, QWEN3_SMALL) == [
        (f"model.megatronArgs.{key}", "a mixture-of-experts loss, and the model (config.json model_type "
         f"{QWEN3_SMALL['model_type']!r}) has no experts; remove it") for key in ("moe-aux-loss-coeff", "moe_z_loss_coeff")]


def test_routing_replay_makes_auto_choose_megatron_and_needs_a_mixture_of_experts(good_doc):
    moe = {**QWEN3_SMALL, "model_type": "qwen3_moe", "num_experts": 8}
    spec = _spec(good_doc, training={"routingReplay": True})
    assert chosen_backend(spec) == ("megatron", "spec.training.routingReplay is on")
    assert backend_violations(spec) == [] and model_fit_violations(spec, moe) == []
    assert model_fit_violations(spec, QWEN3_SMALL) == [
        ("training.routingReplay", "replays a mixture of experts' routing, and the model (config.json model_type "
         f"{QWEN3_SMALL['model_type']!r}) has no experts; leave it false")]


def test_megatron_arg_keys_are_checked_against_megatron_cores_fields():
    assert megatron_arg_problem("attention-softmax-in-fp32", True) is None
    assert megatron_arg_problem("--hidden-dropout", 0.0) is None  # dashes and underscores both name the field
    assert megatron_arg_problem("hidden_dropout", 1) is None  # an int is a float
    assert megatron_arg_problem("hidden-dropout", True) == "True is not a float, the type of megatron-core's hidden_dropout"
    assert megatron_arg_problem("virtual-pipeline-model-parallel-size", None) is None  # Optional[int]
    assert megatron_arg_problem("bias-activation-fusion", False) is None  # false: the flag left at its default
    assert megatron_arg_problem("no-such-flag", False).startswith("not a field of megatron-core")
    assert megatron_arg_problem("clip-grad", 1.0) == "set by spec.training.optimizer.clipGrad; remove it here"
    assert megatron_arg_target("use-precision-aware-optimizer") == "optimizer"
    assert megatron_arg_target("attention-softmax-in-fp32") == "model"
    assert megatron_arg_problem("moe-aux-loss-coeff", 0.01) is None
    assert megatron_arg_problem("moe-z-loss-coeff", None) is None  # null: megatron-core's own default
    assert megatron_arg_problem("moe-router-load-balancing-type", "seq_aux_loss") is None
    assert megatron_arg_problem("moe-aux-loss-coeff", [0.01]) == "[0.01] is not a float >= 0"


def test_generated_megatron_fields_match_the_installed_megatron_core():
    from pathlib import Path

    megatron_core = pytest.importorskip("megatron.core")
    from rlkube_runtime.spec import megatron_args, megatron_fields

    if megatron_core.__version__ != megatron_fields.MEGATRON_CORE_VERSION:
        pytest.skip(f"megatron-core {megatron_core.__version__} here; the fields are of "
                    f"{megatron_fields.MEGATRON_CORE_VERSION}, the images' version")
    committed = Path(megatron_fields.__file__).read_text()
    assert committed == megatron_args.render_fields_module(), (
        "spec/megatron_fields.py is stale: python -m rlkube_runtime.spec.megatron_args "
        "> runtime/rlkube_runtime/spec/megatron_fields.py")


def test_split_violations_name_what_the_size_does_not_divide():
    assert split_violations(2, 4, QWEN3_SMALL) == []
    assert split_violations(16, 1, QWEN3_SMALL) == [("parallelism.tensor", "16 does not divide the model's 8 key/value heads")]
    assert split_violations(3, 3, QWEN3_SMALL) == [
        ("parallelism.tensor", "3 does not divide the model's 16 attention heads"),
        ("parallelism.tensor", "3 does not divide the model's 8 key/value heads"),
        ("parallelism.tensor", "3 does not divide the model's 151936 vocabulary entries"),
        ("parallelism.pipeline", "3 does not divide the model's 28 layers"),
    ]


def test_expert_parallelism_needs_experts_it_divides(good_doc):
    moe = {**QWEN3_SMALL, "model_type": "qwen3_moe", "num_experts": 8}
    assert split_violations(1, 1, moe, expert=4) == []
    assert split_violations(1, 1, moe, expert=3) == [("parallelism.expert", "3 does not divide the model's 8 experts")]
    assert split_violations(1, 1, QWEN3_SMALL, expert=2) == [
        ("parallelism.expert", "2 splits a mixture of experts' experts; the model (qwen3) is dense")]
    ep2 = _spec(good_doc, parallelism={"expert": 2})
    assert model_fit_violations(ep2, moe) == []
    assert model_fit_violations(ep2, QWEN3_SMALL) == [
        ("parallelism.expert", "2 splits a mixture of experts' experts; the model (qwen3) is dense")]


def test_model_fit_takes_qwen3_moe_and_refuses_other_mixtures_of_experts_and_unknown_architectures(good_doc):
    torch_spec = parse_rljob(good_doc).spec
    assert expert_count_key(QWEN3_SMALL) is None
    assert expert_count_key({**QWEN3_SMALL, "num_experts": 1}) is None
    moe = {**QWEN3_SMALL, "model_type": "qwen3_moe", "num_experts": 128}
    assert model_fit_violations(torch_spec, moe) == []
    assert model_fit_violations(_spec(good_doc, parallelism={"tensor": 2, "sequenceParallel": True}), moe) == []
    assert model_fit_violations(torch_spec, {**moe, "model_type": "mixtral", "num_local_experts": 8}) == [(
        "model", "config.json num_experts: 128: a mixture-of-experts model of type 'mixtral'; RL jobs run the MoE "
        "types ['qwen3_moe']")]
    assert model_fit_violations(torch_spec, {**QWEN3_SMALL, "model_type": "gpt2"}) == []  # torch trains any causal LM
    tp2 = _spec(good_doc, parallelism={"tensor": 2})
    assert model_fit_violations(tp2, QWEN3_SMALL) == []
    assert model_fit_violations(tp2, {**QWEN3_SMALL, "model_type": "gpt2"}) == [(
        "training.backend", "megatron converts HF model types ['llama', 'qwen2', 'qwen3', 'qwen3_moe']; the checkpoint's "
        "config.json has model_type 'gpt2'")]


def test_validate_reads_a_local_checkpoints_config(tmp_path, capsys, good_doc):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN3_SMALL))
    del good_doc["spec"]["model"]["preset"]
    good_doc["spec"]["model"]["hfCheckpoint"] = str(model_dir)
    good_doc["spec"]["parallelism"] = {"tensor": 4, "pipeline": 2}  # 4 divides the heads, 2 the 28 layers
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(good_doc))
    assert rlkube(["validate", str(path)]) == 0
    good_doc["spec"]["parallelism"] = {"pipeline": 8}
    path.write_text(yaml.safe_dump(good_doc))
    assert rlkube(["validate", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"{path}: doc 1 (good): spec.parallelism.pipeline: 8 does not divide the model's 28 layers\n")
    good_doc["spec"]["model"]["hfCheckpoint"] = "Qwen/Qwen3-0.6B"  # a hub id: its config is not read here
    path.write_text(yaml.safe_dump(good_doc))
    assert rlkube(["validate", str(path)]) == 0

"""Blockwise fp8 (e4m3) quantization of the weights an fp8 rollout serves (rlkube_runtime/fp8.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlkube_runtime import fp8


def test_a_small_matrix_quantizes_to_the_hand_computed_scales_and_e4m3_values():
    # 2 x 2 blocks over a 3 x 3 matrix: blocks (0,0) [[1,-2],[4,3]], (0,1) [[.5],[0]], and two
    # ragged all-zero blocks in the last row.
    w = torch.tensor([[1.0, -2.0, 0.5], [4.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    q, scale = fp8.quantize_blockwise(w, block=(2, 2))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 3)
    assert scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert scale[0, 0] == pytest.approx(4 / 448) and scale[0, 1] == pytest.approx(0.5 / 448)
    # All-zero blocks: the scale is EPS/448 (positive), never 0 or NaN.
    assert scale[1, 0] == scale[1, 1] == pytest.approx(1e-10 / 448)
    assert bool((scale > 0).all()) and not bool(scale.isnan().any())
    # The block's absmax maps to 448; 1 x 112 and -2 x 112 are e4m3 values; 3 x 112 = 336 lies
    # halfway between 320 and 352 and rounds to the even mantissa, 320.
    assert q.float().tolist() == [[112.0, -224.0, 448.0], [448.0, 320.0, 0.0], [0.0, 0.0, 0.0]]
    back = fp8.dequantize_blockwise(q, scale, block=(2, 2))
    assert back[1, 1] == pytest.approx(320 / 112)
    assert back[0, :].tolist() == pytest.approx([1.0, -2.0, 0.5])
    assert back[2, :].tolist() == [0.0, 0.0, 0.0]


def test_an_all_zero_weight_round_trips_to_zeros_without_nan():
    q, scale = fp8.quantize_blockwise(torch.zeros(130, 7))
    assert scale.shape == (2, 1) and bool((scale > 0).all())
    assert torch.equal(fp8.dequantize_blockwise(q, scale), torch.zeros(130, 7))


@pytest.mark.parametrize("shape", [(256, 384), (200, 72), (5, 300), (1, 1)])
def test_the_round_trip_error_is_within_e4m3_precision_of_each_block(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitude
    q, scale = fp8.quantize_blockwise(w)
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    err = (fp8.dequantize_blockwise(q, scale) - w).abs()
    # 3 mantissa bits: half a step is 1/16 of a normal value; below the normals, half the
    # subnormal step 2^-9 of the block's scale.
    per_entry = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert bool((err <= w.abs() / 16 + per_entry * 2**-10 + 1e-12).all())
    # And no entry is off by more than half the widest step (32 near 448) of its block.
    assert bool((err <= per_entry * 16 + 1e-12).all())


def _slime_blockwise(x: torch.Tensor, block=(128, 128)):
    """slime's _blockwise_cast_to_fp8_triton, one block at a time in float32."""
    m, n = x.shape
    bm, bn = block
    y = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(m / bm), math.ceil(n / bn))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].float()
            x_s = torch.clamp(tile.abs().max(), min=1e-10) / 448.0
            s[i, j] = x_s
            y[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = torch.clamp(tile * (1.0 / x_s), -448.0, 448.0).to(y.dtype)
    return y, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_slimes_per_block_formula_bit_for_bit_on_random_input(dtype):
    torch.manual_seed(1)
    w = (torch.randn(300, 260) * 0.02).to(dtype)
    w[:128, :128] = 0  # one all-zero block
    q, scale = fp8.quantize_blockwise(w)
    ref_q, ref_s = _slime_blockwise(w)
    assert torch.equal(scale, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_only_decoder_linear_projection_weights_are_quantized():
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.11.self_attn.o_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.layers.2.mlp.experts.7.up_proj.weight",
                 "model.layers.2.mlp.shared_expert.gate_proj.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate.weight"]
    assert all(fp8.is_quantized_name(n, (8, 8)) for n in quantized)
    assert not any(fp8.is_quantized_name(n, (8, 8)) for n in kept)
    assert not fp8.is_quantized_name("model.layers.0.self_attn.q_proj.weight", (8,))  # 2-D only
    named = fp8.quantize_named("model.layers.0.mlp.up_proj.weight", torch.ones(3, 4))
    assert [(n, t.dtype, tuple(t.shape)) for n, t in named] == [
        ("model.layers.0.mlp.up_proj.weight", torch.float8_e4m3fn, (3, 4)),
        ("model.layers.0.mlp.up_proj.weight_scale_inv", torch.float32, (1, 1))]
    assert fp8.quantized_nbytes((300, 200)) == 300 * 200 + 4 * 3 * 2


def test_dequantize_named_pairs_weights_with_scales_and_row_splits_on_block_boundaries():
    torch.manual_seed(2)
    w = torch.randn(300, 20)
    q, s = fp8.quantize_blockwise(w)
    whole = fp8.dequantize_blockwise(q, s)
    name = "model.layers.0.mlp.down_proj.weight"
    # Rows [128, 300) with scale rows [1, 3): the same values as the whole tensor's rows.
    out, offsets = fp8.dequantize_named({name: q[128:], fp8.scale_name(name): s[1:], "bias": torch.ones(2)},
                                        {name: 128, fp8.scale_name(name): 1})
    assert set(out) == {name, "bias"} and offsets == {name: 128}
    assert torch.equal(out[name], whole[128:])
    # A piece of rows quantized on its own equals the rows of the whole (blocks are row-aligned).
    q2, s2 = fp8.quantize_blockwise(w[128:256])
    assert torch.equal(q2.view(torch.uint8), q[128:256].view(torch.uint8)) and torch.equal(s2, s[1:2])
    with pytest.raises(ValueError, match="scales"):
        fp8.dequantize_named({name: q})
    with pytest.raises(ValueError, match="without their weight"):
        fp8.dequantize_named({fp8.scale_name(name): s})
    with pytest.raises(ValueError, match="block boundary"):
        fp8.dequantize_named({name: q[64:], fp8.scale_name(name): s}, {name: 64})


def test_quantization_config_is_sglangs_block_fp8():
    assert fp8.quantization_config() == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}


def _layer_module(rows=300, cols=20):
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.down_proj = torch.nn.Linear(cols, rows, bias=False)
    model.model.layers = torch.nn.ModuleList([layer])
    model.model.norm = torch.nn.LayerNorm(cols)
    model.register_buffer("steps", torch.arange(3))
    return model


def test_a_quantized_weight_splits_on_128_row_blocks_with_its_scale_rows_and_reassembles_exactly():
    from rlkube_runtime.engine.weights import copy_into_model
    from rlkube_runtime.weight_sync import WeightSender, plan_buckets

    torch.manual_seed(3)
    source = _layer_module()
    name = "model.layers.0.mlp.down_proj.weight"
    buckets = plan_buckets([(name, (300, 20))], itemsize=4, bucket_bytes=3000, split_rows=True, quantized={name})
    pieces = [p for b in buckets for p in b]
    # A 128-row block is 128 x 20 bytes + 4 for its one scale: one block per piece.
    assert [p.rows for p in pieces] == [(0, 128), (128, 256), (256, 300)]
    assert [p.nbytes for p in pieces] == [128 * 20 + 4, 128 * 20 + 4, 44 * 20 + 4]
    assert all(p.quantized for p in pieces)
    sender = WeightSender(source, dtype=torch.float32, bucket_bytes=3000, device=torch.device("cpu"), quantization="fp8")
    named = dict(source.state_dict())
    target = _layer_module()
    for piece in pieces:
        sent = sender._transfer_tensors(named, piece)
        assert [(n, t.dtype, o) for n, t, o in sent] == [
            (name, torch.float8_e4m3fn, piece.rows[0]), (name + "_scale_inv", torch.float32, piece.rows[0] // 128)]
        copy_into_model(target, {n: t for n, t, _ in sent}, field="t", row_offsets={n: o for n, _, o in sent})
    assert torch.equal(target.state_dict()[name], fp8.quantize_dequantize(named[name]))


def test_staging_puts_every_dtype_of_a_bucket_in_one_byte_buffer_at_aligned_offsets():
    from rlkube_runtime.weight_sync import WeightSender, plan_buckets
    from rlkube_runtime.weight_sync.sender import STAGING_ALIGN

    torch.manual_seed(4)
    source = _layer_module(rows=130, cols=20)
    sender = WeightSender(source, dtype=torch.bfloat16, bucket_bytes=1 << 20, device=torch.device("cpu"),
                          quantization="fp8")
    named = dict(source.state_dict())
    quantized = sender._quantized(named)
    assert quantized == {"model.layers.0.mlp.down_proj.weight"}
    [bucket] = plan_buckets([(n, tuple(t.shape)) for n, t in named.items()], itemsize=2, bucket_bytes=1 << 20,
                            split_rows=False, itemsizes={"steps": 8}, quantized=quantized)
    staged = dict(sender._stage(named, bucket))
    assert {n: t.dtype for n, t in staged.items()} == {
        "steps": torch.int64, "model.layers.0.mlp.down_proj.weight": torch.float8_e4m3fn,
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.float32,
        "model.norm.weight": torch.bfloat16, "model.norm.bias": torch.bfloat16}
    base = sender._staging.data_ptr()
    assert all(t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % STAGING_ALIGN == 0
               for t in staged.values())
    assert torch.equal(staged["steps"], torch.arange(3))
    q, s = fp8.quantize_blockwise(named["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(staged["model.layers.0.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(staged["model.layers.0.mlp.down_proj.weight_scale_inv"], s)
    assert sum(p.nbytes for p in bucket) == 3 * 8 + 130 * 20 + 4 * 2 + 2 * 20 * 2

"""The Megatron-core trainer backend (needs the `megatron` extra: megatron-core).

backend.py: MegatronBackend. model.py: HF config -> TransformerConfig/GPTModel and
spec.model.megatronArgs. convert.py: HF <-> megatron tensors. checkpoint.py: distributed
checkpoints. cpu.py: running megatron-core without CUDA. Import submodules directly: importing
this package does not import megatron-core.
"""

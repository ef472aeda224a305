"""Trainer backends and what they share: the batch type, packing, lr schedule, checkpoints.

`TrainerBackend` (backend.py) is the interface the loop calls; `TorchBackend` (torch_backend.py)
implements it on transformers models, `MegatronBackend` (megatron/, imported from there: it needs
megatron-core) on megatron-core. Checkpoint files are written by checkpoint.py, which
knows nothing of models.

The package itself imports nothing: the driver imports `trainer.support` (its start-time check)
without the backends, so it never loads torch.
"""

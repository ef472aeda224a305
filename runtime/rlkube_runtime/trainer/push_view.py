"""The backend's weights as the weight sender reads them."""

from __future__ import annotations

import torch


class PushView(torch.nn.Module):
    """What the weight sender reads: the backend's `weights_for_push` as a module's state dict
    (tied tensors are one tensor, so the sender sends them once)."""

    def __init__(self, backend):
        super().__init__()
        self._backend = backend

    def state_dict(self, *args, **kwargs):  # noqa: ARG002 - the sender's keep_vars changes nothing here
        return dict(self._backend.weights_for_push())

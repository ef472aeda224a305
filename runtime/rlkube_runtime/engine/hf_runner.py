"""The generic model runner: any transformers causal LM through its own forward and a joined,
left-padded KV cache (`kv_batch`). Slower than `SlotRunner` (no static cache, no CUDA graphs),
but it runs every architecture transformers runs; the engine uses it when `SlotRunner` cannot.
"""

from __future__ import annotations

import torch

from rlkube_runtime.engine.expert_routes import ExpertRouteRecorder
from rlkube_runtime.engine.kv_batch import KVBatch, new_cache
from rlkube_runtime.engine.kv_batch import forward as kv_forward


class HFRunner:
    """Same interface as `SlotRunner`: prefill joins rows at the end, decode steps them all.

    With `record_routes` (a mixture of experts), each forward also leaves `routes`: per row, the
    [tokens, layers, top_k] experts its fed tokens were routed to (every token of a prefilled row,
    the one fed token of a decoded row)."""

    def __init__(self, model: torch.nn.Module, *, max_rows: int, pad_token_id: int, record_routes: bool = False):
        self.model = model
        self._recorder = ExpertRouteRecorder(model) if record_routes else None
        self.routes: list[torch.Tensor] | None = None
        self.max_rows = max_rows
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.rows = 0
        self.graph_captures = 0
        self._kv: KVBatch | None = None

    def admissible(self, slots_needed: list[int]) -> int:
        return max(0, min(len(slots_needed), self.max_rows - self.rows))

    def kv_bytes(self) -> int:
        if self._kv is None:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._kv.layer_tensors())

    @torch.inference_mode()
    def prefill(self, rows: list[list[int]], slots_needed: list[int]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = new_cache()
        self.rows += len(rows)  # before the forward: a failure fails these rows too
        logits = kv_forward(self.model, cache, input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        joined = KVBatch(cache=cache, attention_mask=mask)
        self._kv = joined if self._kv is None else self._kv.join(joined)
        if self._recorder is not None:
            routes = self._recorder.take().view(len(rows), width, self._recorder.num_layers, self._recorder.top_k)
            self.routes = [routes[i, width - len(row) :] for i, row in enumerate(rows)]  # left-padded rows
        return logits[:, -1, :]

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        kv = self._kv
        batch = len(tokens)
        input_ids = torch.tensor(tokens, device=self.device)[:, None]
        position_ids = torch.tensor(positions, device=self.device)[:, None]
        mask = torch.cat([kv.attention_mask, torch.ones((batch, 1), dtype=kv.attention_mask.dtype, device=self.device)], 1)
        # The cache grows by one slot in place; the mask is rebuilt to match.
        logits = kv_forward(self.model, kv.cache, input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
        self._kv = KVBatch(cache=kv.cache, attention_mask=mask)
        if self._recorder is not None:
            routes = self._recorder.take()
            self.routes = [routes[i : i + 1] for i in range(batch)]
        return logits[:, -1, :]

    def keep(self, rows: list[int]) -> None:
        self._kv = self._kv.select(rows) if rows else None
        self.rows = len(rows)

    def clear(self) -> None:
        self._kv = None
        self.rows = 0

    def release(self) -> None:
        self.clear()

    def weights_moved(self) -> None:
        pass

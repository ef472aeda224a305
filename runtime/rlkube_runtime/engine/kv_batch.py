"""The running batch's key/value cache: left-padded rows that can be joined, dropped and trimmed.

Rows are aligned on the right (left padding), so every row's next token goes into the same cache
slot; `attention_mask` [batch, slots] marks real positions. New rows join between decode steps
by padding the shorter cache on the left and concatenating along the batch; finished rows leave by
index selection, and slots no remaining row uses are cut off the left edge.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from transformers import DynamicCache


@dataclasses.dataclass
class KVBatch:
    """Per-layer keys and values [batch, kv_heads, slots, head_dim] plus the padding mask."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    attention_mask: torch.Tensor  # [batch, slots], 1 where a real token sits

    @classmethod
    def from_cache(cls, cache: DynamicCache, attention_mask: torch.Tensor) -> KVBatch:
        return cls(layers=_cache_tensors(cache), attention_mask=attention_mask)

    @property
    def batch_size(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def slots(self) -> int:
        return self.attention_mask.shape[1]

    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to_cache(self) -> DynamicCache:
        return DynamicCache(ddp_cache_data=[(k, v) for k, v in self.layers])

    def join(self, other: KVBatch) -> KVBatch:
        """Rows of `self` followed by rows of `other`, padded on the left to the longer one."""
        slots = max(self.slots, other.slots)
        a, b = self._left_pad(slots), other._left_pad(slots)
        layers = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a.layers, b.layers)]
        return KVBatch(layers=layers, attention_mask=torch.cat([a.attention_mask, b.attention_mask]))

    def select(self, rows: list[int]) -> KVBatch:
        """Keep `rows` (in that order) and drop the padding columns none of them uses."""
        index = torch.tensor(rows, device=self.attention_mask.device, dtype=torch.long)
        mask = self.attention_mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        layers = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self.layers]
        return KVBatch(layers=layers, attention_mask=mask[:, start:])

    def _left_pad(self, slots: int) -> KVBatch:
        extra = slots - self.slots
        if extra == 0:
            return self
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, extra, 0))  # noqa: E731  (slot dim is -2)
        layers = [(pad(k), pad(v)) for k, v in self.layers]
        mask = torch.nn.functional.pad(self.attention_mask, (extra, 0))
        return KVBatch(layers=layers, attention_mask=mask)


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def forward(model: torch.nn.Module, cache: DynamicCache, **inputs) -> tuple[torch.Tensor, DynamicCache]:
    """Run the model with `cache` under whichever keyword this transformers version takes.

    Returns (logits, the updated cache).
    """
    out = model(**{_cache_keyword(type(model)): cache}, use_cache=True, **inputs)
    return out.logits, out.cache if "cache" in out else out.past_key_values


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns, then goes away).
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"

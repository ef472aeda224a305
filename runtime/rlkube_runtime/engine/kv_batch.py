"""The running batch's key/value cache: left-padded rows that can be joined, dropped and trimmed.

Rows are aligned on the right (left padding), so every row's next token goes into the same cache
slot; `attention_mask` [batch, slots] marks real positions. New rows join between decode steps
by padding the shorter cache on the left and concatenating along the batch; finished rows leave by
index selection, and slots no remaining row uses are cut off the left edge.

The cache is a transformers `DynamicCache` whose layers keep spare capacity: a decode step writes
its one new slot in place instead of concatenating (and so copying) the whole cache, which is
what the stock `DynamicLayer` does and what dominated step time at large batches.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Spare slots a layer starts with beyond what it holds; growth doubles the capacity.
_MIN_HEADROOM = 64


class GrowableLayer(DynamicLayer):
    """A `DynamicLayer` that appends into preallocated capacity; `keys`/`values` are views of it."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self.length = 0
        if keys is not None:
            self._allocate(keys, values)

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, slots, dim = keys.shape
        capacity = slots + max(_MIN_HEADROOM, slots // 2)
        self._key_buffer = keys.new_empty((batch, heads, capacity, dim))
        self._value_buffer = values.new_empty((batch, heads, capacity, values.shape[-1]))
        self._key_buffer[:, :, :slots] = keys
        self._value_buffer[:, :, :slots] = values
        self.length = slots
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._allocate(key_states, value_states)
            return self.keys, self.values
        new = key_states.shape[-2]
        if self.length + new > self._key_buffer.shape[-2]:
            self._allocate(self.keys, self.values)  # re-allocate with half again as much room
        self._key_buffer[:, :, self.length : self.length + new] = key_states
        self._value_buffer[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0


def new_cache() -> DynamicCache:
    """An empty `DynamicCache` whose layers (added as the model reaches them) are growable."""
    return _cache_of([])


@dataclasses.dataclass
class KVBatch:
    """The cache of the running rows [batch, kv_heads, slots, head_dim] per layer, plus the mask."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [batch, slots], 1 where a real token sits

    @property
    def batch_size(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def slots(self) -> int:
        return self.attention_mask.shape[1]

    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def join(self, other: KVBatch) -> KVBatch:
        """Rows of `self` followed by rows of `other`, padded on the left to the longer one."""
        slots = max(self.slots, other.slots)

        def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([_pad_slots_left(a, slots - a.shape[-2]), _pad_slots_left(b, slots - b.shape[-2])])

        layers = [
            GrowableLayer(both(ka, kb), both(va, vb))
            for (ka, va), (kb, vb) in zip(self.layer_tensors(), other.layer_tensors())
        ]
        mask = torch.cat([_pad_slots_left(self.attention_mask, slots - self.slots), _pad_slots_left(other.attention_mask, slots - other.slots)])
        return KVBatch(cache=_cache_of(layers), attention_mask=mask)

    def select(self, rows: list[int]) -> KVBatch:
        """Keep `rows` (in that order) and drop the padding columns none of them uses."""
        index = torch.tensor(rows, device=self.attention_mask.device, dtype=torch.long)
        mask = self.attention_mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        layers = [
            GrowableLayer(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self.layer_tensors()
        ]
        return KVBatch(cache=_cache_of(layers), attention_mask=mask[:, start:])


def forward(model: torch.nn.Module, cache: DynamicCache, **inputs) -> torch.Tensor:
    """Run the model, extending `cache` in place, under whichever keyword this transformers
    version takes for it; returns the logits."""
    return model(**{_cache_keyword(type(model)): cache}, use_cache=True, **inputs).logits


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns, then goes away).
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _cache_of(layers: list[GrowableLayer]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = layers
    cache.layer_class_to_replicate = GrowableLayer
    return cache


def _pad_slots_left(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    """Pad the slot dimension (-2 for K/V [b, h, slots, d]; -1 for a mask [b, slots]) on the left."""
    if extra == 0:
        return tensor
    if tensor.dim() == 2:
        return torch.nn.functional.pad(tensor, (extra, 0))
    return torch.nn.functional.pad(tensor, (0, 0, extra, 0))

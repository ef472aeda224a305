"""The fast model runner for Llama-family decoders: a preallocated KV cache and CUDA-graph decode.

Every running request owns one row of a cache allocated once, K and V each of shape
[layers, rows, kv_heads, slots, head_dim]; a token at position p of a request lives in slot p of
its row. Rows are kept dense at the front (a request that leaves has the rows behind it moved
up), so a decode step over b requests reads rows [0, b) and slots [0, T) with T the longest
request rounded up to a bucket: plain strided views, no gathers.

Decode runs the model by hand over the transformers modules' own weights (embedding, norms,
projections, MLP and LM head are called as modules; only attention and the cache are ours), so
a weight update that copies into the parameters is seen at once and nothing is duplicated. On
CUDA each (batch bucket, slot bucket) pair is captured once as a CUDA graph and replayed; inputs
and logits live in static buffers. Prefill is eager: the prompts of joining requests go through
one right-padded causal forward (`scaled_dot_product_attention`), their K/V written to their rows.

Supported: model types llama, mistral, qwen2 and qwen3 with full attention and a RoPE whose
frequencies do not depend on the sequence length. Others use `HFRunner`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SLOT_BUCKET = 256  # slot counts are multiples of this up to 1024, then powers of two
PREFILL_TOKEN_BUDGET = 16384  # padded prompt tokens per prefill forward


class CacheTooSmall(RuntimeError):
    """A request needs more KV slots than the memory budget allows for even one row."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `SlotRunner` cannot run this model (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "the model has sliding-window layers"
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        return "the model uses a sliding window"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in ("dynamic", "longrope"):
        return f"RoPE type {rope_type!r} changes with the sequence length"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the embed_tokens/layers/norm/rotary_emb layout"
    return None


class SlotRunner:
    """See the module docstring. Not thread-safe: the engine's scheduler thread owns it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_rows: int,
        kv_budget_bytes: int,
        cuda_graphs: bool = True,
        compile_kernels: bool = False,
    ):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"SlotRunner cannot run this model: {reason}")
        self.model = model
        config = model.config
        inner = model.model
        self._embed, self._layers, self._norm, self._rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self._lm_head = model.lm_head
        attn = self._layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.vocab_size = int(config.vocab_size)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_rows = max_rows
        self.kv_budget_bytes = kv_budget_bytes
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.compiled = compile_kernels and self.device.type == "cuda"
        self._rotate, self._attention_probs = _rotate, _attention_probs
        if self.compiled:
            self._compile_elementwise()
        self.rows = 0  # running requests, in rows [0, rows)
        self.graph_captures = 0  # for tests and logs
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._free_buffers()

    def _compile_elementwise(self) -> None:
        """torch.compile the elementwise parts of a step (RMSNorms, RoPE, the SwiGLU, the
        attention softmax; dynamic shapes), leaving matmuls and the cache writes as they are.

        A decode step of a sub-billion model at tens of rows is a chain of ~60 tiny kernels per
        layer, most of them the eager norms' and rotary's float32 passes; fused, the captured
        graph has fewer, and each replay is shorter. Compiling happens on the first step of each
        shape class, before any capture (the warm-up run of `_graph`)."""
        for layer in self._layers:
            modules = [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
            modules += [getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if hasattr(layer.self_attn, n)]
            for module in modules:
                module.compile(dynamic=True)
        self._norm.compile(dynamic=True)
        self._rotate = torch.compile(_rotate, dynamic=True)
        self._attention_probs = torch.compile(_attention_probs, dynamic=True)

    # ---- capacity ------------------------------------------------------------------------

    @property
    def bytes_per_slot(self) -> int:
        """K and V of one token in every layer."""
        return 2 * len(self._layers) * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def admissible(self, slots_needed: list[int]) -> int:
        """How many of these joining requests (each needing that many slots, in order) fit next to
        the running ones; raises CacheTooSmall when the first cannot fit even alone."""
        allocated_slots = 0 if self._k is None else self._k.shape[3]
        running_need = self._running_slots if self.rows else 0
        count = 0
        need = max(running_need, 1)
        for needed in slots_needed:
            need = max(need, needed)
            slots = max(allocated_slots, _round_slots(need))
            rows = self.rows + count + 1
            if rows > self.max_rows or rows * slots * self.bytes_per_slot > self.kv_budget_bytes:
                break
            count += 1
        if count == 0 and self.rows == 0 and slots_needed:
            slots = _round_slots(slots_needed[0])
            raise CacheTooSmall(
                f"a request needs {slots_needed[0]} KV slots ({slots * self.bytes_per_slot / 2**30:.2f} GiB for one "
                f"row), more than the engine's KV budget of {self.kv_budget_bytes / 2**30:.2f} GiB; lower "
                "max_new_tokens or give the engine more memory (--mem-fraction-static)"
            )
        return count

    def kv_bytes(self) -> int:
        return 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()

    # ---- the running batch ---------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, rows: list[list[int]], slots_needed: list[int]) -> torch.Tensor:
        """Add these token rows (prompt, or prompt + tokens so far after a retraction) as new
        running requests after the current ones; returns next-token logits [len(rows), vocab]."""
        self._reserve(self.rows + len(rows), max(slots_needed))
        lengths = torch.tensor([len(r) for r in rows])
        width = int(lengths.max())
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        ids = ids.to(self.device, non_blocking=True)
        first = self.rows
        self._running_slots = max(self._running_slots if self.rows else 0, max(slots_needed))
        self.rows += len(rows)
        hidden = self._prefill_hidden(ids, first)
        last = hidden[torch.arange(len(rows)), (lengths - 1).to(self.device)]
        return self._lm_head(last)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One step for every running request (row i gets tokens[i] at positions[i]); returns
        logits [rows, vocab]. The returned tensor is overwritten by the next step."""
        b = len(tokens)
        if b != self.rows:
            raise RuntimeError(f"decode got {b} tokens for {self.rows} running rows")
        slots = min(_round_slots(max(positions) + 1), self._k.shape[3])
        if self.cuda_graphs:
            padded = _batch_bucket(b, self._k.shape[1])
            host = torch.zeros((2, padded), dtype=torch.long)
            host[0, :b] = torch.tensor(tokens)
            host[1, :b] = torch.tensor(positions)  # padding rows write slot 0 of free rows
            self._step_inputs[:, :padded].copy_(host, non_blocking=True)
            self._graph(padded, slots).replay()
            return self._logits[:b]
        self._step_inputs[0, :b] = torch.tensor(tokens)
        self._step_inputs[1, :b] = torch.tensor(positions)
        self._decode_into(b, slots)
        return self._logits[:b]

    def keep(self, rows: list[int]) -> None:
        """Keep these running rows, in this (ascending) order, as rows 0..len-1."""
        moves = [(dst, src) for dst, src in enumerate(rows) if dst != src]
        if moves:
            dst = torch.tensor([m[0] for m in moves], device=self.device)
            src = torch.tensor([m[1] for m in moves], device=self.device)
            with torch.inference_mode():
                self._k[:, dst] = self._k[:, src]
                self._v[:, dst] = self._v[:, src]
        self.rows = len(rows)

    def clear(self) -> None:
        """Forget every running request (their rows are free again)."""
        self.rows = 0

    def release(self) -> None:
        """Free the cache and the graphs (their memory goes back to the device)."""
        self.rows = 0
        self._free_buffers()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def weights_moved(self) -> None:
        """The parameters got new storage (offload/restore): captured graphs point at the old."""
        self._drop_graphs()
        self._rope = None

    def _drop_graphs(self) -> None:
        # A graph pool outlives its graphs only as a handle: captures after the graphs are gone
        # need a new pool (reusing the old one trips the allocator's private-pool bookkeeping).
        self._graphs.clear()
        self._graph_pool = None

    # ---- allocation ----------------------------------------------------------------------

    def _free_buffers(self) -> None:
        self._k = self._v = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._logits: torch.Tensor | None = None
        self._step_inputs: torch.Tensor | None = None
        self._running_slots = 0

    def _reserve(self, rows: int, slots_needed: int) -> None:
        """Make the cache hold `rows` rows of at least `slots_needed` slots, keeping running rows."""
        have_rows = 0 if self._k is None else self._k.shape[1]
        have_slots = 0 if self._k is None else self._k.shape[3]
        if rows <= have_rows and slots_needed <= have_slots:
            return
        slots = max(have_slots, _round_slots(slots_needed))
        # Rows grow by doubling (up to the cap and the budget) so a stream of joiners reallocates rarely.
        affordable = max(rows, self.kv_budget_bytes // (slots * self.bytes_per_slot))
        new_rows = min(max(rows, 2 * have_rows, 8), self.max_rows, affordable)
        shape = (len(self._layers), new_rows, self.num_kv_heads, slots, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._k is not None and self.rows:
            k[:, : self.rows, :, :have_slots] = self._k[:, : self.rows]
            v[:, : self.rows, :, :have_slots] = self._v[:, : self.rows]
        self._k, self._v = None, None
        self._drop_graphs()
        self._k, self._v = k, v
        self._logits = torch.empty((new_rows, self.vocab_size), dtype=self.dtype, device=self.device)
        self._step_inputs = torch.zeros((2, new_rows), dtype=torch.long, device=self.device)
        self._rope = None
        log.info("KV cache: %d rows x %d slots (%.2f GiB)", new_rows, slots, self.kv_bytes() / 2**30)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [slots, head_dim] for every position, from the model's own rotary module."""
        if self._rope is None:
            slots = self._k.shape[3]
            positions = torch.arange(slots, device=self.device)[None]
            probe = torch.empty((1, 1, self.head_dim), dtype=self.dtype, device=self.device)
            cos, sin = self._rotary(probe, positions)
            self._rope = (cos[0].contiguous(), sin[0].contiguous())
        return self._rope

    # ---- the model, by hand --------------------------------------------------------------

    def _qkv(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., heads, d], k/v [..., kv_heads, d] with the model's norms and RoPE applied."""
        shape = x.shape[:-1]
        q = attn.q_proj(x).view(*shape, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _prefill_hidden(self, ids: torch.Tensor, first_row: int) -> torch.Tensor:
        n, width = ids.shape
        cos, sin = (t[:width, None, :] for t in self._rope_tables())  # [width, 1, d]
        x = self._embed(ids)
        for index, layer in enumerate(self._layers):
            attn = layer.self_attn
            residual = x
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)  # [n, width, heads, d]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, kv_heads, width, d]
            self._k[index, first_row : first_row + n, :, :width] = k
            self._v[index, first_row : first_row + n, :, :width] = v
            # Right padding + causal: a real token never sees a pad (pads come after it).
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, scale=self.scaling, enable_gqa=True
            )
            x = residual + attn.o_proj(out.transpose(1, 2).reshape(n, width, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._norm(x)

    def _decode_into(self, b: int, slots: int) -> None:
        """One decode step for rows [0, b) reading slots [0, slots); logits into self._logits[:b]."""
        tokens, positions = self._step_inputs[0, :b], self._step_inputs[1, :b]
        cos_table, sin_table = self._rope_tables()
        cos, sin = cos_table[positions][:, None, :], sin_table[positions][:, None, :]  # [b, 1, d]
        rows = torch.arange(b, device=self.device)
        visible = torch.arange(slots, device=self.device)[None, :] <= positions[:, None]
        bias = torch.zeros((b, slots), dtype=torch.float32, device=self.device).masked_fill_(~visible, -math.inf)
        bias = bias[:, None, None, :]  # [b, 1, 1, slots]
        groups = self.num_heads // self.num_kv_heads
        x = self._embed(tokens)  # [b, hidden]
        for index, layer in enumerate(self._layers):
            attn = layer.self_attn
            residual = x
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)  # q [b, heads, d]
            self._k[index][rows, :, positions] = k
            self._v[index][rows, :, positions] = v
            keys = self._k[index, :b, :, :slots]  # [b, kv_heads, slots, d]
            values = self._v[index, :b, :, :slots]
            # Query heads of one KV head side by side: [b, kv_heads, groups, d].
            scores = torch.matmul(q.view(b, self.num_kv_heads, groups, self.head_dim), keys.transpose(-1, -2))
            weights = self._attention_probs(scores, bias, self.scaling)
            out = torch.matmul(weights, values).reshape(b, -1)
            x = residual + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = self._norm(x)
        torch.mm(hidden, self._lm_head.weight.t(), out=self._logits[:b])
        if getattr(self._lm_head, "bias", None) is not None:
            self._logits[:b] += self._lm_head.bias

    def _graph(self, b: int, slots: int) -> torch.cuda.CUDAGraph:
        """The captured decode step for (b, slots); captured on first use with the current
        inputs, which the warm-up run processes for real (writing the same K/V the replay writes)."""
        graph = self._graphs.get((b, slots))
        if graph is not None:
            return graph
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            self._decode_into(b, slots)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._decode_into(b, slots)
        self._graphs[(b, slots)] = graph
        self.graph_captures += 1
        return graph


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (rotate_half); cos/sin broadcast over the head axis."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention_probs(scores: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(scores x scaling + bias) in float32, back in the scores' dtype."""
    return torch.softmax(scores.float() * scaling + bias, dim=-1).to(scores.dtype)


def _round_slots(slots: int) -> int:
    if slots <= 4 * SLOT_BUCKET:
        return -(-slots // SLOT_BUCKET) * SLOT_BUCKET
    return 1 << (slots - 1).bit_length()


def _batch_bucket(b: int, cap: int) -> int:
    """Graph batch sizes: 1, 2, 4, 8, then multiples of 16 (at most `cap`)."""
    for size in (1, 2, 4, 8):
        if b <= size:
            return min(size, cap)
    return min(-(-b // 16) * 16, cap)

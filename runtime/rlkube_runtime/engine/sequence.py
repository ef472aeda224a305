"""One generation in flight: its tokens so far, when it must stop, and the response it becomes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import torch

from rlkube_runtime.engine import protocol
from rlkube_runtime.engine.protocol import GenerateItem, SamplingParams
from rlkube_runtime.routed_experts import encode_routes


@dataclasses.dataclass(eq=False)
class Sequence:
    """Owned by the scheduler thread once submitted; `future` carries the response back."""

    item: GenerateItem
    prompt_ids: list[int]
    stop_token_ids: frozenset[int]  # the request's stop ids plus EOS unless ignore_eos
    max_new_tokens: int  # the request's limit, capped so prompt + output fit the context
    uniforms: list[float] | None  # one random number per token it may sample (None: greedy)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    # Under return_routed_experts: [tokens, layers, top_k] parts, one row per token fed so far.
    routes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    created_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def rid(self) -> str:
        return self.item.rid

    @property
    def params(self) -> SamplingParams:
        return self.item.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def slots_needed(self) -> int:
        """KV cache slots the request can fill by its end (prompt plus every token but the last)."""
        return len(self.prompt_ids) + self.max_new_tokens

    def next_uniform(self) -> float:
        """The random number that picks the next token (0.0 for greedy requests, which ignore it)."""
        return 0.0 if self.uniforms is None else self.uniforms[len(self.output_ids)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, tokenizer) -> None:
        """Record a sampled token and decide, in SGLang's order, whether the sequence is done."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = protocol.finish_length(self.max_new_tokens)
        elif token in self.stop_token_ids:
            self.finish_reason = protocol.finish_stop(token)
        elif self.params.stop:
            matched = self._matched_stop_string(tokenizer)
            if matched is not None:
                self.finish_reason = protocol.finish_stop(matched)

    def record_routes(self, routes: torch.Tensor, *, prefill: bool) -> None:
        """A forward's routes of this sequence's fed tokens: a prefill fed them all (a retracted
        request's re-prefill replaces what it had), a decode step one more."""
        if prefill:
            self.routes = [routes]
        else:
            self.routes.append(routes)

    def finish_now(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def response(self, tokenizer, weight_version: str) -> dict[str, Any]:
        """The /generate response object for this sequence (it must be finished)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "e2e_latency": time.monotonic() - self.created_at,
        }
        if self.item.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(self.output_logprobs, self.output_ids)]
        if self.item.return_routed_experts:
            meta["routed_experts"] = self._routed_experts()
        return {"text": self._text(tokenizer), "output_ids": list(self.output_ids), "meta_info": meta}

    def _routed_experts(self) -> str:
        """Every fed token's routes (all but the newest token), as SGLang encodes them; none for a
        request aborted before it was ever prefilled."""
        if not self.routes:
            return encode_routes(torch.zeros(0, dtype=torch.int32))
        routes = torch.cat(self.routes)
        if routes.shape[0] != self.num_tokens - 1:
            raise RuntimeError(f"rid {self.rid}: routes of {routes.shape[0]} tokens for {self.num_tokens - 1} fed")
        return encode_routes(routes)

    def _text(self, tokenizer) -> str:
        ids = self.output_ids
        matched = (self.finish_reason or {}).get("matched")
        trim = self.finish_reason is not None and self.finish_reason["type"] == "stop" and not self.params.no_stop_trim
        if trim and isinstance(matched, int):
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text

    def _matched_stop_string(self, tokenizer) -> str | None:
        # Decoding only a tail keeps the check O(stop length) per token; a few spare tokens cover
        # tokens that decode to nothing (specials) or to partial characters.
        longest = max(len(s) for s in self.params.stop)
        tail = tokenizer.decode(self.output_ids[-(longest + 4) :], skip_special_tokens=self.params.skip_special_tokens)
        for stop in self.params.stop:
            if stop in tail:
                return stop
        return None

"""The continuous-batching generation loop, run in its own thread.

Between decode steps the loop runs control commands (abort, pause, weight updates, memory
release), admits waiting requests with one left-padded prefill forward, and drops finished rows.
Every running request then advances by one token in a single shared decode forward over the
joined KV cache. The model is touched only from this thread, so a weight update never lands in the
middle of a forward pass.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from rlkube_runtime.engine import protocol
from rlkube_runtime.engine.kv_batch import KVBatch, new_cache
from rlkube_runtime.engine.kv_batch import forward as kv_forward
from rlkube_runtime.engine.sampling import sample_tokens
from rlkube_runtime.engine.sequence import Sequence

log = logging.getLogger(__name__)

# Released memory tags that stop the loop from stepping until they are resumed.
_BLOCKING_TAGS = frozenset({"weights", "kv_cache"})


class Scheduler:
    """Owns the waiting queue, the running batch and its KV cache; see the module docstring."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, max_running_requests: int, pad_token_id: int):
        self.model = model
        self.tokenizer = tokenizer
        self.max_running_requests = max_running_requests
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.weight_version = "default"
        self.paused_mode: str | None = None
        self.released_tags: set[str] = set()
        self.generated_tokens = 0  # since start, for throughput reporting
        self.finished_requests = 0  # since start, answered with any finish reason
        self.steps = 0  # generation steps run; a health check counts progress as health
        self.kv_tokens = 0  # tokens held in the running batch's cache, kept as a plain int

        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._stopping = False
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._kv: KVBatch | None = None
        self._thread = threading.Thread(target=self._loop, name="rlkube-engine-scheduler", daemon=True)

    # ---- thread-safe API -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout)

    def submit(self, sequence: Sequence) -> None:
        with self._lock:
            if self._stopping:
                sequence.future.set_exception(RuntimeError("the engine is shutting down"))
                return
            self._inbox.append(sequence)
            self._lock.notify_all()

    def call(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `command` in the loop thread between steps; its result or exception lands in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append((command, future))
            self._lock.notify_all()
        return future

    def load(self) -> dict[str, int]:
        """Approximate counts read without locking (the router and clients only poll them)."""
        with self._lock:
            inbox = len(self._inbox)
        return {"running": len(self._running), "waiting": len(self._waiting) + inbox, "kv_tokens": self.kv_tokens}

    # ---- commands (run in the loop thread through `call`) ------------------------------------

    def abort(self, rid_prefix: str | None, message: str = "aborted by /abort_request") -> int:
        """Finish every waiting or running request whose rid starts with `rid_prefix` (None: all)."""
        self._drain_inbox()
        targets = [s for s in [*self._waiting, *self._running] if rid_prefix is None or s.rid.startswith(rid_prefix)]
        return self.cancel(targets, message)

    def cancel(self, sequences: list[Sequence], message: str) -> int:
        """Finish these sequences with finish_reason abort, keeping the tokens they have."""
        self._drain_inbox()
        count = 0
        for seq in sequences:
            if not seq.finished:
                seq.finish_now(protocol.finish_abort(message))
                count += 1
        self._retire_finished_waiting()
        self._retire_finished_running()
        return count

    def pause(self, mode: str) -> None:
        """abort: end running and waiting requests; retract: drop their KV, they resume later;
        in_place: keep everything as it is. In every mode nothing advances until `resume`."""
        if mode == "abort":
            self.abort(None, message="aborted by /pause_generation (mode abort)")
        elif mode == "retract":
            self._retract_running()
        self.paused_mode = mode

    def resume(self) -> None:
        self.paused_mode = None

    def release(self, tags: tuple[str, ...], offload) -> None:
        """Free memory: `kv_cache` drops the running batch's cache (its requests re-prefill after
        resume); `weights` moves the weights off the model through `offload`."""
        if "kv_cache" in tags:
            self._retract_running()
        if "weights" in tags:
            offload.offload(self.model)
        self.released_tags.update(tags)

    def resume_memory(self, tags: tuple[str, ...], offload) -> None:
        if "weights" in tags:
            offload.restore(self.model)
        self.released_tags.difference_update(tags)

    def idle(self) -> bool:
        self._drain_inbox()
        return not self._running and not self._waiting

    # ---- the loop --------------------------------------------------------------------------

    def _can_step(self) -> bool:
        return self.paused_mode is None and not (self.released_tags & _BLOCKING_TAGS)

    def _has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._commands or (self._can_step() and self._has_work())):
                    self._lock.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command, future in commands:
                self._run_command(command, future)
            if stopping:
                self.abort(None, message="the engine is shutting down")
                return
            if self._can_step():
                try:
                    self._step()
                except Exception as err:  # a failed forward must not kill the server
                    log.exception("generation step failed; failing the running requests")
                    self._fail_running(err)

    def _run_command(self, command: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(command())
        except Exception as err:  # handed to the awaiting request handler
            future.set_exception(err)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        self._waiting.extend(inbox)

    @torch.inference_mode()
    def _step(self) -> None:
        self._drain_inbox()
        self._admit()
        if self._running:
            self._decode()
        self.steps += 1
        # Everything but each row's newest token is in the cache (counted here, not read off the
        # device, so polling the load never waits for the GPU).
        self.kv_tokens = sum(seq.num_tokens - 1 for seq in self._running)

    def _admit(self) -> None:
        """Prefill as many waiting requests as fit, in one left-padded forward, and join them."""
        joiners: list[Sequence] = []
        while self._waiting and len(self._running) + len(joiners) < self.max_running_requests:
            seq = self._waiting.popleft()
            if seq.max_new_tokens - len(seq.output_ids) <= 0:
                seq.finish_now(protocol.finish_length(seq.max_new_tokens))
                self._deliver(seq)
            else:
                joiners.append(seq)
        if not joiners:
            return
        # A retracted request re-prefills its prompt and the tokens it already generated.
        rows = [seq.prompt_ids + seq.output_ids for seq in joiners]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        self._running.extend(joiners)  # before the forward, so a failure fails them too
        cache = new_cache()
        logits = kv_forward(self.model, cache, input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        joined = KVBatch(cache=cache, attention_mask=mask)
        self._kv = joined if self._kv is None else self._kv.join(joined)
        self._sample_and_advance(logits[:, -1, :], joiners)

    def _decode(self) -> None:
        """One token for every running request, in one forward over the shared cache."""
        kv = self._kv
        batch = len(self._running)
        input_ids = torch.tensor([[seq.output_ids[-1]] for seq in self._running], device=self.device)
        positions = torch.tensor([[seq.num_tokens - 1] for seq in self._running], device=self.device)
        mask = torch.cat([kv.attention_mask, torch.ones((batch, 1), dtype=kv.attention_mask.dtype, device=self.device)], 1)
        # The cache grows by one slot in place; the mask is rebuilt to match.
        logits = kv_forward(self.model, kv.cache, input_ids=input_ids, attention_mask=mask, position_ids=positions)
        self._kv = KVBatch(cache=kv.cache, attention_mask=mask)
        self._sample_and_advance(logits[:, -1, :], list(self._running))

    def _sample_and_advance(self, logits: torch.Tensor, sequences: list[Sequence]) -> None:
        tokens, logprobs = sample_tokens(logits, [s.params for s in sequences], [s.generator for s in sequences])
        for seq, token, logprob in zip(sequences, tokens, logprobs):
            seq.append(token, logprob, self.tokenizer)
        self.generated_tokens += len(sequences)
        self._retire_finished_running()

    def _retire_finished_running(self) -> None:
        if not any(seq.finished for seq in self._running):
            return
        keep = [i for i, seq in enumerate(self._running) if not seq.finished]
        for seq in self._running:
            if seq.finished:
                self._deliver(seq)
        self._running = [self._running[i] for i in keep]
        self._kv = self._kv.select(keep) if keep else None
        self.kv_tokens = sum(seq.num_tokens - 1 for seq in self._running)

    def _retire_finished_waiting(self) -> None:
        for seq in [s for s in self._waiting if s.finished]:
            self._deliver(seq)
        self._waiting = collections.deque(s for s in self._waiting if not s.finished)

    def _retract_running(self) -> None:
        """Move running requests back to the head of the queue and free their cache."""
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._kv = None
        self.kv_tokens = 0

    def _deliver(self, seq: Sequence) -> None:
        if seq.future.done():
            return
        self.finished_requests += 1
        seq.future.set_result(seq.response(self.tokenizer, self.weight_version))

    def _fail_running(self, err: Exception) -> None:
        for seq in self._running:
            if not seq.future.done():
                seq.future.set_exception(err)
        self._running = []
        self._kv = None
        self.kv_tokens = 0


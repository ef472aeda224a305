"""The continuous-batching generation loop, run in its own thread.

Between decode steps the loop runs control commands (abort, pause, weight updates, memory
release), admits waiting requests with a prefill forward, and drops finished rows. Every running
request then advances by one token in a single shared decode step. The forward passes and the KV
cache belong to a runner (`SlotRunner` for Llama-family models, `HFRunner` for any other); the
model is touched only from this thread, so a weight update never lands in the middle of a step.
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
from rlkube_runtime.engine.sampling import SamplingRows, sample_tokens
from rlkube_runtime.engine.sequence import Sequence
from rlkube_runtime.engine.slot_runner import PREFILL_TOKEN_BUDGET, CacheTooSmall

log = logging.getLogger(__name__)

# Released memory tags that stop the loop from stepping until they are resumed.
_BLOCKING_TAGS = frozenset({"weights", "kv_cache"})


class Scheduler:
    """Owns the waiting queue, the running batch and its KV cache; see the module docstring."""

    def __init__(self, runner, tokenizer, *, max_running_requests: int, vocab_size: int):
        self.runner = runner
        self.model = runner.model
        self.tokenizer = tokenizer
        self.max_running_requests = max_running_requests
        self.vocab_size = vocab_size
        self.device = next(self.model.parameters()).device
        self.weight_version = "default"
        self.paused_mode: str | None = None
        self.released_tags: set[str] = set()
        self.generated_tokens = 0  # since start, for throughput reporting
        self.finished_requests = 0  # since start, answered with any finish reason
        self.prefill_tokens = 0  # since start, tokens run through a prefill forward (retractions re-prefill)
        self.steps = 0  # generation steps run; a health check counts progress as health
        self.kv_tokens = 0  # tokens held in the running batch's cache, kept as a plain int

        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._stopping = False
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []  # in the runner's row order
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
        if "kv_cache" in tags or "cuda_graph" in tags:
            self._retract_running()
            self.runner.release()
        if "weights" in tags:
            offload.offload(self.model)
            self.runner.weights_moved()
        self.released_tags.update(tags)

    def resume_memory(self, tags: tuple[str, ...], offload) -> None:
        if "weights" in tags:
            offload.restore(self.model)
            self.runner.weights_moved()
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
        """Prefill as many waiting requests as fit, a token budget's worth per forward."""
        candidates: list[Sequence] = []
        while self._waiting and len(self._running) + len(candidates) < self.max_running_requests:
            seq = self._waiting.popleft()
            if seq.max_new_tokens - len(seq.output_ids) <= 0:
                seq.finish_now(protocol.finish_length(seq.max_new_tokens))
                self._deliver(seq)
            else:
                candidates.append(seq)
        if not candidates:
            return
        try:
            fits = self.runner.admissible([seq.slots_needed for seq in candidates])
        except CacheTooSmall as err:
            # Nothing runs and even one of these cannot fit: that request fails, the rest wait.
            seq = candidates.pop(0)
            seq.future.set_exception(protocol.ProtocolError("sampling_params.max_new_tokens", str(err)))
            fits = 0
        self._waiting.extendleft(reversed(candidates[fits:]))
        joiners = candidates[:fits]
        while joiners:
            group = [joiners.pop(0)]
            width = group[0].num_tokens
            while joiners and (len(group) + 1) * max(width, joiners[0].num_tokens) <= PREFILL_TOKEN_BUDGET:
                width = max(width, joiners[0].num_tokens)
                group.append(joiners.pop(0))
            self._running.extend(group)  # before the forward, so a failure fails them too
            # A retracted request re-prefills its prompt and the tokens it already generated.
            inputs = [seq.prompt_ids + seq.output_ids for seq in group]
            logits = self.runner.prefill(inputs, [seq.slots_needed for seq in group])
            self._record_routes(group, prefill=True)
            self.prefill_tokens += sum(map(len, inputs))
            self._sample_and_advance(logits, group)

    def _decode(self) -> None:
        """One token for every running request, in one step over the shared cache."""
        running = self._running
        logits = self.runner.decode([seq.output_ids[-1] for seq in running], [seq.num_tokens - 1 for seq in running])
        self._record_routes(running, prefill=False)
        self._sample_and_advance(logits, list(running))

    def _record_routes(self, sequences: list[Sequence], *, prefill: bool) -> None:
        """Hand each sequence that asked for them the routes of the forward just run."""
        routes = getattr(self.runner, "routes", None)
        if routes is None:
            return
        for seq, part in zip(sequences, routes):
            if seq.item.return_routed_experts:
                seq.record_routes(part, prefill=prefill)

    def _sample_and_advance(self, logits: torch.Tensor, sequences: list[Sequence]) -> None:
        rows = SamplingRows.build(
            [s.params for s in sequences], [s.next_uniform() for s in sequences], vocab_size=self.vocab_size, device=logits.device
        )
        tokens, logprobs = sample_tokens(logits, rows)
        # One device-to-host copy for both (token ids are exact in float64).
        tokens, logprobs = torch.stack([tokens.double(), logprobs.double()]).tolist()
        for seq, token, logprob in zip(sequences, tokens, logprobs):
            seq.append(int(token), logprob, self.tokenizer)
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
        self.runner.keep(keep)
        self.kv_tokens = sum(seq.num_tokens - 1 for seq in self._running)

    def _retire_finished_waiting(self) -> None:
        for seq in [s for s in self._waiting if s.finished]:
            self._deliver(seq)
        self._waiting = collections.deque(s for s in self._waiting if not s.finished)

    def _retract_running(self) -> None:
        """Move running requests back to the head of the queue and free their cache."""
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self.runner.clear()
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
        self.runner.clear()
        self.kv_tokens = 0


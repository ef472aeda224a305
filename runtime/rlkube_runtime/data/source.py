"""Hands out prompt groups for rollouts, epoch after epoch, and takes unfinished groups back.

Like slime's `RolloutDataSourceWithBuffer`, with one difference that matters for fault tolerance:
the state saved in a checkpoint holds the buffer of handed-back groups as well as the position, so
a resumed run continues with exactly the prompts (and partial rollouts) an uninterrupted run would
have used: none twice, none skipped.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

from rlkube_runtime.data.sample import Sample

STATE_VERSION = 1


class PromptSource:
    """Prompt groups in a seeded, per-epoch order, with a FIFO buffer served first.

    Epoch e visits every prompt once, in the order of `random.Random(seed + e)` when shuffling (the
    file order otherwise); a request that runs past the end of an epoch continues into the next.
    Each prompt becomes a group of `n_samples_per_prompt` copies with consecutive global `index`
    values and one `group_index`.
    """

    def __init__(
        self,
        prompts: Sequence[Sample],
        *,
        n_samples_per_prompt: int,
        shuffle: bool = True,
        seed: int = 42,
    ) -> None:
        if not prompts:
            raise ValueError("PromptSource needs at least one prompt; the prompt set is empty.")
        valid_n = isinstance(n_samples_per_prompt, int) and not isinstance(
            n_samples_per_prompt, bool
        )
        if not valid_n or n_samples_per_prompt < 1:
            raise ValueError(
                f"n_samples_per_prompt must be an integer >= 1, got {n_samples_per_prompt!r}."
            )
        self._prompts = list(prompts)
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self._fingerprint: str | None = None

        self.epoch = 0
        self.offset = 0  # position inside the epoch's order
        self.next_group_index = 0
        self.next_sample_index = 0
        self._order = self._epoch_order(0)
        self._buffer: list[list[Sample]] = []

    @classmethod
    def from_spec(
        cls, data_spec: Any, *, n_samples_per_prompt: int, tokenizer: Any = None
    ) -> PromptSource:
        """Load the DataSpec's prompt set and wrap it; the spec is read by attribute."""
        from rlkube_runtime.data.dataset import load_prompt_dataset_from_spec

        return cls(
            load_prompt_dataset_from_spec(data_spec, tokenizer=tokenizer),
            n_samples_per_prompt=n_samples_per_prompt,
            shuffle=data_spec.shuffle,
            seed=data_spec.seed,
        )

    def __len__(self) -> int:
        """Number of distinct prompts (one epoch)."""
        return len(self._prompts)

    @property
    def buffer_size(self) -> int:
        """Groups waiting in the buffer."""
        return len(self._buffer)

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """Return `num_groups` groups: buffered ones first (oldest first), then fresh prompts."""
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}.")
        groups = self._buffer[:num_groups]
        del self._buffer[:num_groups]
        while len(groups) < num_groups:
            groups.append(self._new_group(self._next_prompt()))
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put groups back (aborted or partial rollouts); the next `get_samples` serves them first.

        Groups keep their indices, so a resumed group is recognisably the same one.
        """
        for i, group in enumerate(groups):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise TypeError(
                    f"add_samples: group {i} must be a list of Sample, got {type(group).__name__}."
                )
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(
                    f"add_samples: group {i} has {len(group)} samples; every group must have "
                    f"n_samples_per_prompt={self.n_samples_per_prompt}."
                )
        self._buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position and buffer, for a checkpoint."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "num_prompts": len(self._prompts),
            "prompts_fingerprint": self.fingerprint(),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "buffer": [[s.to_dict() for s in group] for group in self._buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict`; refuses state saved over different prompts or settings,
        because resuming it would silently repeat or skip prompts."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"prompt source state version {state.get('version')!r} is not {STATE_VERSION}; "
                "it was written by a different rlkube version."
            )
        expected = {
            "prompts_fingerprint": self.fingerprint(),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "n_samples_per_prompt": self.n_samples_per_prompt,
        }
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            details = "; ".join(
                f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items()
            )
            raise ValueError(
                f"cannot resume the prompt source: {details}. Resume with the same prompt data, "
                "data.shuffle, data.seed and rollout.nSamplesPerPrompt, or start without the "
                "checkpoint."
            )
        offset = state["offset"]
        if not 0 <= offset <= len(self._prompts):
            raise ValueError(
                f"prompt source state offset {offset} is outside 0..{len(self._prompts)}."
            )
        self.epoch = state["epoch"]
        self.offset = offset
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self._order = self._epoch_order(self.epoch)
        self._buffer = [[Sample.from_dict(d) for d in group] for group in state["buffer"]]

    def fingerprint(self) -> str:
        """Hash of the prompts, labels and metadata, to tell a changed prompt set on resume."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for s in self._prompts:
                digest.update(
                    json.dumps(
                        [s.prompt, s.label, s.metadata], sort_keys=True, default=repr
                    ).encode()
                )
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    # --- internals ---------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _next_prompt(self) -> Sample:
        if self.offset == len(self._order):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        prompt = self._prompts[self._order[self.offset]]
        self.offset += 1
        return prompt

    def _new_group(self, prompt: Sample) -> list[Sample]:
        group = []
        for _ in range(self.n_samples_per_prompt):
            sample = copy.deepcopy(prompt)
            sample.group_index = self.next_group_index
            sample.index = self.next_sample_index
            self.next_sample_index += 1
            group.append(sample)
        self.next_group_index += 1
        return group

"""Synthetic tasks a tiny model can learn from scratch with RL on two CPU cores.

Each task is a small closed set of prompts with one-token answers over a small alphabet, so a
random-initialised model starts at chance (about 1 / vocabulary size) and GRPO with an exact-match
reward can lift it close to 1 within minutes. The alphabet is part of the task: the tiny tokenizer
is built from it, which is what keeps chance well above zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlkube_runtime.data.dataset import register_builtin_dataset


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    alphabet: str
    description: str
    make_records: Callable[[], list[dict]]


def _digit_successor() -> list[dict]:
    return [{"prompt": f"{d}>", "label": str((d + 1) % 10)} for d in range(10)]


def _add_mod10() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "label": str((a + b) % 10)} for a in range(10) for b in range(10)]


TASKS: dict[str, SyntheticTask] = {
    task.name: task
    for task in (
        SyntheticTask("digit-successor", "0123456789>", "'3>' -> '4': the next digit, modulo 10", _digit_successor),
        SyntheticTask("add-mod10", "0123456789+=", "'3+9=' -> '2': the last digit of a sum", _add_mod10),
    )
}


for _task in TASKS.values():
    # `data.promptData: builtin:<name>` reads these records like lines of a JSONL file.
    register_builtin_dataset(_task.name, _task.make_records)


def get_task(name: str) -> SyntheticTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown built-in task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None

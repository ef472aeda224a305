"""Loading a model's tokenizer as `AutoTokenizer` does, without its cost where it can be avoided.

`AutoTokenizer` imports transformers' configuration machinery, and with it torch: 3 CPU-seconds
in the rollout manager, a process that otherwise needs no torch. A checkpoint whose
tokenizer_config.json names the generic fast tokenizer (the tiny model's does) gets that class
directly, which is the class `AutoTokenizer` resolves the name to; every other one goes through
`AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_FAST = "PreTrainedTokenizerFast"


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False):
    if named_tokenizer_class(model_path) == GENERIC_FAST:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def named_tokenizer_class(model_path: str) -> str | None:
    """The tokenizer_class a local checkpoint's tokenizer_config.json names, if any."""
    try:
        config = json.loads((Path(model_path) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None

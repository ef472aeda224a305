"""Parse SGLang launch lines with the installed SGLang's own argument parser, in a process of its own.

Run as `python sglang_parse.py IN.json OUT.json`: IN holds a list of argument lists (what follows
`python -m sglang.launch_server`), OUT gets one result per line: `{"error": None, "values": {...}}`
or `{"error": "..."}`. The test (test_sglang_conformance.py) runs it in a subprocess because
importing `sglang.srt.server_args` drags in torch, transformers and SGLang's global settings
(warnings, logging, environment), which must not leak into the rest of the test session.

What a line goes through, exactly as `sglang.srt.server_args.prepare_server_args` does it:
`ServerArgs.add_cli_args` builds the parser, argparse parses the line (unknown flags, values that
fail a flag's `type`, values outside its `choices` and values given to bare flags all fail), and
`ServerArgs.from_cli_args` maps the namespace onto the `ServerArgs` dataclass (every field must
be there). Two checks are stricter than SGLang: an abbreviated flag fails (allow_abbrev=False;
SGLang would accept `--mem-frac`), and so does a line that sets one field twice, under one
spelling or two (`--tp-size` and `--tensor-parallel-size`), where argparse keeps the last silently.

What it cannot check, and so does not run: `ServerArgs.__post_init__`, which reads the model's
config.json, asks the GPU for its memory, picks kernels and checks flag combinations against
both; and whether the values work at run time (a free port, a reachable --dist-init-addr).

One module is replaced before the import: `sglang.srt.multimodal.internvl_utils`, which imports
torchvision (for InternVL's image transforms) when `sglang.srt.configs` is imported. torchvision's
wheel is built for one exact torch release, so installing it for a test could make pip move the
project's torch; argument parsing never touches InternVL, so a stand-in with the three names the
config modules import is enough.
"""

from __future__ import annotations

import argparse
import json
import sys
import types


class _ParseError(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting."""

    def error(self, message: str):
        raise _ParseError(message)


def _stand_in_internvl_utils() -> None:
    module = types.ModuleType("sglang.srt.multimodal.internvl_utils")
    module.IMAGENET_MEAN = (0.485, 0.456, 0.406)
    module.IMAGENET_STD = (0.229, 0.224, 0.225)

    def image_to_pixel_values(*args, **kwargs):
        raise NotImplementedError("stand-in: InternVL image handling is not part of argument parsing")

    module.image_to_pixel_values = image_to_pixel_values
    sys.modules[module.__name__] = module


def _duplicate_fields(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Fields that more than one flag of `argv` sets, as 'dest (--a, --b)'."""
    seen: dict[str, list[str]] = {}
    for token in argv:
        flag = token.split("=", 1)[0]
        action = parser._option_string_actions.get(flag)
        if action is not None:
            seen.setdefault(action.dest, []).append(flag)
    return [f"{dest} ({', '.join(flags)})" for dest, flags in seen.items() if len(flags) > 1]


def parse_lines(lines: list[list[str]]) -> list[dict]:
    _stand_in_internvl_utils()
    from sglang.srt.server_args import ServerArgs

    class ServerArgsWithoutPostInit(ServerArgs):
        def __post_init__(self):  # needs the model and a GPU: see the module docstring
            pass

    results = []
    for argv in lines:
        parser = _StrictParser(prog="sglang.launch_server", allow_abbrev=False)
        ServerArgs.add_cli_args(parser)
        try:
            duplicates = _duplicate_fields(parser, argv)
            if duplicates:
                raise _ParseError(f"fields set twice: {duplicates}")
            server_args = ServerArgsWithoutPostInit.from_cli_args(parser.parse_args(argv))
        except (_ParseError, TypeError, AttributeError) as err:  # from_cli_args: a field the namespace lacks
            results.append({"error": str(err)})
            continue
        results.append({"error": None, "values": {k: v for k, v in vars(server_args).items() if _is_json(v)}})
    return results


def _is_json(value) -> bool:
    """Scalars, and lists of them (nargs flags such as --lora-target-modules)."""
    if isinstance(value, list):
        return all(_is_json(v) and not isinstance(v, list) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        lines = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(parse_lines(lines), f)

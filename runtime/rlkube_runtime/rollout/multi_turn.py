"""A tool-use loop that multi-turn custom generate functions build on.

Follows slime's Search-R1 example (`examples/search-r1/generate_with_search.py`): the model
generates a turn; if the turn ends in a tool call, the tool runs and its formatted output is
appended to the response; the model continues from there; repeat until a turn without a call,
`max_turns`, or the response budget runs out. The response is one token stream with two kinds of
tokens, told apart by the loss mask:

    tokens:            prompt | model turn 1 | tool output 1 | model turn 2 | ...
    loss_mask:                | 1 1 ... 1    | 0 0 ... 0     | 1 1 ... 1    | ...
    rollout_log_probs:        | engine's     | 0.0 ... 0.0   | engine's     | ...

Tool tokens get log-prob 0.0 only to keep `rollout_log_probs` one entry per response token; the
trainer multiplies every per-token loss term by the loss mask, so those placeholders never
reach a gradient (the policy is trained on its own actions, not on what the tool said).

Model tokens are the engine's `output_ids`, not a re-tokenization of its text, so the trainer
scores exactly the tokens the engine sampled and their log-probs line up.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rlkube_runtime.data.sample import Sample, SampleStatus
from rlkube_runtime.rollout.generate import GenerateContext, append_response, request_id, routes_request

log = logging.getLogger(__name__)

# A tool takes the call's argument text and returns the result text, sync or async.
ToolFn = Callable[[str], Awaitable[str] | str]
# A turn's text -> (tool name, argument) when the turn ends in a tool call, else None.
ParseCall = Callable[[str], tuple[str, str] | None]
# A tool's result (or error) text -> the text appended to the response, e.g. "<result>…</result>".
FormatResult = Callable[[str], str]

STATE_KEY = "multi_turn"
"""`sample.metadata[STATE_KEY]`: turns taken, tool calls and tool errors (JSON-safe, so it
survives the partial-rollout buffer and checkpoints), plus the text of a turn cut by an abort."""


async def generate_with_tools(
    ctx: GenerateContext,
    sample: Sample,
    *,
    tools: Mapping[str, ToolFn],
    parse_call: ParseCall,
    format_result: FormatResult,
    max_turns: int | None = None,
) -> Sample:
    """Generate model turns and run the tool calls they end with, until the model stops calling.

    Each turn is one `/generate` with all tokens so far and `max_new_tokens` = what is left of
    `ctx.sampling.max_response_len` (tool output counts against it). It stops:
      - at a turn without a tool call: status from the engine (completed, or truncated on length);
      - after `max_turns` model turns (default `ctx.max_turns`): a call in the last turn is not
        run, since no later turn would read its result; status completed;
      - when the budget is used up (a turn cut by length, or tool output filling the rest, which
        is clipped to fit): status truncated, and a cut-off turn is not parsed for a call;
      - on an abort: status aborted, everything generated so far kept, so partial rollout can
        call this again on the same sample and it carries on (turn count included).
    An unknown tool or a tool that raises becomes an error text for the model to read; the
    sample stays usable (counted in `sample.metadata["multi_turn"]["tool_errors"]`).
    """
    limit = ctx.max_turns if max_turns is None else max_turns
    if limit < 1:
        raise ValueError(f"generate_with_tools: max_turns must be >= 1, got {limit}")
    if not sample.tokens:
        raise ValueError(
            f"generate_with_tools: sample index={sample.index} has no prompt tokens; "
            "tokenize the prompt into sample.tokens before generating"
        )
    state = _loop_state(sample)
    while state["turns"] < limit:
        if ctx.aborted.is_set():
            # The rollout is full and aborting: stop between turns; the sample goes back to the
            # buffer with what it has (kept when partial rollout is on).
            sample.status = SampleStatus.ABORTED
            return sample
        budget = ctx.sampling.max_response_len - sample.response_length
        if budget <= 0:
            sample.status = SampleStatus.TRUNCATED
            break
        response = await ctx.generate(_turn_request(ctx, sample, budget))
        append_response(sample, response, loss_mask_value=1)
        # A turn resumed after an abort parses as one text with the part generated before it.
        turn_text = state.pop("partial_turn_text", "") + response.get("text", "")
        if sample.status == SampleStatus.ABORTED:
            state["partial_turn_text"] = turn_text
            return sample
        state["turns"] += 1
        if sample.status == SampleStatus.TRUNCATED:
            break
        call = parse_call(turn_text)
        if call is None or state["turns"] >= limit:
            break
        if sample.response_length >= ctx.sampling.max_response_len:
            sample.status = SampleStatus.TRUNCATED
            break
        name, argument = call
        result, ok = await _call_tool(tools, name, argument)
        state["tool_calls"] += 1
        state["tool_errors"] += 0 if ok else 1
        _append_tool_output(ctx, sample, format_result(result))
    return sample


def _turn_request(ctx: GenerateContext, sample: Sample, budget: int) -> dict[str, Any]:
    # no_stop_trim keeps the stop string (e.g. "</search>") in the text, as slime does: the call
    # parser needs the closing tag, and the text then matches the tokens, which include it.
    return {
        "input_ids": list(sample.tokens),
        "sampling_params": {**ctx.sampling.sampling_params(budget), "no_stop_trim": True},
        "return_logprob": True,
        "rid": request_id(ctx, sample),
        **routes_request(ctx),
    }


async def _call_tool(tools: Mapping[str, ToolFn], name: str, argument: str) -> tuple[str, bool]:
    """The tool's result text and True, or an error text the model can read and False.

    Tool failures are the model's problem to handle (a bad query, a malformed expression), not the
    rollout's: failing the rollout for one would discard every other sample in flight.
    """
    tool = tools.get(name)
    if tool is None:
        return f"Error: unknown tool {name!r}; available tools: {', '.join(sorted(tools)) or 'none'}.", False
    try:
        result = tool(argument)
        if inspect.isawaitable(result):
            result = await result
    except Exception as exc:  # noqa: BLE001 - user tool code may fail with anything; cancellation still propagates
        log.warning("tool %r failed on argument %r: %s: %s", name, argument[:200], type(exc).__name__, exc)
        return f"Error: tool {name!r} failed: {type(exc).__name__}: {exc}", False
    if not isinstance(result, str):
        log.warning("tool %r returned %s, not a string", name, type(result).__name__)
        return f"Error: tool {name!r} returned {type(result).__name__}, not text.", False
    return result, True


def _append_tool_output(ctx: GenerateContext, sample: Sample, text: str) -> None:
    """Append tool output as masked response tokens, clipped to the response budget."""
    ids = list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"])
    room = ctx.sampling.max_response_len - sample.response_length
    if len(ids) > room:
        ids = ids[:room]
        text = ctx.tokenizer.decode(ids)
    sample.tokens = list(sample.tokens) + ids
    sample.response = (sample.response or "") + text
    sample.response_length += len(ids)
    sample.loss_mask = list(sample.loss_mask or []) + [0] * len(ids)
    sample.rollout_log_probs = list(sample.rollout_log_probs or []) + [0.0] * len(ids)


def _loop_state(sample: Sample) -> dict[str, Any]:
    """The loop's counters: carried over when continuing a partial response, fresh otherwise.

    A sample reset for a retry keeps its metadata but loses its response, so an empty response
    means start over whatever the metadata says.
    """
    state = sample.metadata.get(STATE_KEY)
    if sample.response_length == 0 or not isinstance(state, dict):
        state = {"turns": 0, "tool_calls": 0, "tool_errors": 0}
        sample.metadata[STATE_KEY] = state
    return state

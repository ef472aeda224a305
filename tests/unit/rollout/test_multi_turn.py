"""The multi-turn tool loop against the real built-in engine, in process.

The tiny model does not know any tool syntax, so the tests choose what counts as a call instead
of faking the engine: every token id is a stop id (each model turn is exactly one sampled token,
ending with finish reason "stop"), and `parse_call` reads whatever a turn says as a call to a test
tool. A spy around `engine.generate` records each request and the engine's real response, so the
expected token layout, masks and log-probs are built from what the engine actually returned.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
from rlkube_runtime.data.sample import Sample, SampleStatus
from rlkube_runtime.engine.engine import Engine, EngineConfig
from rlkube_runtime.rollout.generate import GenerateContext, SamplingConfig
from rlkube_runtime.rollout.multi_turn import STATE_KEY, generate_with_tools
from rlkube_runtime.rollout.tools_example import (
    calculator,
    format_calc_result,
    generate_with_calculator,
    parse_calc_call,
)
from rlkube_runtime.tiny.model import build_tiny_checkpoint
from rlkube_runtime.actors.trainer import to_train_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-multi-turn"), seed=5)


@pytest.fixture(scope="module")
def engine(model_dir):
    # Shared by the module's tests: each request carries its own settings, and greedy decoding
    # makes every response independent of what ran before.
    engine = Engine.load(EngineConfig(model_path=str(model_dir), seed=11))
    engine.start()
    yield engine
    engine.stop()


class Spy:
    """Passes requests to the engine unchanged; keeps copies of requests and responses."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.requests: list[dict] = []
        self.responses: list[dict] = []

    async def __call__(self, payload: dict) -> dict:
        self.requests.append(copy.deepcopy(payload))
        response = await self.engine.generate(payload)
        self.responses.append(response)
        return response


def _context(engine: Engine, spy: Spy, *, max_len: int = 64, max_turns: int = 3, one_token_turns: bool = True):
    stop_ids = tuple(range(engine.vocab_size)) if one_token_turns else ()
    return GenerateContext(
        generate=spy,
        sampling=SamplingConfig(max_response_len=max_len, temperature=0.0, stop_token_ids=stop_ids),
        tokenizer=engine.tokenizer,
        max_turns=max_turns,
        rollout_id=0,
    )


def _sample(engine: Engine, prompt: str = "2+3=") -> Sample:
    return Sample(index=0, group_index=0, prompt=prompt, tokens=_ids(engine, prompt))


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _logprobs(response: dict) -> list[float]:
    return [float(lp) for lp, _, _ in response["meta_info"]["output_token_logprobs"]]


def _every_turn_calls(name: str):
    return lambda text: (name, text)


def _tag(result: str) -> str:
    return f"<r>{result}</r>"


def _echo_sync(argument: str) -> str:
    return f"{argument}!"


async def _echo_async(argument: str) -> str:
    await asyncio.sleep(0)
    return f"{argument}!"


@pytest.mark.parametrize("echo", [_echo_sync, _echo_async], ids=["sync-tool", "async-tool"])
async def test_model_and_tool_tokens_interleave_with_mask_1_on_model_tokens_and_engine_logprobs(engine, echo):
    spy = Spy(engine)
    sample = _sample(engine)
    prompt = list(sample.tokens)
    result = await generate_with_tools(
        _context(engine, spy, max_len=64, max_turns=3), sample,
        tools={"echo": echo}, parse_call=_every_turn_calls("echo"), format_result=_tag,
    )

    assert len(spy.responses) == 3
    tokens, mask, logprobs, text = list(prompt), [], [], ""
    for turn, response in enumerate(spy.responses):
        # Each turn sees everything so far and is offered exactly the budget left.
        assert spy.requests[turn]["input_ids"] == tokens
        assert spy.requests[turn]["sampling_params"]["max_new_tokens"] == 64 - (len(tokens) - len(prompt))
        assert len(response["output_ids"]) == 1
        tokens += response["output_ids"]
        mask += [1]
        logprobs += _logprobs(response)
        text += response["text"]
        if turn < 2:  # the call in the last turn is not run: no turn would read its result
            tool = _tag(response["text"] + "!")
            tokens += _ids(engine, tool)
            mask += [0] * len(_ids(engine, tool))
            logprobs += [0.0] * len(_ids(engine, tool))
            text += tool

    assert result.tokens == tokens
    assert result.loss_mask == mask
    assert result.rollout_log_probs == logprobs
    assert result.response == text
    assert result.response_length == len(tokens) - len(prompt) == len(mask)
    assert result.prompt_tokens == prompt
    assert result.status == SampleStatus.COMPLETED
    assert result.metadata[STATE_KEY] == {"turns": 3, "tool_calls": 2, "tool_errors": 0}
    result.check_lengths()


async def test_a_turn_without_a_call_ends_the_loop_and_max_turns_defaults_to_the_context(engine):
    spy = Spy(engine)
    calls_left = [1]

    def first_turn_only(text):
        if calls_left[0]:
            calls_left[0] -= 1
            return ("echo", text)
        return None

    result = await generate_with_tools(
        _context(engine, spy, max_turns=4), _sample(engine),
        tools={"echo": _echo_sync}, parse_call=first_turn_only, format_result=_tag,
    )
    assert len(spy.requests) == 2 and result.status == SampleStatus.COMPLETED
    assert result.metadata[STATE_KEY]["turns"] == 2

    spy = Spy(engine)
    result = await generate_with_tools(
        _context(engine, spy, max_turns=2), _sample(engine),
        tools={"echo": _echo_sync}, parse_call=_every_turn_calls("echo"), format_result=_tag,
    )
    assert len(spy.requests) == 2 and result.metadata[STATE_KEY]["tool_calls"] == 1
    assert result.status == SampleStatus.COMPLETED


async def test_tool_output_counts_against_the_budget_and_is_clipped_to_it(engine):
    # max_len 9: turn 1 (1 token) + tool (6 tokens) = 7; turn 2 gets max_new_tokens 2 and takes
    # 1; the second tool output is clipped to the 1 token left; status truncated.
    spy = Spy(engine)
    result = await generate_with_tools(
        _context(engine, spy, max_len=9, max_turns=4), _sample(engine),
        tools={"six": lambda _: "abcdef"}, parse_call=_every_turn_calls("six"), format_result=lambda r: r,
    )
    assert [r["sampling_params"]["max_new_tokens"] for r in spy.requests] == [9, 2]
    assert result.response_length == 9
    assert result.loss_mask == [1, 0, 0, 0, 0, 0, 0, 1, 0]
    assert result.response_tokens[-1] == _ids(engine, "a")[0]
    assert result.response.endswith("abcdef" + spy.responses[1]["text"] + "a")
    assert result.status == SampleStatus.TRUNCATED
    result.check_lengths()


async def test_a_turn_cut_by_the_budget_is_truncated_and_not_parsed_for_a_call(engine):
    # max_len 8: turn 1 + tool = 7 tokens, turn 2 is cut at max_new_tokens 1 (finish "length").
    spy = Spy(engine)
    calls = []

    def six(argument):
        calls.append(argument)
        return "abcdef"

    result = await generate_with_tools(
        _context(engine, spy, max_len=8, max_turns=4), _sample(engine),
        tools={"six": six}, parse_call=_every_turn_calls("six"), format_result=lambda r: r,
    )
    assert [r["sampling_params"]["max_new_tokens"] for r in spy.requests] == [8, 1]
    assert spy.responses[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(calls) == 1
    assert result.response_length == 8 and result.loss_mask == [1, 0, 0, 0, 0, 0, 0, 1]
    assert result.status == SampleStatus.TRUNCATED


async def test_unknown_and_failing_tools_become_error_text_and_the_loop_goes_on(engine):
    spy = Spy(engine)
    plan = iter([("nope", "x"), ("boom", "y"), None])

    async def boom(argument):
        raise RuntimeError(f"disk on fire while reading {argument}")

    result = await generate_with_tools(
        _context(engine, spy, max_len=256, max_turns=4), _sample(engine),
        tools={"boom": boom}, parse_call=lambda _: next(plan), format_result=_tag,
    )
    unknown = "<r>Error: unknown tool 'nope'; available tools: boom.</r>"
    failed = "<r>Error: tool 'boom' failed: RuntimeError: disk on fire while reading y</r>"
    assert unknown in result.response and failed in result.response
    assert len(spy.requests) == 3
    assert result.status == SampleStatus.COMPLETED
    assert result.metadata[STATE_KEY] == {"turns": 3, "tool_calls": 2, "tool_errors": 2}
    assert result.loss_mask.count(0) == len(_ids(engine, unknown)) + len(_ids(engine, failed))
    result.check_lengths()


async def test_an_abort_keeps_the_partial_response_and_a_second_call_carries_on(engine):
    """Partial rollout: the aborted sample goes back to the buffer as it is and is continued."""

    class AbortSecondTurn(Spy):
        async def __call__(self, payload):
            if len(self.requests) != 1:
                return await super().__call__(payload)
            # Paused, the engine holds the request without stepping: the abort finds it waiting.
            await self.engine.pause({"mode": "in_place"})
            task = asyncio.create_task(super().__call__(payload))
            await asyncio.sleep(0.05)
            await self.engine.abort({"abort_all": True})
            await self.engine.resume()
            return await task

    spy = AbortSecondTurn(engine)
    sample = _sample(engine)
    ctx = _context(engine, spy, max_turns=3)
    kwargs = {"tools": {"echo": _echo_sync}, "parse_call": _every_turn_calls("echo"), "format_result": _tag}

    aborted = await generate_with_tools(ctx, sample, **kwargs)
    assert spy.responses[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted.status == SampleStatus.ABORTED
    kept = list(aborted.tokens)
    assert aborted.response_length == 1 + len(_ids(engine, _tag(spy.responses[0]["text"] + "!")))
    assert aborted.metadata[STATE_KEY]["turns"] == 1
    aborted.check_lengths()

    aborted.status = SampleStatus.PENDING  # what the rollout does before handing it back
    done = await generate_with_tools(ctx, aborted, **kwargs)
    assert done.tokens[: len(kept)] == kept
    assert len(spy.requests) == 4  # turn 1, the aborted turn 2, turn 2 again, turn 3
    assert done.metadata[STATE_KEY]["turns"] == 3
    assert done.status == SampleStatus.COMPLETED
    done.check_lengths()


async def test_the_train_batch_masks_exactly_the_tool_tokens(engine):
    spy = Spy(engine)
    sample = await generate_with_tools(
        _context(engine, spy, max_turns=3), _sample(engine),
        tools={"echo": _echo_sync}, parse_call=_every_turn_calls("echo"), format_result=_tag,
    )
    sample.reward = 1.0
    batch = to_train_batch([sample])
    tool_positions = {i for i, m in enumerate(sample.loss_mask) if m == 0}
    assert tool_positions  # the test is about them
    assert batch.response_lengths == [sample.response_length]
    assert [i for i, m in enumerate(batch.loss_masks[0].tolist()) if m == 0] == sorted(tool_positions)
    assert batch.tokens[0].tolist() == sample.tokens
    assert batch.rollout_log_probs[0].tolist() == pytest.approx(sample.rollout_log_probs)


def test_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert calculator("2+3*4") == "14"
    assert calculator("7/2") == "3.5"
    assert calculator("-(2**3) % 5") == "2"
    with pytest.raises(ValueError, match="not allowed"):
        calculator("__import__('os').getcwd()")
    with pytest.raises(ValueError, match="exponent"):
        calculator("9**9**9")
    with pytest.raises(ValueError, match="cannot parse"):
        calculator("2+")
    with pytest.raises(ZeroDivisionError):
        calculator("1/0")


def test_a_calc_call_must_end_the_turn():
    assert parse_calc_call("so <calc> 2+3 </calc>") == ("calculator", "2+3")
    assert parse_calc_call("<calc>1</calc> and more") is None
    assert parse_calc_call("no call") is None
    assert format_calc_result("5") == "<result>5</result>"


async def test_generate_with_calculator_stops_turns_at_the_call_and_keeps_the_stop_string(engine):
    spy = Spy(engine)
    ctx = _context(engine, spy, max_len=12, max_turns=2, one_token_turns=False)
    result = await generate_with_calculator(ctx, _sample(engine))
    params = spy.requests[0]["sampling_params"]
    assert params["stop"] == ["</calc>"] and params["no_stop_trim"] is True
    # The tiny model knows no <calc>: one turn, all of it the model's.
    assert len(spy.requests) == 1 and result.loss_mask == [1] * result.response_length
    assert result.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    result.check_lengths()


async def test_a_rollout_that_is_aborting_stops_the_loop_between_turns(engine, model_dir):
    from rlkube_runtime.data.sample import Sample, SampleStatus
    from rlkube_runtime.rollout.generate import GenerateContext, SamplingConfig
    from rlkube_runtime.rollout.multi_turn import generate_with_tools

    ctx = GenerateContext(
        generate=engine.generate, sampling=SamplingConfig(max_response_len=8), tokenizer=engine.tokenizer,
        max_turns=4, rollout_id=0,
    )
    ctx.aborted.set()
    sample = Sample(group_index=0, index=0, prompt="1+1=", tokens=engine.tokenizer("1+1=", add_special_tokens=False)["input_ids"])
    out = await generate_with_tools(ctx, sample, tools={}, parse_call=lambda text: None, format_result=str)
    assert out.status == SampleStatus.ABORTED and out.response_length == 0

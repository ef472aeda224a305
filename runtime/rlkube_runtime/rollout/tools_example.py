"""A worked multi-turn example: the model calls a calculator as `<calc>2+3*4</calc>` and reads
`<result>14</result>` back before it goes on.

Self-contained (no service to call), so it runs with the tiny model and the synthetic tasks and
shows the smallest complete custom generate function on top of `generate_with_tools`:

    spec:
      rollout:
        customGenerateFunction: rlkube_runtime.rollout.tools_example:generate_with_calculator
        maxTurns: 4

A real tool (search, code execution) swaps `calculator`, `parse_calc_call` and
`format_calc_result` for its own and keeps the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.rollout.generate import GenerateContext
from rlkube_runtime.rollout.multi_turn import generate_with_tools

CALL_END = "</calc>"
# The call must end the turn: the stop string ends generation right after it.
_CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # keeps `9**9**9` from hanging a rollout worker


async def generate_with_calculator(ctx: GenerateContext, sample: Sample) -> Sample:
    """Custom generate function (`spec.rollout.customGenerateFunction`) with a calculator tool.

    Adds `</calc>` to the stop strings when the spec lacks it, so a turn always ends at a call.
    """
    if CALL_END not in ctx.sampling.stop:
        ctx = dataclasses.replace(ctx, sampling=dataclasses.replace(ctx.sampling, stop=(*ctx.sampling.stop, CALL_END)))
    return await generate_with_tools(
        ctx, sample, tools={"calculator": calculator}, parse_call=parse_calc_call, format_result=format_calc_result
    )


def parse_calc_call(turn_text: str) -> tuple[str, str] | None:
    """`("calculator", expression)` when the turn ends in `<calc>expression</calc>`, else None."""
    match = _CALL.search(turn_text)
    return ("calculator", match.group(1).strip()) if match else None


def format_calc_result(result: str) -> str:
    return f"<result>{result}</result>"


def calculator(expression: str) -> str:
    """Evaluate arithmetic (numbers, + - * / // % **, parentheses) without `eval`.

    Raises ValueError naming the part that is not allowed; the loop shows the model that text.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS} allowed")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not allowed; use numbers, + - * / // % ** and parentheses")

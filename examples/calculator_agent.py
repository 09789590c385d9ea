"""The calculator task as an agent program of your own: the OpenAI SDK, a tool the program runs itself.

It knows nothing of agent-r1. It reads a task (one JSON line on stdin), asks the model with a system
prompt, the question and one tool, runs every calculator call itself, sends the results back with the
history as the SDK gave it, and prints the model's final answer. Pointed at agent-r1's gateway it trains
unchanged (docs/agents.md); pointed at any OpenAI-compatible server it simply runs:

    agent-r1 train task=gateway task.command="python examples/calculator_agent.py" \
        task.reward=examples.calculator_agent:reward task.data=tasks.jsonl     # from the repository root
    echo '{"question": "What is 12 * 34?"}' | OPENAI_BASE_URL=http://HOST:8000/v1 python examples/calculator_agent.py

`reward` is the trainer-side reward function (`task.reward`): the built-in calculator task's, on the
answer the program printed.
"""

from __future__ import annotations

import ast
import json
import operator
import sys

from openai import OpenAI

SYSTEM = (
    "Solve the problem. Use the calculator for every computation, then give the final number inside <answer></answer>."
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return the result.\n\n"
        "Supports numbers, + - * / // % ** and parentheses (no variables or functions).",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": 'The arithmetic expression, for example "(48 / 2) * 3 + 1".',
                }
            },
            "required": ["expression"],
        },
    },
}
_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip


def calculate(expression: str) -> str:
    """The tool, run by this program: + - * / // % ** and parentheses over numbers."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("unsupported expression")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"Error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.10g}"


def run(
    task: dict, base_url: str | None = None, api_key: str | None = None, max_calls: int = 8, http_client=None
) -> str:
    """Ask, run the calculator for every call, ask again, until the model answers; return the answer.
    `http_client`: an `httpx.Client` to share (a new one loads the CA bundle: ~20 ms of CPU per client)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    for _ in range(max_calls):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))  # the answer, sent back as it came
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return ""


def reward(task: dict, episode, output) -> tuple[float, dict[str, float]]:
    """The trainer's side: the built-in calculator task's reward (exact numeric match of the answer, plus
    0.1 x the answer-format check, as the demo's RL stage) on the answer: what `run` returned when it ran as
    a function (`task.function`), what the program printed when it ran as a command."""
    from agent_r1.tasks.calculator import reward as calculator_reward

    answer = output.value if isinstance(output.value, str) else output.stdout
    return calculator_reward(task, answer.strip(), format_weight=0.1)


if __name__ == "__main__":
    print(run(json.loads(sys.stdin.readline())))

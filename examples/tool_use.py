"""A tool-use loop: the model writes ``calc(<expression>)``; we evaluate it and append the result."""

import ast
import operator

from _common import setup

from splitserve import lang

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def calc(expr: str) -> str:
    """Evaluate + - * / over numbers, safely (no eval)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression {expr!r}")
    try:
        return str(ev(ast.parse(expr.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


@lang.function
def tool_use(s, question: str, max_calls: int = 3):
    s += ("Use calc(...) for arithmetic.\nQuestion: What is 12 * 7?\n"
          "Thought: calc(12 * 7) = 84\nAnswer: 84\n\n")
    s += f"Question: {question}\nThought: calc("
    for _ in range(max_calls):
        s += lang.gen("expr", max_tokens=24, stop=")")
        s += f") = {calc(s['expr'])}\n"
        s += lang.select("next", ["Answer:", "Thought: calc("])
        if s["next"] == "Answer:":
            break
    s += lang.gen("answer", max_tokens=16, stop="\n")


if __name__ == "__main__":
    setup(__doc__)
    s = tool_use.run("What is 123 + 456?", temperature=0)
    print(s.text())

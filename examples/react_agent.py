"""A ReAct-style loop that branches on ``select``: think, pick an action, observe, repeat."""

from _common import setup

from splitserve import lang

FACTS = {"paris": "Paris is the capital of France, population about 2.1 million.",
         "eiffel": "The Eiffel Tower is 330 metres tall and stands in Paris."}


def search(query: str) -> str:
    hits = [v for k, v in FACTS.items() if k in query.lower()]
    return hits[0] if hits else "No result."


@lang.function
def react(s, question: str, max_steps: int = 3):
    s += ("Answer questions using the actions search[query] and finish[answer].\n\n"
          f"Question: {question}\n")
    for step in range(max_steps):
        s += f"Thought {step + 1}:" + lang.gen(f"thought{step}", max_tokens=32, stop="\n")
        s += f"\nAction {step + 1}: " + lang.select(f"action{step}", ["search", "finish"]) + "["
        s += lang.gen(f"arg{step}", max_tokens=16, stop="]") + "]\n"
        if s[f"action{step}"] == "finish":
            return s[f"arg{step}"]
        s += f"Observation {step + 1}: {search(s[f'arg{step}'])}\n"
    return None


if __name__ == "__main__":
    setup(__doc__)
    s = react.run("How tall is the Eiffel Tower?", temperature=0)
    print(s.text())
    print("answer:", s.return_value)

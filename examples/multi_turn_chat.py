"""Multi-turn chat: roles render through the model's chat template; the reply streams."""

from _common import setup

from splitserve import lang


@lang.function
def chat(s, turns: list[str]):
    s += lang.system("You are a helpful, concise assistant.")
    for i, turn in enumerate(turns):
        s += lang.user(turn)
        s += lang.assistant(lang.gen(f"reply{i}", max_tokens=48))


if __name__ == "__main__":
    setup(__doc__)
    s = chat.run(["Name a good book about the sea.", "Who wrote it?"], temperature=0,
                 stream=True)
    for chunk in s.text_iter():
        print(chunk, end="", flush=True)
    print("\n---", len(s.messages()), "messages")

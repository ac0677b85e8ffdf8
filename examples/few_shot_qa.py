"""Few-shot question answering over a batch: the few-shot block is sent once and cached."""

from _common import setup

from splitserve import lang

EXAMPLES = [("What is the capital of France?", "Paris"), ("How many legs has a spider?", "8")]


@lang.function
def few_shot_qa(s, question: str):
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + lang.gen("answer", max_tokens=16, stop="\n")


if __name__ == "__main__":
    setup(__doc__)
    questions = ["What is the capital of Italy?", "How many wheels has a bicycle?"]
    for q, s in zip(questions, few_shot_qa.run_batch([{"question": q} for q in questions],
                                                     temperature=0, progress_bar=True)):
        print(q, "->", s["answer"] if isinstance(s, lang.ProgramState) else s)

"""Parallel generation with ``fork``: the shared prefix is sent once, the branches run at once."""

from _common import setup

from splitserve import lang


@lang.function
def tips(s, topic: str, n: int = 3):
    s += f"Here are {n} short tips for {topic}.\n"
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}:" + lang.gen("tip", max_tokens=24, stop="\n")
    forks.join()
    for i, f in enumerate(forks):
        s += f"{i + 1}.{f['tip']}\n"
    s += "In summary," + lang.gen("summary", max_tokens=32, stop="\n")


if __name__ == "__main__":
    setup(__doc__)
    print(tips.run("staying healthy", temperature=0.7, seed=1).text())

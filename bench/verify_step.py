"""One speculative verify step's cost, in-process: the step of one sequence with its missing token
and ``K`` drafts run as an extend (the general path: extend attention over the pool, per-op
layers) and as ``K + 1`` decode rows sharing the sequence's decode-cache slot (the fused C
decode layers, ``ForwardBatch.as_decode_rows``), against a plain one-token decode step.

Every kind rewrites the same positions of the same pool, so the steps are repeated in place and
the fastest of each is kept: the extends first (a step with no decode rows drops the decode
cache's slots, so a decode step after one copies its sequence in again), then the plain and the
decode-rows steps interleaved (the slot kept between them, as in serving).

Example::

    python bench/verify_step.py --context 300 --drafts 4 --repeats 30
"""

from __future__ import annotations

import argparse
import time

from common import cpu_line, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--context", type=int, default=300, help="tokens before the step")
    parser.add_argument("--drafts", type=int, default=4, help="drafted tokens (K)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernels", default="auto", help="EngineConfig.kernels (auto, c, torch)")
    args = parser.parse_args()

    import torch

    from splitserve.config import EngineConfig
    from splitserve.engine.forward_batch import build_forward_batch
    from splitserve.engine.kv_pool import KVPool, pages_for
    from splitserve.engine.model.loader import load_model

    torch.set_num_threads(args.threads)
    model, cfg = load_model(resolve_model(args.model), dtype=torch.bfloat16,
                            engine=EngineConfig(kernels=args.kernels))
    ps, n, k = 16, args.context, args.drafts
    pool = KVPool(cfg.kv_layout(ps, "bfloat16"), pages_for(n + k + 1, ps) + 1)
    pages = pool.allocator.alloc(pages_for(n + k + 1, ps))
    tokens = torch.randint(100, 30000, (n + k + 1,), generator=torch.Generator().manual_seed(0))
    ids = tokens.tolist()

    def batch(chunk: list[int], start: int, counts: list[int] | None = None):
        return build_forward_batch([chunk], [start], [pages], ps, [0], seq_ids=[1],
                                   logit_counts=counts, max_seq_lens=[n + k + 1])

    with torch.inference_mode():
        model(batch(ids[:n], 0), pool)
        kinds = {
            "plain decode (1 row)": batch(ids[n : n + 1], n),
            f"verify K={k} as extend": batch(ids[n : n + k + 1], n, [k + 1]),
            f"verify K={k} as decode rows": batch(ids[n : n + k + 1], n, [k + 1]).as_decode_rows(),
        }
        best = dict.fromkeys(kinds, float("inf"))
        names = list(kinds)
        for group in (names[1:2], [names[0], names[2]]):
            for _ in range(args.repeats + 1):  # the first round warms up
                for name in group:
                    t = time.perf_counter()
                    model(kinds[name], pool)
                    best[name] = min(best[name], time.perf_counter() - t)
    print(f"# {cpu_line()}, {args.threads} thread(s), context {n}, kernels {args.kernels}, "
          f"fastest of {args.repeats}")
    plain = best["plain decode (1 row)"]
    for name, s in best.items():
        print(f"{name:32s} {s * 1e3:7.2f} ms  {s / plain:5.2f}x plain")


if __name__ == "__main__":
    main()

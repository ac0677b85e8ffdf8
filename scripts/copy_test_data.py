"""Copy the data sets that tests/ and bench/ read into tests/data/, sampling the large ones.

Reproducible: the same source gives the same files (sorted listings, ``random.Random(SEED)``).
Each set keeps its upstream licence file; tests/data/MANIFEST.json says where every set came
from and what was sampled, and how. Run it again only to refresh the copy from a full source::

    python scripts/copy_test_data.py --source /path/to/data   # a folder laid out as below

``--source`` holds ``jsonschemabench/``, ``json-schema-test-suite/``, ``prompts/`` and
``openai-openapi/`` (the layout of the data folder the project was written against).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

SEED = 0
DEST = Path(__file__).resolve().parents[1] / "tests" / "data"
SHAREGPT_SAMPLE = 300  # conversations: bench's defaults ask for at most 64 prompts
SCHEMAS_PER_SUBSET = 6  # raw JSONSchemaBench schemas per subset (bench/grammar.py samples 4)
# The raw schemas tests/e2e/test_grammar.py sends through a cluster: always copied.
E2E_SCHEMAS = [
    *(f"Github_trivial/{n}.json" for n in (
        "o25982", "o27032", "o3616", "o36250", "o44126", "o60854", "o69753", "o70564",
        "o71845", "o73407", "o77414", "o78398", "o8484", "o89152", "o89499", "o90950",
    )),
    *(f"Github_easy/{n}.json" for n in ("o39432", "o41692", "o81574", "o89671")),
    *(f"Glaiveai2K/{n}.json" for n in (
        "calculate_area_248bb00a", "generate_invoice_68967986", "generate_invoice_699a7e70",
    )),
    *(f"Snowplow/sp_{n}_Normalized.json" for n in (320, 59, 67, 89)),
    *(f"WashingtonPost/wp_{n}_Normalized.json" for n in (39, 52, 88, 95, 97)),
]


def copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copyfile(src, dst)


def sample_schemas(src: Path, dst: Path) -> dict[str, int]:
    """Per subset: the e2e test's schemas plus seeded random others, ``SCHEMAS_PER_SUBSET`` in
    all (or more where the test names more). Returns: schemas copied per subset."""
    rng = random.Random(SEED)
    counts = {}
    for subset in sorted(p.name for p in src.iterdir() if p.is_dir()):
        files = sorted(p.name for p in (src / subset).glob("*.json"))
        keep = {n.split("/")[1] for n in E2E_SCHEMAS if n.startswith(subset + "/")}
        rest = [f for f in files if f not in keep]
        keep |= set(rng.sample(rest, max(0, min(len(rest), SCHEMAS_PER_SUBSET - len(keep)))))
        for name in sorted(keep):
            copy(src / subset / name, dst / subset / name)
        counts[subset] = len(keep)
    return counts


def sample_sharegpt(src: Path, dst: Path) -> None:
    """``SHAREGPT_SAMPLE`` conversations of ``src``, seeded, in their original order."""
    # split("\n"), not splitlines(): a record may hold U+2028, which splitlines() cuts at.
    lines = [line for line in src.read_text(encoding="utf-8").split("\n") if line.strip()]
    picked = sorted(random.Random(SEED).sample(range(len(lines)), SHAREGPT_SAMPLE))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(lines[i] + "\n" for i in picked), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="the full data folder")
    args = parser.parse_args()
    src = args.source
    bench = src / "jsonschemabench"
    copy(bench / "maskbench", DEST / "jsonschemabench" / "maskbench")  # all of it
    counts = sample_schemas(bench / "schemas", DEST / "jsonschemabench" / "schemas")
    suite = src / "json-schema-test-suite"
    for name in ("LICENSE", "tests/draft2020-12", "remotes"):
        copy(suite / name, DEST / "json-schema-test-suite" / name)
    prompts = src / "prompts"
    sample_sharegpt(prompts / "sharegpt" / "sharegpt_v3_sample1000.jsonl",
                    DEST / "prompts" / "sharegpt" / f"sharegpt_v3_sample{SHAREGPT_SAMPLE}.jsonl")
    for name in ("gsm8k/LICENSE", "gsm8k/test.jsonl", "gsm8k/train_first500.jsonl",
                 "fastchat/LICENSE", "fastchat/mt_bench/question.jsonl",
                 "sglang-benchmark/tip_suggestion_topic.jsonl"):
        copy(prompts / name, DEST / "prompts" / name)
    for name in ("LICENSE", "openapi.json"):
        copy(src / "openai-openapi" / name, DEST / "openai-openapi" / name)
    print(json.dumps({"schemas_per_subset": counts}, indent=1))


if __name__ == "__main__":
    main()

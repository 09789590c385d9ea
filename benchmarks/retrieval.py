"""Retrieval recall@k of HotpotQA's supporting paragraphs, BM25 vs dense, on the dev questions.

    python benchmarks/retrieval.py [--split dev] [--ks 1,2,3,5,10]

The query is the question as asked (one hop). Recall@k is the share of the two supporting paragraphs
found in the top k, averaged over questions; "both@k" counts questions whose two paragraphs are both
there. The corpus is the task's: every context paragraph of train + dev, de-duplicated by title.
"""

from __future__ import annotations

import argparse
import time

from agent_r1.tasks import hotpotqa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["train", "dev"], default="dev")
    parser.add_argument("--ks", default="1,2,3,5,10")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    tasks = hotpotqa.load(split="test" if args.split == "dev" else "train")
    print(f"{len(tasks)} {args.split} questions, corpus of {len(hotpotqa.corpus())} passages")
    header = " ".join(f"{'R@' + str(k):>6}" for k in ks) + " " + " ".join(f"{'both@' + str(k):>7}" for k in ks)
    print(f"{'retriever':10} {header} {'ms/query':>9}")
    for kind in ("bm25", "dense"):
        index = hotpotqa.retriever_for(kind)
        recall = dict.fromkeys(ks, 0.0)
        both = dict.fromkeys(ks, 0)
        start = time.perf_counter()
        for task in tasks:
            ranked = [h.passage.title for h in index.search(task["question"], max(ks))]
            support = set(task["supporting_titles"])
            for k in ks:
                found = len(support & set(ranked[:k]))
                recall[k] += found / len(support)
                both[k] += found == len(support)
        ms = 1000 * (time.perf_counter() - start) / len(tasks)
        r = " ".join(f"{recall[k] / len(tasks):6.1%}" for k in ks)
        b = " ".join(f"{both[k] / len(tasks):7.1%}" for k in ks)
        print(f"{kind:10} {r} {b} {ms:9.1f}")


if __name__ == "__main__":
    main()

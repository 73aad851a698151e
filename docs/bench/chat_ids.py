"""Synthetic chat-shaped fine-tuning data for the packing benchmarks.

Writes ``OUT.jsonl``: rows of ``input_ids`` + ``labels`` whose lengths follow a log-normal
distribution like instruction data (median about 600 tokens, 32 to 4096), with the first 40%
of each row a "prompt" (labels -100) and the rest an "answer"; and ``OUT.npy``: the same ids
joined into one stream, which ``flowtrain train`` cuts into full windows with plain causal
attention (packing without document masking)::

    python docs/bench/chat_ids.py /tmp/chat --vocab 151936 --rows 4000
"""

import argparse
import json

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--vocab", type=int, required=True)
p.add_argument("--rows", type=int, default=4000)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
rng = np.random.default_rng(a.seed)
lengths = np.clip(rng.lognormal(np.log(600), 0.8, a.rows).astype(int), 32, 4096)
stream = []
with open(a.out + ".jsonl", "w") as f:
    for n in lengths:
        ids = rng.integers(3, a.vocab, n).tolist()
        cut = int(0.4 * n)
        f.write(json.dumps({"input_ids": ids, "labels": [-100] * cut + ids[cut:]}) + "\n")
        stream += ids
np.save(a.out + ".npy", np.array(stream, dtype=np.int64))
print(f"{a.rows} rows, {len(stream)} tokens, median length {int(np.median(lengths))}")

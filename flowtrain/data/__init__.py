"""Training data: ``--data`` files read into token ids, packed into rows, cut into steps.

Owns the formats (:mod:`.files`: JSONL of text, chat or ids, Parquet, NumPy, plain text), the
tokenising and chat templates (:mod:`.text`), packing documents into rows with the boundaries
attention needs (:mod:`.pack`), the token cache of a data file (:mod:`.cache`; listed and
cleaned by :mod:`.cache_entries`, which imports no torch) and the stream of batches a run
draws (:mod:`.source`). It may import the model's config (a vocabulary
size, a tokenizer folder) and nothing of the runtime, the planner or training.
"""

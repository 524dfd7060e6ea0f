#!/usr/bin/env python
"""Binarise text8 (http://mattmahoney.net/dc/text8.zip) for ``--task attnzoo_stream_lm``.

text8 is 100,000,000 characters (a-z and space) on a single line. The standard split (Mikolov et
al.; Transformer-XL's ``prep_text8.py``, used by the adaptive-span reference): first 90M train,
next 5M valid, last 5M test, one token per character. ``fairseq-preprocess`` cannot take a 90M-token
line, and splitting it into lines would insert ``</s>`` tokens, so this script writes fairseq's
indexed dataset directly (items of 1M tokens, no ``</s>``; the stream task concatenates them):
``OUT/dict.txt`` and ``OUT/{train,valid,test}.{bin,idx}``. Symbols are the byte values, as in
``scripts/data/prepare_enwik8.py`` (a space is ``32``).

    python examples/enwik8/prepare_text8.py --zip text8.zip --out data/text8/bin
"""

import argparse
import os
import zipfile

import numpy as np
import torch

SPLITS = (("train", 0, 90_000_000), ("valid", 90_000_000, 95_000_000),
          ("test", 95_000_000, 100_000_000))
ITEM = 1_000_000


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zip", required=True, help="text8.zip (member 'text8')")
    p.add_argument("--out", default="data/text8/bin")
    p.add_argument("--max-chars", type=int, default=None,
                   help="use a proportional 90/5/5 split of the first N characters (tests)")
    a = p.parse_args()
    from fairseq.data import Dictionary, indexed_dataset

    with zipfile.ZipFile(a.zip) as z:
        data = np.frombuffer(z.read("text8"), dtype=np.uint8)
    splits = SPLITS
    if a.max_chars or len(data) != SPLITS[-1][2]:
        n = min(len(data), a.max_chars or len(data))
        data = data[:n]
        t, v = n - n // 20 * 2, n - n // 20
        splits = (("train", 0, t), ("valid", t, v), ("test", v, n))
    d = Dictionary()
    values, counts = np.unique(data, return_counts=True)
    ids = np.zeros(256, dtype=np.int64)
    for b, c in sorted(zip(values.tolist(), counts.tolist()), key=lambda x: -x[1]):
        ids[b] = d.add_symbol(str(b), n=c)
    os.makedirs(a.out, exist_ok=True)
    d.save(os.path.join(a.out, "dict.txt"))
    for name, start, end in splits:
        prefix = os.path.join(a.out, name)
        builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(d))
        tokens = ids[data[start:end]]
        for i in range(0, len(tokens), ITEM):
            builder.add_item(torch.from_numpy(tokens[i:i + ITEM]))
        builder.finalize(prefix + ".idx")
        print(f"{name}: {end - start:,} characters -> {prefix}.bin")


if __name__ == "__main__":
    main()

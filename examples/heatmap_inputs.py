"""Writes the README's heatmap example inputs: q, k, v (.npy, float32,
shape (1, 2, 11, 16)) and tokens.txt for the sentence below, with two
hand-built heads whose attention is easy to read:

  head 0  "same word": queries and keys are the word's own random vector,
          so each token attends most to earlier copies of itself;
  head 1  "previous token": queries carry position i - 1, keys position j,
          so token i attends to token i - 1.

    python3 examples/heatmap_inputs.py docs/heatmap

Deterministic (seeded); the files in docs/heatmap/ are its output.
"""

import os
import sys

import numpy as np

SENTENCE = "the cat sat on the mat because the cat was tired".split()
E = 16


def main(folder):
    rng = np.random.default_rng(16)
    words = {w: rng.standard_normal(E) for w in sorted(set(SENTENCE))}
    L = len(SENTENCE)
    pos = rng.standard_normal((L + 1, E))  # row p is position p - 1 (row 0: "before the start")
    word = np.stack([words[w] for w in SENTENCE])
    q = np.stack([1.2 * word, 1.5 * pos[:-1]])  # head 1: query i carries position i - 1
    k = np.stack([1.2 * word, 1.5 * pos[1:]])   # keys carry their own position
    v = rng.standard_normal((2, L, E))
    os.makedirs(folder, exist_ok=True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(os.path.join(folder, name + ".npy"), x[None].astype(np.float32))
    with open(os.path.join(folder, "tokens.txt"), "w") as f:
        f.write("\n".join(SENTENCE) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/heatmap")

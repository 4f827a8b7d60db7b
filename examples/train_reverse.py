#!/usr/bin/env python3
"""Train a small transformer on attn, beside the same model on PyTorch.

    python3 examples/train_reverse.py [--steps 300] [--plot docs/training.png]

The task: reverse a sequence of tokens. The model: token and position
embeddings, two pre-norm transformer blocks (multi-head self-attention and
a feed-forward layer) and a linear read-out. It is built twice from one
definition, once on ``torch.nn.MultiheadAttention`` and once on
``attn.nn.MultiheadAttention``; the attn model starts from the torch model's
``state_dict`` (the keys are the same), and both draw the same batches. The
loss curves agree to rounding for the first steps and within noise after;
the script prints both curves' checkpoints and both wall times, and plots
the curves (matplotlib, when installed).
"""
import argparse
import time

import torch
import torch.nn as nn

import attn
import attn.nn

VOCAB, LENGTH, DIM, HEADS, BATCH = 16, 12, 64, 4, 64


class Block(nn.Module):
    def __init__(self, mha_class):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = mha_class(DIM, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class Reverser(nn.Module):
    def __init__(self, mha_class):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(LENGTH, DIM) * 0.02)
        self.blocks = nn.Sequential(Block(mha_class), Block(mha_class))
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.out(self.blocks(self.tokens(ids) + self.positions))


def train(model, steps, seed):
    """Adam on fresh random batches (the same ones for every model)."""
    data = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=data)
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.flip(1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    reference = Reverser(nn.MultiheadAttention)
    ours = Reverser(attn.nn.MultiheadAttention)
    ours.load_state_dict(reference.state_dict())  # the same keys, the same start

    torch_losses, torch_time = train(reference, args.steps, args.seed)
    attn_losses, attn_time = train(ours, args.steps, args.seed)

    print(f"{'step':>6} {'torch loss':>12} {'attn loss':>12}")
    for step in sorted({0, 1, 2, 5, 10, 50, 100, args.steps - 1} & set(range(args.steps))):
        print(f"{step:6d} {torch_losses[step]:12.6f} {attn_losses[step]:12.6f}")
    print(f"wall time for {args.steps} steps: torch {torch_time:.2f} s, attn {attn_time:.2f} s "
          f"(torch threads {torch.get_num_threads()}, attn threads {attn.get_num_threads()})")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(torch_losses, label=f"torch.nn.MultiheadAttention ({torch_time:.1f} s)")
        ax.plot(attn_losses, "--", label=f"attn.nn.MultiheadAttention ({attn_time:.1f} s)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.set_title("Reversing 12 tokens: the same model on torch and on attn")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

"""What float16 accumulation would cost in accuracy (docs/design.md, "Why
float16 has no AVX512-FP16 kernel").

AVX512-FP16's multiply-add (vfmadd231ph) rounds every sum to float16. This
emulates an attention computed that way: Q·Kᵀ with each step one rounding
to float16 (the exact product plus the float16 sum, rounded once, as the
fused instruction does), the softmax in float32, P rounded to float16 and
P·V summed the same way. Its error against a float64 attention of the same
float16 inputs is printed beside PyTorch's own float16 SDPA's (the issue's
bound: 2x PyTorch's).

    python3 bench/fp16_accumulation.py
"""
import numpy as np
import torch


def to_f16(x):
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def f16_dot(a, b):
    """a (L, E) · b (E, S), summed over E one float16 multiply-add at a time."""
    acc = np.zeros((a.shape[0], b.shape[1]))
    for e in range(a.shape[1]):
        acc = to_f16(acc + np.outer(a[:, e], b[e, :]))
    return acc


def case(L, E, magnitude):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, L, E, generator=g) * magnitude for _ in range(2))
    v = torch.randn(1, 1, L, E, generator=g)
    qh, kh, vh = q.half(), k.half(), v.half()
    Q, K, V = (x[0, 0].double().numpy() for x in (qh, kh, vh))
    scale = 1 / np.sqrt(E)
    s = Q @ K.T * scale
    p = np.exp(s - s.max(1, keepdims=True))
    exact = p / p.sum(1, keepdims=True) @ V
    theirs = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)[0, 0].double().numpy()
    s16 = (f16_dot(Q, K.T) * scale).astype(np.float32)
    p = np.exp(s16 - s16.max(1, keepdims=True))
    ours = to_f16(f16_dot(to_f16(p), V) / p.sum(1, keepdims=True))
    err = [np.abs(x - exact) for x in (theirs, ours)]
    rms = [np.sqrt((e ** 2).mean()) for e in err]
    print(f"(1,1,{L},{L},{E}) |q|,|k| ~ {magnitude}: PyTorch float16 max {err[0].max():.2e} "
          f"RMS {rms[0]:.2e}; float16 sums max {err[1].max():.2e} RMS {rms[1]:.2e} "
          f"({err[1].max() / err[0].max():.1f}x, RMS {rms[1] / rms[0]:.1f}x)")


if __name__ == "__main__":
    for L, E, magnitude in ((128, 64, 1), (512, 64, 1), (512, 128, 1), (512, 64, 3)):
        case(L, E, magnitude)

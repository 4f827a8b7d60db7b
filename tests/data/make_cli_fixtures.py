"""Writes the small .npy inputs the valgrind tier feeds to `attn sdpa`
(scripts/valgrind_cli.sh), with NumPy as the writer.

Run from this folder: python3 make_cli_fixtures.py.
"""
import numpy as np

rng = np.random.default_rng(4)


def save(name, a):
    np.save(f"cli/{name}.npy", a)


# float32: q (2, 3, 4, 8), k (2, 3, 5, 8), v (2, 3, 5, 6), bool mask (4, 5)
save("q_f32", rng.standard_normal((2, 3, 4, 8)).astype(np.float32))
save("k_f32", rng.standard_normal((2, 3, 5, 8)).astype(np.float32))
save("v_f32", rng.standard_normal((2, 3, 5, 6)).astype(np.float32))
mask = rng.random((4, 5)) < 0.7
mask[:, 0] = True
save("mask_bool", mask)
# float64 with GQA (4 query heads over 2 key heads), Fortran order and a
# broadcast float mask (2, 1, 6, 6) with -inf entries
save("q_f64", np.asfortranarray(rng.standard_normal((2, 4, 6, 8))))
save("k_f64", rng.standard_normal((2, 2, 6, 8)).astype(">f8"))
save("v_f64", rng.standard_normal((2, 2, 6, 4)))
fmask = rng.standard_normal((2, 1, 6, 6))
fmask[rng.random((2, 1, 6, 6)) < 0.3] = -np.inf
save("mask_f64", fmask)

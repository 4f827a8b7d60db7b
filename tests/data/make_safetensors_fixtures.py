"""Writes the safetensors fixtures of tests/c/test_safetensors.c with the
reference implementation (the `safetensors` package): files attn must read
as Hugging Face's own code writes them.

    python3 tests/data/make_safetensors_fixtures.py

Values follow the rule of the .npy fixtures: value(i) = i / 8 - 1 in C order
(bool: i % 3 == 0), exact in every float dtype. The special-value tensors
come with NumPy's / torch's own widening to float32 beside them
("..._as_f32"), which the C test compares with attn's bit for bit.
"""

import os

import numpy as np

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors")


def ramp(shape, dtype):
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.float64) / 8 - 1).reshape(shape).astype(dtype)


def numpy_file():
    from safetensors.numpy import save_file

    f16_special = np.array(
        [0.0, -0.0, 2.0**-24, -(2.0**-24), 1023 * 2.0**-24, 2.0**-14, 65504.0, -65504.0,
         np.inf, -np.inf, np.nan, 1 / 3, 0.1, -2.5],
        dtype=np.float16,
    )
    tensors = {
        "f32": ramp((2, 3, 4), np.float32),
        "f64": ramp((3, 5), np.float64),
        "f16": ramp((2, 3), np.float16),
        "f16_special": f16_special,
        "f16_special_as_f32": f16_special.astype(np.float32),
        "bool": (np.arange(20) % 3 == 0).reshape(4, 5),
        "scalar": np.array(-1.0, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "i64": np.array([1, -2, 3], dtype=np.int64),
        "u8": np.array([0, 1, 254, 255], dtype=np.uint8),
        "rank8": ramp((1, 2, 1, 2, 1, 2, 1, 2), np.float32),
        "ünï/名前 \"q\"\\": ramp((2,), np.float32),
    }
    save_file(tensors, os.path.join(HERE, "numpy.safetensors"),
              metadata={"format": "np", "note": "é ünïcode"})


def torch_file():
    import torch
    from safetensors.torch import save_file

    special = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), 3.0e38,
         1 / 3, -2.5],
        dtype=torch.float32,
    ).to(torch.bfloat16)
    tensors = {
        "bf16": torch.from_numpy(ramp((2, 3), np.float32)).to(torch.bfloat16),
        "bf16_special": special,
        "bf16_special_as_f32": special.float(),
        "f32": torch.from_numpy(ramp((2, 2), np.float32)),
    }
    save_file(tensors, os.path.join(HERE, "torch_bf16.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    os.makedirs(HERE, exist_ok=True)
    numpy_file()
    torch_file()
    for name in sorted(os.listdir(HERE)):
        print(name, os.path.getsize(os.path.join(HERE, name)), "bytes")

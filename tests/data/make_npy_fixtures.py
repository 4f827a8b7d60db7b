"""Writes the .npy fixtures the C tests read, with NumPy itself as the writer.

Run from this folder: python3 make_npy_fixtures.py. The arrays are small and
their values are a simple formula (value = index / 8 - 1), so the C test can
check every element without a second file.
"""
import numpy as np
from numpy.lib import format as npy_format


def values(shape, dtype):
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (np.arange(n) % 3 == 0).reshape(shape)
    return (np.arange(n, dtype=np.float64) / 8 - 1).astype(dtype).reshape(shape)


def save(name, array, version=None, fortran=False):
    arr = np.asfortranarray(array) if fortran else np.ascontiguousarray(array)
    if array.ndim == 0:  # both of those return at least one dimension
        arr = array
    with open(f"npy/{name}.npy", "wb") as f:
        npy_format.write_array(f, arr, version=version)


save("f32_c_v1", values((2, 3, 4), np.float32), version=(1, 0))
save("f64_c_v1", values((3, 5), np.float64), version=(1, 0))
save("f32_big_endian", values((2, 3, 4), np.dtype(">f4")), version=(1, 0))
save("f64_big_endian", values((3, 5), np.dtype(">f8")), version=(1, 0))
save("f32_fortran", values((2, 3, 4), np.float32), version=(1, 0), fortran=True)
save("f64_fortran_big", values((3, 5), np.dtype(">f8")), version=(1, 0), fortran=True)
save("bool_c", values((4, 5), np.bool_), version=(1, 0))
save("f32_v2", values((2, 3, 4), np.float32), version=(2, 0))
save("f32_v3", values((2, 3, 4), np.float32), version=(3, 0))
save("f64_scalar", np.array(-1.0), version=(1, 0))
save("f32_rank1", values((7,), np.float32), version=(1, 0))

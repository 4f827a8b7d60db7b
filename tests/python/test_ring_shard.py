"""attn.distributed without mpirun: shard and unshard (no MPI needed: they
run in-process) and the errors without MPI in the build or without mpi4py. The ring itself
is tests/python/test_ring.py."""

import sys

import numpy as np
import pytest

import attn.distributed as ad

needs_ring = pytest.mark.skipif(not ad.is_available(),
                                reason="attn was built without MPI (no ring attention)")


@pytest.mark.skipif(ad.is_available(), reason="attn was built with MPI")
def test_without_mpi_says_so():
    x = np.zeros((1, 8, 4), dtype=np.float32)
    for call in (lambda: ad.ring_attention(x, x, x), lambda: ad.shard(x, 0, 2),
                 lambda: ad.gather(x)):
        with pytest.raises(RuntimeError, match="attn was built without MPI, so it has no ring "
                           "attention: install Open MPI"):
            call()


@needs_ring
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("total,nranks", [(8, 4), (29, 3), (7, 1), (10, 5)])
def test_shard_unshard_round_trip(layout, total, nranks):
    x = np.arange(3 * total * 2).reshape(3, total, 2)  # any dtype: int64 here
    shards = [ad.shard(x, r, nranks, layout=layout) for r in range(nranks)]
    assert sum(s.shape[-2] for s in shards) == total
    assert np.array_equal(ad.unshard(shards, layout=layout), x)
    # every position is held once, in increasing order within a shard
    pos = np.concatenate([s[0, :, 0] // 2 for s in shards])
    assert sorted(pos.tolist()) == list(range(total))
    assert all(np.all(np.diff(s[0, :, 0]) > 0) for s in shards)
    y = np.moveaxis(x, 1, 0)  # another dim
    assert np.array_equal(
        ad.unshard([ad.shard(y, r, nranks, dim=0, layout=layout) for r in range(nranks)],
                   dim=0, layout=layout), y)


@needs_ring
def test_zigzag_chunks():
    """Zigzag: 2N chunks, rank r holds chunks r and 2N - 1 - r (attn_ring.h)."""
    x = np.arange(16)[:, None]
    got = [ad.shard(x, r, 4)[:, 0].tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


@needs_ring
def test_shard_torch_is_differentiable():
    import torch

    x = torch.randn(2, 12, 3, requires_grad=True)
    parts = [ad.shard(x, r, 3) for r in range(3)]
    assert all(isinstance(p, torch.Tensor) for p in parts)
    back = ad.unshard(parts)
    assert torch.equal(back, x)
    (back * torch.arange(12.0)[:, None]).sum().backward()
    assert torch.equal(x.grad, torch.arange(12.0)[:, None].expand(2, 12, 3))


@needs_ring
def test_shard_refusals():
    x = np.zeros((4, 6))
    with pytest.raises(ValueError, match="rank is 3; expected an int <= 2"):
        ad.shard(x, 3, 3)
    with pytest.raises(ValueError, match="layout is 'rows'"):
        ad.shard(x, 0, 2, layout="rows")
    with pytest.raises(ValueError):  # a rank would hold no position
        ad.shard(x[:3], 0, 4)
    with pytest.raises(ValueError, match=r"shards\[0\] has shape \(5, 6\); under the zigzag "
                       r"layout rank 0 of 2 holds 3 of the 6 positions"):
        ad.unshard([np.zeros((5, 6)), np.zeros((1, 6))])
    # named before their lengths are summed (an IndexError and NumPy's or
    # torch's own messages before)
    with pytest.raises(ValueError, match=r"shards\[1\] has shape \(5,\) and shards\[0\] "
                       r"\(2, 5, 4\): shards may differ along dim -2 only"):
        ad.unshard([np.zeros((2, 5, 4)), np.zeros(5)])
    with pytest.raises(ValueError, match=r"shards\[1\] has shape \(3, 5, 4\)"):
        ad.unshard([np.zeros((2, 5, 4)), np.zeros((3, 5, 4))])
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"shards\[1\] is a ndarray but shards\[0\] a Tensor"):
        ad.unshard([torch.zeros(2, 5, 4), np.zeros((2, 5, 4))])


@needs_ring
def test_without_mpi4py_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    x = np.zeros((1, 8, 4), dtype=np.float32)
    with pytest.raises(ImportError, match="attn.distributed needs mpi4py, an optional "
                       "dependency: pip install mpi4py"):
        ad.ring_attention(x, x, x)

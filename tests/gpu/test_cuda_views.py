"""The zero-copy views on CUDA tensors (bf16), where the GEMM libraries differ from CPU.

Skipped without a CUDA device (CI has none): run on a GPU host with
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from flying.substrate import kv_adaptor
from flying.substrate.weight_views import build_shards, shares_storage, tp_layers
from tests.unit.test_views import H, Model, _pool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("m", [2, 4])
def test_cuda_views_share_storage_and_recompose_the_mlp(m):
    torch.manual_seed(0)
    model = Model().to("cuda", torch.bfloat16)
    mlp = model.layers[0]["m"]
    x = torch.randn(7, H, device="cuda", dtype=torch.bfloat16)
    full = mlp(x).float()
    before = torch.cuda.memory_allocated()
    total = 0
    for r in range(m):
        table = build_shards(model, m, r)
        assert all(shares_storage(v, f) for v, f in table.tensors())
        with tp_layers(table, reduce=lambda t: t):
            total = total + mlp(x).float()
    torch.testing.assert_close(total, full, rtol=2e-2, atol=2e-2)
    assert torch.cuda.memory_allocated() - before < 1 << 20  # activations only


def test_cuda_kv_view_is_a_view():
    pool = _pool()
    pool.k_buffer = [b.cuda() for b in pool.k_buffer]
    pool.v_buffer = [b.cuda() for b in pool.v_buffer]
    tp = kv_adaptor.view_pool(pool, 2)
    for view, full in zip(tp.k_buffer, pool.k_buffer, strict=True):
        assert view.is_cuda and shares_storage(view, full)

"""Zero-copy weight shard views and KV pool views, on small stand-in modules.

The stand-ins carry exactly the attributes SGLang's Llama layers expose (``qkv_proj``,
``o_proj``, ``attn``, head counts; ``gate_up_proj``, ``down_proj``, ``act_fn``); the
integration tests check the same code against real SGLang and transformers.
"""

from __future__ import annotations

import types

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flying.substrate import kv_adaptor
from flying.substrate.weight_views import build_shards, shares_storage, tp_layers

pytestmark = pytest.mark.unit

H, HEADS, KV_HEADS, D, INTER = 64, 8, 4, 8, 96


class Linear(nn.Module):
    """Like SGLang's linear layers: forward returns (output, bias)."""

    def __init__(self, out_f, in_f, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_f, in_f), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(out_f), requires_grad=False) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class Attention(nn.Module):
    def __init__(self, bias=False, kv_heads=KV_HEADS):
        super().__init__()
        self.num_heads, self.num_kv_heads = HEADS, kv_heads
        self.q_size, self.kv_size = HEADS * D, kv_heads * D
        self.qkv_proj = Linear(self.q_size + 2 * self.kv_size, H, bias)
        self.o_proj = Linear(H, self.q_size, bias)
        self.attn = types.SimpleNamespace(
            tp_q_head_num=HEADS, tp_k_head_num=kv_heads, tp_v_head_num=kv_heads
        )


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = Linear(2 * INTER, H)
        self.down_proj = Linear(H, INTER)

    def act_fn(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class Model(nn.Module):
    def __init__(self, bias=False, kv_heads=KV_HEADS):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"a": Attention(bias, kv_heads), "m": Mlp()})]
        )


@pytest.mark.parametrize("m", [2, 4])
def test_views_share_storage(m):
    model = Model(bias=True)
    for r in range(m):
        table = build_shards(model, m, r)
        for view, full in table.tensors():
            assert shares_storage(view, full)
            assert view.data_ptr() != 0


@pytest.mark.parametrize("m,bias", [(2, False), (4, False), (2, True)])
def test_rank_outputs_recompose_the_full_layer(m, bias):
    torch.manual_seed(0)
    model = Model(bias)
    attn, mlp = model.layers[0]["a"], model.layers[0]["m"]
    x = torch.randn(5, H)
    full_qkv = attn.qkv_proj(x)[0]
    q, k, v = full_qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    attn_in = torch.randn(5, attn.q_size)
    full_o = attn.o_proj(attn_in)[0]
    full_mlp = mlp(x)
    o_sum, mlp_sum, qs, ks, vs = 0, 0, [], [], []
    for r in range(m):
        with tp_layers(build_shards(model, m, r), reduce=lambda t: t):
            assert attn.q_size == HEADS * D // m and attn.attn.tp_k_head_num == KV_HEADS // m
            qr, kr, vr = attn.qkv_proj(x)[0].split([attn.q_size, attn.kv_size, attn.kv_size], -1)
            qs.append(qr), ks.append(kr), vs.append(vr)
            cols = attn_in.chunk(m, dim=-1)[r]
            o_sum = o_sum + attn.o_proj(cols)[0]
            mlp_sum = mlp_sum + mlp(x)
    torch.testing.assert_close(torch.cat(qs, -1), q)
    torch.testing.assert_close(torch.cat(ks, -1), k)
    torch.testing.assert_close(torch.cat(vs, -1), v)
    torch.testing.assert_close(o_sum, full_o, rtol=1e-4, atol=1e-3)  # bias once (rank 0)
    torch.testing.assert_close(mlp_sum, full_mlp, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m,kv_heads", [(4, 2), (2, 1), (4, 1)])
def test_replicated_kv_heads_each_rank_computes_its_groups_head(m, kv_heads):
    """Fewer KV heads than ranks (SGLang's ``num_kv_head_replicas``): rank r's k and v
    are head ``r // (m / kv_heads)`` of the full projection, the same rows on every
    replica, its q the r-th slice of the query heads, and its head counts 1 KV head
    and HEADS/m query heads; o_proj's partial sums still recompose the full layer."""
    torch.manual_seed(1)
    model = Model(bias=True, kv_heads=kv_heads)
    attn = model.layers[0]["a"]
    x = torch.randn(5, H)
    q, k, v = attn.qkv_proj(x)[0].split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    attn_in = torch.randn(5, attn.q_size)
    full_o = attn.o_proj(attn_in)[0]
    replicas, o_sum, qs = m // kv_heads, 0, []
    for r in range(m):
        table = build_shards(model, m, r)
        assert all(shares_storage(view, full) for view, full in table.tensors())
        with tp_layers(table, reduce=lambda t: t):
            assert (attn.num_heads, attn.num_kv_heads, attn.kv_size) == (HEADS // m, 1, D)
            assert (attn.attn.tp_q_head_num, attn.attn.tp_k_head_num) == (HEADS // m, 1)
            qr, kr, vr = attn.qkv_proj(x)[0].split([attn.q_size, attn.kv_size, attn.kv_size], -1)
            o_sum = o_sum + attn.o_proj(attn_in.chunk(m, dim=-1)[r])[0]
        head = r // replicas
        torch.testing.assert_close(kr, k[:, head * D : (head + 1) * D])
        torch.testing.assert_close(vr, v[:, head * D : (head + 1) * D])
        qs.append(qr)
        # GQA: every query head of this rank belongs to the KV head it holds.
        assert {(r * HEADS // m + i) // (HEADS // kv_heads) for i in range(HEADS // m)} == {head}
    torch.testing.assert_close(torch.cat(qs, -1), q)
    torch.testing.assert_close(o_sum, full_o, rtol=1e-4, atol=1e-3)
    assert (attn.num_kv_heads, attn.attn.tp_k_head_num) == (kv_heads, kv_heads)  # restored


def test_heads_that_neither_split_nor_replicate_are_refused():
    from flying.substrate.weight_views import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="neither be split nor replicated"):
        build_shards(Model(kv_heads=3), 2, 0)


def test_scope_restores_on_exit_and_on_error():
    model = Model()
    attn, mlp = model.layers[0]["a"], model.layers[0]["m"]
    before = (attn.q_size, attn.num_heads, attn.attn.tp_q_head_num)
    x = torch.randn(3, H)
    ref = mlp(x)
    with pytest.raises(RuntimeError, match="boom"):
        with tp_layers(build_shards(model, 2, 1), reduce=lambda t: t):
            raise RuntimeError("boom")
    assert (attn.q_size, attn.num_heads, attn.attn.tp_q_head_num) == before
    assert "forward" not in vars(attn.qkv_proj) and "forward" not in vars(mlp.down_proj)
    torch.testing.assert_close(mlp(x), ref)


def test_forming_views_allocates_no_weight_memory():
    big = nn.ModuleList([Model() for _ in range(1)])
    for mod in big.modules():  # ~48 MB of weights
        if isinstance(mod, Linear):
            mod.weight = nn.Parameter(torch.randn(mod.weight.shape[0] * 32, mod.weight.shape[1] * 32), requires_grad=False)
    for mod in big.modules():
        if isinstance(mod, Attention):
            mod.q_size, mod.kv_size = mod.o_proj.weight.shape[1], (mod.qkv_proj.weight.shape[0] - mod.o_proj.weight.shape[1]) // 2
    proc = psutil.Process()
    rss = proc.memory_info().rss
    tables = [build_shards(big, m, r) for m in (2, 4) for r in range(m)]
    grown = proc.memory_info().rss - rss
    weight_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    assert len(tables) == 6 and weight_bytes > 40e6
    assert grown < 0.02 * weight_bytes, grown


def _pool(rows=9, heads=4, dim=8):
    return types.SimpleNamespace(
        k_buffer=[torch.zeros(rows, heads, dim) for _ in range(2)],
        v_buffer=[torch.zeros(rows, heads, dim) for _ in range(2)],
        head_num=heads, head_dim=dim, v_head_dim=dim, size=rows - 1, page_size=1,
        row_dim=heads * dim, v_row_dim=heads * dim, use_hnd=False, is_quantized_kv_cache=False,
    )


@pytest.mark.parametrize("heads,m", [(2, 4), (1, 2), (2, 2)])
def test_kv_view_of_replicated_heads_holds_kv_heads_tokens_per_slot(heads, m):
    """H_kv < m: a rank stores 1 head per token, so a DP slot (room for H_kv heads)
    holds H_kv tokens, not m: TP slot s*H_kv + j is head j of DP slot s."""
    pool = _pool(heads=heads)
    tp = kv_adaptor.view_pool(pool, m)
    rows, f = pool.size + pool.page_size, min(heads, m)
    assert kv_adaptor.tokens_per_slot(heads, m) == f
    assert tp.head_num == heads // f == 1 and tp.size == rows * f - 1 and tp.row_dim == 8
    assert tp.k_buffer[0].shape == (rows * f, 1, 8) and shares_storage(tp.k_buffer[0], pool.k_buffer[0])
    s, j = 5, f - 1
    tp.v_buffer[1][s * f + j] = 1.0
    assert (pool.v_buffer[1] != 0).nonzero()[:, :2].unique(dim=0).tolist() == [[s, j]]
    with pytest.raises(ValueError, match="neither be split nor replicated"):
        kv_adaptor.view_pool(_pool(heads=3), 2)


@pytest.mark.parametrize("m", [2, 4])
def test_kv_view_addresses_head_groups_of_dp_rows(m):
    pool = _pool()
    tp = kv_adaptor.view_pool(pool, m)
    rows = pool.size + pool.page_size
    assert tp.head_num == 4 // m and tp.size == rows * m - 1 and tp.row_dim == (4 // m) * 8
    for view, full in zip(tp.k_buffer, pool.k_buffer, strict=True):
        assert shares_storage(view, full) and view.shape == (rows * m, 4 // m, 8)
    s, j = 5, m - 1
    tp.k_buffer[0][s * m + j] = 1.0
    written = (pool.k_buffer[0] != 0).nonzero()[:, :2].unique(dim=0).tolist()
    assert written == [[s, h] for h in range(j * 4 // m, (j + 1) * 4 // m)]


def test_sub_slots_and_reservation_roundtrip():
    slots = torch.tensor([3, 7])
    assert kv_adaptor.sub_slots(slots, 2).tolist() == [6, 7, 14, 15]

    class Alloc:
        def __init__(self):
            self.free_list = list(range(1, 11))

        def alloc(self, n):
            if n > len(self.free_list):
                return None
            out, self.free_list = self.free_list[:n], self.free_list[n:]
            return torch.tensor(out)

        def free(self, t):
            self.free_list += t.tolist()

    alloc = Alloc()
    res = kv_adaptor.reserve(alloc, tokens=7, m=2)  # ceil(7/2) = 4 DP slots
    assert res.dp_slots.numel() == 4 and res.tp_slots.numel() == 8
    assert kv_adaptor.reserve(alloc, tokens=13, m=2) is None  # 7 > 6 left
    kv_adaptor.release(alloc, res)
    assert sorted(alloc.free_list) == list(range(1, 11))


def test_layer_copies_swap_as_one_entry_and_compute_what_the_entries_do():
    """With the model's root, the TP state is one exchange (the layer list), its copies
    compute exactly what the per-object entries compute, share every weight, and the
    original modules are never written (DP mode stays SGLang's own objects)."""
    from flying.substrate.toggle import entered
    from flying.substrate.weight_views import layer_toggle

    torch.manual_seed(3)
    model = Model(bias=True)
    model.layers.append(nn.ModuleDict({"a": Attention(True), "m": Mlp()}))
    originals, x = model.layers, torch.randn(5, H)
    attn_in = torch.randn(5, HEADS * D // 2)
    for r in range(2):
        table = build_shards(model, 2, r)
        want = []
        with tp_layers(table, reduce=lambda t: t):  # per-object entries: the reference
            for layer in model.layers:
                want.append((layer["a"].qkv_proj(x)[0], layer["a"].o_proj(attn_in)[0],
                             layer["m"](x), layer["a"].q_size, layer["a"].attn.tp_k_head_num))
        toggle = layer_toggle(table, lambda t: t, root=model)
        assert len(toggle) == 1
        with entered(toggle):
            assert model.layers is not originals and len(model.layers) == 2
            for i, layer in enumerate(model.layers):
                a, orig = layer["a"], originals[i]["a"]
                assert a is not orig and a.qkv_proj.weight is orig.qkv_proj.weight
                assert orig.q_size == HEADS * D and "forward" not in vars(orig.qkv_proj)
                assert orig.attn.tp_k_head_num == KV_HEADS
                got = (a.qkv_proj(x)[0], a.o_proj(attn_in)[0], layer["m"](x), a.q_size,
                       a.attn.tp_k_head_num)
                for g, w in zip(got, want[i], strict=True):
                    if isinstance(g, torch.Tensor):
                        torch.testing.assert_close(g, w, rtol=0, atol=0)
                    else:
                        assert g == w
        assert model.layers is originals


def test_layer_copies_fall_back_to_entries_off_a_layer_list():
    """Modules not under a ModuleList: the per-object entries, as before."""
    from flying.substrate.weight_views import layer_toggle

    model = nn.ModuleDict({"a": Attention(), "m": Mlp()})
    toggle = layer_toggle(build_shards(model, 2, 0), lambda t: t, root=model)
    assert len(toggle) > 1

"""Exact compressed panels (kernels/cpu_gemm.c, cpu_native.pack_exact): weights that are losslessly
Q4_1 / Q8_0 packed in 4 / 8 bits give the float32 product's bits."""

import ctypes
import platform

import numpy as np
import pytest
import torch
from torch import nn

from bastion.kernels import cpu_build, cpu_native
from bastion.kernels.cpu_linear import SkinnyLinear, mode_changes, pack_for, use_skinny_linear


@pytest.fixture(scope="module", autouse=True)
def built():
    if not cpu_native.available():
        pytest.skip(f"native kernel unavailable: {cpu_native.unavailable_reason()}")


def gguf_weight(n: int, k: int, kind: str, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """A float32 weight as the embedded model's were made: quantised by gguf's reference code (the
    llama.cpp algorithm, in numpy) and dequantised by it, as transformers' GGUF loader does."""
    from gguf import GGMLQuantizationType, quants

    qtype = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[kind]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * np.float32(scale)
    return torch.from_numpy(quants.dequantize(quants.quantize(w, qtype), qtype).astype(np.float32))


@pytest.mark.parametrize("kind,dtype", [("q4_1", torch.uint8), ("q8_0", torch.int8)])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (192, 576), (576, 1536), (1000, 96)])
# every path: 1-2 rows over two panels, up to 6 fused, 7-12 half panels (AVX2), up to 16 in 512-bit
# registers (AVX-512), then chunked
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9, 12, 13, 16, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_panels_give_the_float32_products_bits(kind, dtype, n, k, rows, with_bias):
    w = gguf_weight(n, k, kind, seed=n + k)
    packed = cpu_native.pack_exact(w)
    assert packed is not None and packed.dtype == dtype
    assert packed.shape == ((n + 15) // 16, k // 32, 384 if dtype == torch.uint8 else 576)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    want = cpu_native.linear(x, cpu_native.pack(w), n, b)
    assert torch.equal(cpu_native.linear(x, packed, n, b), want)
    assert torch.equal(cpu_native.Product(packed, n, b)(x, torch.get_num_threads()), want)


# 1e-6: Q4 scales below 2^-14, subnormal as half floats; 300: large ones. The kernels decode Q4 as one
# FMA, fl(d·q + m), which equals gguf's fl(fl(d·q) + m) only because every half-float d times a code
# < 16 is exact in float32: these scales are where that could fail first.
@pytest.mark.parametrize("kind,scale", [("q4_1", 0.05), ("q8_0", 0.05), ("q4_1", 1e-6), ("q4_1", 300.0),
                                        ("q8_0", 300.0)])
def test_exact_panels_decode_every_weight_and_rows_stand_alone(kind, scale):
    """x = I reads every decoded weight back (each output is one product 1·w plus zeros); a row's
    result does not depend on its neighbours (one row decodes in registers, several through scratch)."""
    n, k = 70, 128
    w = gguf_weight(n, k, kind, scale=scale)
    packed = cpu_native.pack_exact(w)
    assert packed is not None
    for rows in (1, 3, 9):  # x = I in row blocks: the fused, half-panel and 512-bit decodings
        for i in range(0, k, rows):
            eye = torch.eye(k)[i:i + rows]
            assert torch.equal(cpu_native.linear(eye, packed, n), w[:, i:i + rows].t())
    assert torch.equal(cpu_native.linear(torch.eye(k), packed, n).t(), w)
    x = torch.randn(9, k)
    together = cpu_native.linear(x, packed, n)
    for i in range(9):
        assert torch.equal(cpu_native.linear(x[i:i + 1], packed, n)[0], together[i])


def test_other_weights_are_not_compressed():
    w = gguf_weight(48, 64, "q4_1")
    assert cpu_native.pack_exact(w) is not None
    off = w.clone()
    off[7, 40] = torch.nextafter(off[7, 40], torch.tensor(1.0))  # one weight one ulp off its grid
    assert cpu_native.pack_exact(off) is None
    assert cpu_native.pack_exact(torch.randn(48, 64)) is None  # trained / random weights
    assert cpu_native.pack_exact(gguf_weight(48, 64, "q4_1")[:, :48].contiguous()) is None  # K % 32 ≠ 0
    assert cpu_native.pack_exact(torch.zeros(0, 64)) is None
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert cpu_native.pack_exact(nan) is None
    assert pack_for(off, False).dtype == torch.float32  # the float32 panels then
    with pytest.raises(ValueError, match="2-D CPU float32"):
        cpu_native.pack_exact(w.double())
    with pytest.raises(ValueError, match="do not hold"):
        cpu_native.linear(torch.randn(2, 32), cpu_native.pack_exact(w), 48)  # K = 64, not 32
    with pytest.raises(ValueError, match="do not hold"):
        cpu_native.Product(cpu_native.pack_exact(w), 64)  # 48 outputs, not 64


def test_modes_native_and_native_f32():
    """``native`` packs an exact weight in 4 bits, ``native-f32`` in float32: the outputs are the same
    bits; switching repacks and is counted (the lean loop remakes its plan on the counter)."""
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(gguf_weight(48, 64, "q4_1"))
    use_skinny_linear(lin, "native")
    assert isinstance(lin, SkinnyLinear) and lin.panels().dtype == torch.uint8
    x = torch.randn(3, 64)
    with torch.no_grad():
        compressed = lin(x)
    before = mode_changes()
    assert use_skinny_linear(lin, "native-f32") == 1 and mode_changes() == before + 1
    assert lin.panels().dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(lin(x), compressed)
    with torch.no_grad():  # a weight edited off the grid: repacked, in float32, and still right
        lin.weight[0, 0] += 1e-3
    use_skinny_linear(lin, "native")
    assert lin.panels().dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(lin(x), x @ lin.weight.t() + lin.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_embedded_target_compresses_exactly_and_keeps_its_logits():
    """Every matrix of the embedded SmolLM2 (210 Q4_1 + the Q8_0 LM head) packs exactly, and its
    logits — one token at a time and inside a tree — are the same bits in both modes."""
    from bastion.loading import EMBEDDED, encode_prompt, load_target
    from tiny import path_logits_in_tree_and_alone

    target = load_target(EMBEDDED, torch.float32, "cpu", progress=None)
    lins = [m for m in target.model.modules() if isinstance(m, SkinnyLinear)]
    assert len(lins) == 211 and all(m.panels().dtype in (torch.uint8, torch.int8) for m in lins)
    ctx = torch.tensor(encode_prompt(target.tokenizer, "Name three rivers in Europe."))
    outs = {}
    for mode in ("native", "native-f32"):
        use_skinny_linear(target.model, mode)
        outs[mode] = path_logits_in_tree_and_alone(target, ctx, [504, 3158, 2909, 30], [77, 99, 111])
    assert all(m.panels().dtype == torch.float32 for m in lins)
    for (tree_a, alone_a), (tree_b, alone_b) in zip(outs["native"], outs["native-f32"]):
        assert torch.equal(tree_a, tree_b) and torch.equal(alone_a, alone_b) and torch.equal(tree_a, alone_a)


def test_the_benchmark_reports_the_panels_in_use():
    from bastion.bench_runs import linear_mode

    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))
    with torch.no_grad():
        model[0].weight.copy_(gguf_weight(48, 64, "q8_0"))  # the second stays random: float32 panels
    use_skinny_linear(model, "native")
    for m in model:
        m.panels()
    assert linear_mode(model).startswith("native: packed few-row kernel, 1 of 2 matrices in exact 4/8-bit")
    use_skinny_linear(model, "native-f32")
    assert linear_mode(model).startswith("native-f32: packed few-row kernel, float32 panels")
    use_skinny_linear(model, "stock")
    assert linear_mode(model) == "stock: F.linear"


@pytest.fixture(scope="module", params=[("-mno-avx512f",), ("-mno-avx512f", "-mno-fma")], ids=["avx2", "no-fma"])
def variant(request, tmp_path_factory):
    """The kernel library built for a lesser instruction set than this CPU's: the code paths a
    user's CPU without AVX-512 (or without FMA) takes, checked here too."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set variants")
    path = cpu_build.build(tmp_path_factory.mktemp("variant"), extra_flags=request.param)
    return cpu_build.declare(ctypes.CDLL(str(path)))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_every_instruction_set_path_gives_the_float32_products_bits(variant, kind):
    """Compressed products equal the same build's float32 panel products bit for bit, at every row
    count whose path differs (the float32 kernel sums each output in the same order everywhere; FMA
    or not is the build's choice, the same for both)."""
    assert variant.bastion_wide_rows(0, -1) == -1  # no 512-bit path to choose in these builds
    pack_q, gemm_q, nbytes, dtype = ((variant.bastion_pack_q4, variant.bastion_gemm_q4, 384, torch.uint8)
                                     if kind == "q4_1" else
                                     (variant.bastion_pack_q8, variant.bastion_gemm_q8, 576, torch.int8))
    for n, k in [(37, 64), (1000, 96), (192, 576)]:
        w = gguf_weight(n, k, kind, seed=n * k)
        panels = torch.empty((n + 15) // 16, k, 16)
        variant.bastion_pack_f32(w.data_ptr(), n, k, panels.data_ptr(), 1)
        packed = torch.empty((n + 15) // 16, k // 32, nbytes, dtype=dtype)
        assert pack_q(w.data_ptr(), n, k, packed.data_ptr(), 1) == 0
        b = torch.randn(n)
        for rows in [1, 2, 3, 4, 6, 7, 8, 11, 12, 13, 16, 17, 40]:
            x = torch.randn(rows, k)
            want, got = torch.empty(rows, n), torch.empty(rows, n)
            for threads in (1, 2):
                variant.bastion_gemm_f32(x.data_ptr(), rows, panels.data_ptr(), n, k, b.data_ptr(), want.data_ptr(),
                                         threads)
                gemm_q(x.data_ptr(), rows, packed.data_ptr(), n, k, b.data_ptr(), got.data_ptr(), threads)
                assert torch.equal(got, want), (n, k, rows, threads)
            # and the float32 product is the float32 product (FMA or not: within rounding)
            torch.testing.assert_close(want, torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_512_bit_and_256_bit_paths_give_the_same_bits_at_every_row_count(kind):
    """cpu_native.set_wide_rows only moves speed: every row count's exact product is bit for bit the
    same down either path (probe.tune_wide_rows picks the faster per row count), and the mask reads
    back as set — the 4-bit and the 8-bit products' masks each on its own."""
    if cpu_native.wide_rows() is None:
        pytest.skip("no 512-bit path on this CPU")
    before = cpu_native.wide_rows(), cpu_native.wide_rows(q8=True)
    q8 = kind == "q8_0"
    n, k = 200, 576
    panels = cpu_native.pack_exact(gguf_weight(n, k, kind, seed=7))
    assert panels is not None and panels.dtype == (torch.uint8 if kind == "q4_1" else torch.int8)
    b = torch.randn(n)
    try:
        for rows in range(1, 17):
            x = torch.randn(rows, k)
            cpu_native.set_wide_rows(0xFFFF)
            wide = cpu_native.linear(x, panels, n, b)
            narrow = 0xFFFF & ~(1 << (rows - 1))  # this row count on 256 bits, for this format only
            cpu_native.set_wide_rows(0xFFFF if q8 else narrow, narrow if q8 else 0xFFFF)
            assert cpu_native.wide_rows(q8) == narrow and cpu_native.wide_rows(not q8) == 0xFFFF
            assert torch.equal(cpu_native.linear(x, panels, n, b), wide), rows
    finally:
        cpu_native.set_wide_rows(*before)

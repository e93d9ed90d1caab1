"""kernels.cpu_native: the packed few-row kernel equals torch's product, is batch-invariant, and is
used (and refreshed) exactly where it is meant to be."""

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bastion.kernels import cpu_native, cpu_rows
from bastion.kernels.cpu_linear import SkinnyLinear, prepack, skinny_linear, use_skinny_linear

HAVE_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture(scope="module", autouse=True)
def built():
    if not cpu_native.available():
        # a machine with a compiler must build it: a silent fallback would hide a broken kernel
        assert not HAVE_CC, f"a C compiler is here but the kernel did not build: {cpu_native.unavailable_reason()}"
        pytest.skip(f"native kernel unavailable: {cpu_native.unavailable_reason()}")


@pytest.mark.parametrize("n,k", [(16, 8), (37, 29), (192, 576), (1000, 3)])
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 40, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_equals_torch(n, k, rows, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = cpu_native.linear(x, cpu_native.pack(w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_rows_do_not_depend_on_their_neighbours():
    # the property that makes tree verification and plain decoding give bit-identical logits
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(200, 576, generator=g), torch.randn(64, 576, generator=g)
    panels = cpu_native.pack(w)
    alone = torch.cat([cpu_native.linear(x[i:i + 1], panels, 200) for i in range(64)])
    for rows in (2, 3, 7, 12, 13, 25, 64):
        assert torch.equal(cpu_native.linear(x[:rows], panels, 200), alone[:rows]), rows
    assert torch.equal(cpu_native.linear(x.flip(0), panels, 200), alone.flip(0))


def test_pack_layout_and_padding():
    w = torch.arange(3 * 20, dtype=torch.float32).reshape(20, 3)
    p = cpu_native.pack(w)
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, :, :16], w[:16].t())
    assert torch.equal(p[1, :, :4], w[16:].t()) and not p[1, :, 4:].any()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2-D CPU float32"):
        cpu_native.pack(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not hold"):
        cpu_native.linear(torch.zeros(2, 5), cpu_native.pack(torch.zeros(8, 4)), 8)


def test_build_errors_are_reported(tmp_path, monkeypatch):
    from bastion.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "FLAGS", cpu_build.FLAGS + ["-this-flag-does-not-exist"])
    with pytest.raises(RuntimeError, match="failed"):
        cpu_build.build(tmp_path)
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.iterdir())  # nothing half-written left


def test_one_openmp_runtime_is_loaded():
    # the library must share torch's OpenMP threads, not start a second pool that spins against them
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc")
    # wheels may vendor private copies under hashed names (sentencepiece's libgomp-6a29c32d.so.1):
    # what matters is that one library answers to the soname ours asks for
    libs = {line.split()[-1] for line in maps.read_text().splitlines() if re.search(r"/lib[gi]omp\.so", line)}
    assert len(libs) <= 1, libs


def test_module_repacks_when_its_weight_changes():
    lin = nn.Linear(24, 40)
    keys = list(lin.state_dict())
    assert use_skinny_linear(lin, "native") == 1 and type(lin) is SkinnyLinear and lin.native
    assert prepack(lin) == 1 and list(lin.state_dict()) == keys  # the panels are not state
    x = torch.randn(3, 24)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        first = lin.panels()
        lin.weight.mul_(2)  # in place: same storage, new version
        assert lin.panels() is not first
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_modes_switch_both_ways():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert use_skinny_linear(model, "native") == 2
    assert use_skinny_linear(model, "native") == 0
    assert use_skinny_linear(model, "fast") == 2 and not model[0].native
    assert prepack(model) == 0
    assert use_skinny_linear(model, "stock") == 2 and type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="unknown linear mode"):
        use_skinny_linear(model, "turbo")


def test_native_only_where_meant():
    lin = nn.Linear(16, 16)
    use_skinny_linear(lin, "native")
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()  # autograd keeps torch's linear (the kernel has no backward)
    assert x.grad is not None and "_panels" not in lin.__dict__
    with torch.no_grad():
        lin(torch.randn(100, 16))  # prefill-sized: torch's gemm
        assert "_panels" not in lin.__dict__
        lin(torch.randn(3, 16))
        assert "_panels" in lin.__dict__


def test_skinny_linear_with_panels():
    w, b, x = torch.randn(50, 32), torch.randn(50), torch.randn(2, 3, 32)
    got = skinny_linear(x, w, b, cpu_native.pack(w))
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert got.shape == (2, 3, 50)


def test_prepack_falls_back_when_the_panels_would_not_fit(monkeypatch):
    import psutil

    class Tight:
        available = 1000  # bytes: far less than twice the layer's weights

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight())
    lin = nn.Linear(64, 64)
    use_skinny_linear(lin, "native")
    with pytest.warns(UserWarning, match="native CPU kernel off"):
        assert prepack(lin) == 0
    assert not lin.native and "_panels" not in lin.__dict__
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert "_panels" not in lin.__dict__  # the fallback never packs later either


# ----------------------------------------------------------------- bf16 (drafters)
needs_bf16 = pytest.mark.skipif("not cpu_native.bf16_available()", reason="CPU without AVX512-BF16")


def _compiler_targets_bf16() -> bool:
    """Whether the C compiler, for this CPU (-march=native), defines __AVX512BF16__."""
    import subprocess

    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        return False
    res = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True)
    return "__AVX512BF16__" in res.stdout


def test_bf16_is_reported_from_the_cpu_and_compiler():
    # where the CPU has the instruction and the compiler emits it, the kernel must use it: a silent
    # float32 fallback would hide a broken build
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if " avx512_bf16" not in flags:
        assert not cpu_native.bf16_available()
    else:
        assert cpu_native.bf16_available() == _compiler_targets_bf16()


@needs_bf16
@pytest.mark.parametrize("n,k", [(16, 8), (37, 30), (192, 576), (1000, 2)])
@pytest.mark.parametrize("rows", [1, 2, 9, 12, 13, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_product_is_the_rounded_product(n, k, rows, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = cpu_native.linear_bf16(x, cpu_native.pack_bf16(w), n, b)
    # the hot loops' pre-checked call (the lean drafter) rounds the inputs as linear_bf16 does
    assert torch.equal(cpu_native.Product(cpu_native.pack_bf16(w), n, b)(x, torch.get_num_threads()), got)
    # exactly bf16-rounded inputs and weights, summed in high precision
    want = F.linear(x.bfloat16().double(), w.bfloat16().double(), None if b is None else b.double()).float()
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    # and within bf16's rounding of the float32 product
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=3e-2 * k ** 0.5)


@needs_bf16
def test_bf16_rows_do_not_depend_on_their_neighbours():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(200, 576, generator=g), torch.randn(40, 576, generator=g)
    panels = cpu_native.pack_bf16(w)
    alone = torch.cat([cpu_native.linear_bf16(x[i:i + 1], panels, 200) for i in range(40)])
    for rows in (2, 9, 13, 40):
        assert torch.equal(cpu_native.linear_bf16(x[:rows], panels, 200), alone[:rows]), rows


def test_bf16_pack_layout_and_refusals():
    w = torch.arange(4 * 20, dtype=torch.float32).reshape(20, 4)  # small integers: exact in bf16
    p = cpu_native.pack_bf16(w)
    assert p.dtype == torch.bfloat16 and p.shape == (2, 2, 16, 2)
    assert torch.equal(p[0, 1, 3].float(), w[3, 2:4])  # panel 0, input pair 1, output 3
    assert torch.equal(p[1, 0, :4].float(), w[16:, 0:2]) and not p[1, :, 4:].float().any()
    with pytest.raises(ValueError, match="even number of columns"):
        cpu_native.pack_bf16(torch.randn(4, 3))
    if cpu_native.bf16_available():
        with pytest.raises(ValueError, match="do not hold"):
            cpu_native.linear_bf16(torch.randn(2, 6), p, 20)


@needs_bf16
def test_bf16_mode_packs_bf16_and_switches_back():
    lin = nn.Linear(24, 40)
    assert use_skinny_linear(lin, "native-bf16") == 1 and lin.native and lin.low_precision
    x = torch.randn(3, 24)
    with torch.no_grad():
        low = lin(x)
        assert lin.panels().dtype == torch.bfloat16
        torch.testing.assert_close(low, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0.1)
        assert use_skinny_linear(lin, "native") == 1 and not lin.low_precision
        assert lin.panels().dtype == torch.float32  # repacked: the cache key holds the precision
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert use_skinny_linear(lin, "stock") == 1 and not hasattr(lin, "low_precision")


@needs_bf16
def test_bf16_mode_widens_bf16_weights_for_an_odd_number_of_inputs():
    """AVX512-BF16 multiplies input pairs: an odd number of inputs takes the widened-bf16 kernel."""
    lin = nn.Linear(7, 5)
    use_skinny_linear(lin, "native-bf16")
    x = torch.randn(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0.05)
    assert lin.panels().dtype == torch.bfloat16 and lin.panels().dim() == 3


@pytest.mark.parametrize("n,k", [(16, 8), (37, 29), (192, 576), (1000, 3)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 13, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_bf16_product_is_the_float32_product_of_rounded_weights(n, k, rows, with_bias):
    """linear_h16 (drafters on CPUs without AVX512-BF16): bf16 weights widened in registers, the float32
    kernel's FMAs in its order — bit for bit the float32 kernel on the bf16-rounded weight."""
    g = torch.Generator().manual_seed(n * k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    panels = cpu_native.pack_h16(w)
    assert panels.dtype == torch.bfloat16 and panels.shape == ((n + 15) // 16, k, 16)
    got = cpu_native.linear_h16(x, panels, n, b)
    assert torch.equal(got, cpu_native.linear(x, cpu_native.pack(w.bfloat16().float()), n, b))
    alone = torch.cat([cpu_native.linear_h16(x[i:i + 1], panels, n, b) for i in range(rows)])
    assert torch.equal(got, alone)  # batch-invariant, as the float32 kernel
    assert torch.equal(cpu_native.Product(panels, n, b)(x, torch.get_num_threads()), got)  # the lean drafter's call
    with pytest.raises(ValueError, match="do not hold"):
        cpu_native.linear_h16(torch.randn(2, k + 1), panels, n)
    with pytest.raises(ValueError, match="do not hold"):
        cpu_native.Product(panels, n + 16)
    with pytest.raises(ValueError, match="linear_h16"):  # linear reads float32 / exact panels only
        cpu_native.linear(x, panels, n, b)


def test_low_precision_mode_packs_bf16_on_every_cpu():
    """Mode native-bf16 (drafters) halves the weights' bytes on any CPU: AVX512-BF16 pairs where the CPU
    has them (even inputs), widened bf16 weights elsewhere; mode native repacks float32."""
    lin = nn.Linear(24, 40)
    use_skinny_linear(lin, "native-bf16")
    x = torch.randn(3, 24)
    with torch.no_grad():
        low = lin(x)
        assert lin.panels().dtype == torch.bfloat16
        assert lin.panels().dim() == (4 if cpu_native.bf16_available() else 3)
        torch.testing.assert_close(low, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0.1)
        use_skinny_linear(lin, "native")
        assert lin.panels().dtype == torch.float32


# ----------------------------------------------------------------- attention
def _attention_case(n, heads, groups, d, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, heads, d, generator=g).transpose(1, 2)  # the strides transformers hands over
    k = torch.randn(1, groups, length, d, generator=g)
    v = torch.randn(1, groups, length, d, generator=g)
    mask = torch.zeros(1, 1, n, length)
    # a tree over the last n keys: each query sees the prefix, itself and a random subset of the others;
    # some visible keys carry an additive bias too
    hidden = torch.rand(n, n, generator=g) < 0.5
    hidden &= ~torch.eye(n, dtype=torch.bool)
    mask[0, 0, :, length - n:] = torch.where(hidden, torch.finfo(torch.float32).min, 0.0)
    mask[0, 0, :, 0] = -0.75
    return q, k, v, mask


def _attention_reference(q, k, v, mask, scale):
    per = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(per, 1), v.double().repeat_interleave(per, 1)
    scores = q.double() @ kk.transpose(2, 3) * scale + (0 if mask is None else mask.double())
    return (torch.softmax(scores, -1) @ vv).transpose(1, 2).float()


@pytest.mark.parametrize("heads,groups", [(9, 3), (4, 4), (8, 2), (12, 2), (7, 1)])
@pytest.mark.parametrize("d", [64, 128, 16, 12])
@pytest.mark.parametrize("n,length", [(1, 1), (1, 37), (2, 40), (9, 160), (64, 300)])
def test_attention_equals_the_softmax_reference(heads, groups, d, n, length):
    q, k, v, mask = _attention_case(n, heads, groups, d, length)
    got = cpu_native.attention(q, k, v, mask, d ** -0.5)
    assert got.shape == (1, n, heads, d) and got.is_contiguous()
    torch.testing.assert_close(got, _attention_reference(q, k, v, mask, d ** -0.5), rtol=2e-5, atol=2e-6)
    if n <= 2:  # without a mask every query sees every key
        torch.testing.assert_close(cpu_native.attention(q, k, v, None, 0.3),
                                   _attention_reference(q, k, v, None, 0.3), rtol=2e-5, atol=2e-6)


def test_attention_rows_depend_only_on_their_visible_keys():
    """What makes a tree node's logits bit-identical to decoding the same tokens one by one: a row's
    output depends neither on the other rows of the call nor on where its hidden keys sit."""
    q, k, v, mask = _attention_case(9, 9, 3, 64, 160, seed=3)
    full = cpu_native.attention(q, k, v, mask, 0.125)
    for i in range(9):
        alone = cpu_native.attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], 0.125)
        assert torch.equal(alone, full[:, i:i + 1]), i
        keep = mask[0, 0, i] > -1e30  # the same row over only its visible keys, packed together
        packed = cpu_native.attention(q[:, :, i:i + 1], k[:, :, keep], v[:, :, keep], mask[:, :, i:i + 1, keep], 0.125)
        assert torch.equal(packed, alone), i


@pytest.mark.parametrize("heads,groups", [(9, 3), (12, 2)])
def test_attention_heads_that_share_loads_equal_each_head_alone(heads, groups):
    """The query heads of a KV head run together (sharing its key and value loads, up to four at a
    time); each head's output must still be exactly what it gets run alone."""
    q, k, v, mask = _attention_case(5, heads, groups, 64, 90, seed=4)
    full = cpu_native.attention(q, k, v, mask, 0.125)
    per = heads // groups
    for h in range(heads):
        g = h // per
        alone = cpu_native.attention(q[:, h:h + 1], k[:, g:g + 1], v[:, g:g + 1], mask, 0.125)
        assert torch.equal(alone[:, :, 0], full[:, :, h]), h


def test_attention_refuses_what_it_cannot_run():
    q, k, v, mask = _attention_case(3, 4, 2, 16, 20)
    # no mask: every query sees every key (a drafter's block)
    torch.testing.assert_close(cpu_native.attention(q, k, v, None, 0.25), _attention_reference(q, k, v, None, 0.25),
                               rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="attention wants"):
        cpu_native.attention(q.double(), k.double(), v.double(), mask.double(), 0.25)
    with pytest.raises(ValueError, match="attention wants"):
        cpu_native.attention(q, k, v, mask[..., :-1], 0.25)
    with pytest.raises(ValueError, match="attention wants"):
        cpu_native.attention(q[:, :3], k, v, mask, 0.25)  # 3 heads do not share 2 KV heads


def test_move_rows_equals_torchs_gather_and_refuses_what_it_cannot_move():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, 3, 12, 16, generator=g) for _ in range(4)]
    tensors.append(torch.randn(1, 3, 20, 16, generator=g)[:, :, :12])  # other strides (a cropped view)
    src, dst = [5, 7, 8, 11], [5, 6, 7, 8]
    want = [t.clone() for t in tensors]
    for w in want:
        w[:, :, 5:9] = w.index_select(2, torch.tensor(src))
    assert cpu_rows.move_rows(tensors, src, dst)
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))
    # not float32, rows out of range, or another head count: nothing moved, the caller uses torch
    for bad in ([tensors[0].double()], [tensors[0][:, :, :10]], [tensors[0], tensors[1][:, :2]]):
        before = [t.clone() for t in bad]
        assert not cpu_rows.move_rows(bad, src, dst)
        assert all(torch.equal(t, b) for t, b in zip(bad, before))
    with pytest.raises(ValueError, match="increasing"):
        cpu_rows.move_rows(tensors, [7, 5], [5, 6])
    with pytest.raises(ValueError, match="increasing"):
        cpu_rows.move_rows(tensors, [5, 7], [5, 8])


@pytest.mark.parametrize("n", [576, 64, 37, 8, 3])
@pytest.mark.parametrize("rows", [1, 9, 70])
def test_rms_norm_equals_transformers_norm_and_is_row_invariant(n, rows):
    """The native RMSNorm is transformers' Llama RMSNorm to float rounding, each row on its own (rows
    alone, in any batch and in a parallel call of ≥ 64 rows give the same bits)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(n + rows)
    norm = LlamaRMSNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
    x = torch.randn(rows, n, generator=g) * 3
    with torch.no_grad():
        want = norm(x)
        got = cpu_rows.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=2e-6, atol=2e-6)
    alone = torch.cat([cpu_rows.rms_norm(x[i:i + 1], norm.weight, 1e-5) for i in range(rows)])
    assert torch.equal(got, alone)
    assert torch.equal(cpu_rows.rms_norm(x.view(1, rows, n), norm.weight, 1e-5)[0], got)  # any leading shape


def test_rms_norm_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="CPU float32"):
        cpu_rows.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="CPU float32"):
        cpu_rows.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


def test_native_modules_switch_and_keep_the_module_elsewhere():
    """use_native_modules sets the Llama / Qwen norms' and the SiLU activations' forward (not other
    modules'), switches back, and leaves float64 inputs and autograd to the module's own forward."""
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from bastion.kernels.cpu_modules import use_native_modules

    model = nn.Sequential(LlamaRMSNorm(16), nn.LayerNorm(16), ACT2FN["silu"], nn.GELU())
    assert use_native_modules(model) == 2 and use_native_modules(model) == 0
    assert "forward" in model[0].__dict__ and "forward" in model[2].__dict__
    assert "forward" not in model[1].__dict__ and "forward" not in model[3].__dict__
    calls = []
    real_norm, real_silu = cpu_rows.rms_norm, cpu_rows.silu
    try:
        cpu_rows.rms_norm = lambda *a: (calls.append("norm"), real_norm(*a))[1]
        cpu_rows.silu = lambda *a: (calls.append("silu"), real_silu(*a))[1]
        x = torch.randn(3, 16)
        with torch.no_grad():
            model(x)
        assert calls == ["norm", "silu"]
        model[0](x.requires_grad_())  # autograd: the modules' own forward
        model[2](x)
        model.double()(torch.randn(3, 16, dtype=torch.float64))
        assert calls == ["norm", "silu"]
    finally:
        cpu_rows.rms_norm, cpu_rows.silu = real_norm, real_silu
    assert use_native_modules(model, False) == 2 and "forward" not in model[0].__dict__


@pytest.mark.parametrize("n", [1536, 13, 8, 3])
@pytest.mark.parametrize("rows", [1, 9])
def test_silu_equals_torch_and_is_row_invariant(n, rows):
    g = torch.Generator().manual_seed(n * rows)
    x = torch.randn(rows, n, generator=g) * 6
    x[0, 0], x[-1, -1] = -120.0, 95.0  # exp's lower limit, a large positive input
    got = cpu_rows.silu(x)
    assert torch.allclose(got, F.silu(x), rtol=3e-7, atol=1e-7)
    assert torch.equal(torch.cat([cpu_rows.silu(x[i:i + 1]) for i in range(rows)]), got)
    with pytest.raises(ValueError, match="CPU float32"):
        cpu_rows.silu(x.double())


@pytest.mark.parametrize("heads,d", [(9, 64), (3, 64), (4, 8), (2, 128)])
@pytest.mark.parametrize("n", [1, 9, 70])
def test_rope_is_transformers_rotary_embedding_bit_for_bit(heads, d, n):
    """cpu_rows.rope rounds each product and the sum as torch's elementwise ops do (no fused
    multiply-add), so its bits are transformers' apply_rotary_pos_emb's — what keeps the lean loop and
    transformers' forward bit-identical."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(heads * d + n)
    x = torch.randn(n, heads, d, generator=g) * 4
    angle = torch.rand(n, d // 2, generator=g) * 300
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    want, _ = apply_rotary_pos_emb(x[None].transpose(1, 2), x[None].transpose(1, 2), cos[None], sin[None])
    got = cpu_rows.rope(x, cos, sin)
    assert got.shape == x.shape
    assert torch.equal(got[None].transpose(1, 2), want)
    assert torch.equal(cpu_rows.rope(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin), got)  # strided in


def test_rope_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="d even"):
        cpu_rows.rope(torch.zeros(2, 3, 5), torch.zeros(2, 5), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="cos / sin"):
        cpu_rows.rope(torch.zeros(2, 3, 4), torch.zeros(1, 4), torch.zeros(2, 4))

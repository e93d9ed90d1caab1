"""kernels.cpu_native: the packed few-row kernel equals torch's product, is batch-invariant, and is
used (and refreshed) exactly where it is meant to be."""

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bastion.kernels import cpu_native
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
    monkeypatch.setattr(cpu_native, "FLAGS", cpu_native.FLAGS + ["-this-flag-does-not-exist"])
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native._build(tmp_path)
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

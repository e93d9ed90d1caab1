"""kernels.cpu_linear: the few-row CPU product equals F.linear, and only where it is meant to run."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bastion.kernels import cpu_linear
from bastion.kernels.cpu_linear import SkinnyLinear, fast_path, skinny_linear, use_skinny_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    w = torch.randn(300, 48, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    with torch.inference_mode():
        got, want = skinny_linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape == (rows, 300)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_keeps_leading_dims():
    x = torch.randn(1, 3, 16)
    w = torch.randn(10, 16)
    with torch.inference_mode():
        torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert skinny_linear(x, w).shape == (1, 3, 10)


def test_other_inputs_take_plain_linear():
    w = torch.randn(10, 16)
    with torch.inference_mode():
        assert fast_path(torch.randn(2, 16), w)
        assert not fast_path(torch.randn(65, 16), w)  # prefill-sized: MKL's gemm is fine
        assert not fast_path(torch.randn(2, 16, dtype=torch.float64), w.double())
    wg = w.clone().requires_grad_()
    assert not fast_path(torch.randn(2, 16), wg)  # training: autograd's linear
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(skinny_linear(x, w.double()), F.linear(x, w.double()))


def test_gradients_flow_in_training():
    lin = nn.Linear(16, 8)
    use_skinny_linear(lin)
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_without_onednn_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_onednn_ok", False)
    x, w = torch.randn(16, 32), torch.randn(20, 32)
    with torch.inference_mode():
        torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_switch_keeps_parameters_and_ties():
    emb = nn.Embedding(50, 16)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model[2].weight = emb.weight  # tied, as an LM head
    keys = list(model.state_dict())
    assert use_skinny_linear(model) == 2
    assert all(type(m) is SkinnyLinear for m in (model[0], model[2]))
    assert model[2].weight is emb.weight and list(model.state_dict()) == keys
    assert use_skinny_linear(model) == 0  # already switched
    assert use_skinny_linear(model, on=False) == 2
    assert type(model[0]) is nn.Linear

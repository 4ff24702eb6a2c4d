"""GPTQ (gptq.py): calibrated int4 beats round-to-nearest on correlated inputs, in the same format, fused again."""
from __future__ import annotations

import pytest
import torch

import infopt_lab as lab
from infopt_lab import gptq


def _correlated_layer():
    """A seeded layer W [64, 128] and calibration inputs X [512, 128] that mostly lie in 16 directions."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g)    # correlated inputs, like
    x = x + 0.1 * torch.randn(512, 128, generator=g)                            # a real layer's
    return x, torch.randn(64, 128, generator=g)


def _rtn_int4(w, H, group_size):
    """Round-to-nearest with GPTQ's signature: what a GPTQ step that did nothing would return."""
    return lab.quantize_asymmetric(w, 4, group_size)


GPTQ_MARGIN = 0.5   # a clear margin: GPTQ's output error on this layer is well under half of round-to-nearest's


def _beats_rtn(quantizer, group_size) -> bool:
    """Whether quantizer(w, H, group_size) leaves ||X W^T - X W_hat^T|| under GPTQ_MARGIN of round-to-nearest's."""
    x, w = _correlated_layer()
    H = x.T @ x / x.shape[0]                                                      # (K, K)
    err = lambda q_s_z: (x @ (w - lab.dequantize(*q_s_z)).T).norm().item()
    return err(quantizer(w, H, group_size)) < GPTQ_MARGIN * err(_rtn_int4(w, H, group_size))


@pytest.mark.parametrize("group_size", [32, None])
def test_gptq_lowers_the_output_error_of_round_to_nearest(group_size):
    assert _beats_rtn(gptq.gptq_int4, group_size)
    assert not _beats_rtn(_rtn_int4, group_size)          # the margin is what a do-nothing GPTQ cannot reach


def test_gptq_keeps_the_int4_format_of_round_to_nearest():
    x, w = _correlated_layer()
    q, s, z = gptq.gptq_int4(w, x.T @ x / x.shape[0], 32)
    q_rtn, s_rtn, z_rtn = lab.quantize_asymmetric(w, 4, 32)
    assert q.dtype == q_rtn.dtype and s.dtype == s_rtn.dtype and z.dtype == z_rtn.dtype
    assert q.shape == q_rtn.shape and s.shape == s_rtn.shape and z.shape == z_rtn.shape
    assert int(q.max()) == 15 and int(q.min()) == 0
    assert not torch.equal(q, q_rtn)                      # other integers: the point of it


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    """With H = I no input direction matters more than another: nothing to trade, so the same integers."""
    _, w = _correlated_layer()
    for group_size in (32, None):
        for got, want in zip(gptq.gptq_int4(w, torch.eye(128), group_size), lab.quantize_asymmetric(w, 4, group_size)):
            assert torch.equal(got, want)


def test_gptq_model_keeps_the_int4_format_and_lowers_every_layers_error(tiny):
    model, tok = tiny
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    q = gptq.gptq_quantize_model(model, ids, group_size=32)
    rtn = lab.quantize_model(model, "int4", group_size=32, quantize_tied_head=False)   # as GPTQ leaves the head
    assert {k: (v.shape, v.dtype) for k, v in q.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in rtn.state_dict().items()}
    moments = gptq.input_moments(model, ids)                          # H = X^T X / n of each layer's inputs
    layers = [name for name, m in q.named_modules() if isinstance(m, lab.QuantLinear)]
    assert layers and all(q.get_submodule(name).calibration == "gptq" for name in layers)
    for name in layers:                                               # E||X (W - W_hat)^T||^2 = tr(D H D^T)
        w, H = model.get_submodule(name).weight.detach().float(), moments[name]
        err = lambda m: torch.trace((d := w - m.get_submodule(name).dequantized_weight()) @ H @ d.T).item()
        assert err(q) < 0.85 * err(rtn), name


def test_gptq_layers_are_fused_again_after_calibration(tiny):
    model, _ = tiny
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    q = gptq.gptq_quantize_model(model, ids, group_size=32)
    mlp = q.layers[0].mlp
    assert mlp.fused is not None and mlp.fused.holds(mlp.projections())

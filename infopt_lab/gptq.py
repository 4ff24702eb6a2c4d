"""Calibration-aware int4 (GPTQ): round one input column at a time and let the rest absorb the error.

Round-to-nearest rounds every weight on its own. GPTQ rounds column k of W, then
nudges the columns not yet rounded so that the layer's output on real inputs
moves as little as possible. "Real inputs" are a small calibration set from the
train split; their second moment H = X.T X / n says which input directions
matter. The stored format is the same as round-to-nearest int4 (packed nibbles,
a scale and a zero point per group): only the chosen integers differ.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .quant_format import pack_int4
from .quantize import QuantLinear, fuse_quantized, quantize_asymmetric, quantize_model


def calibration_ids(tok, n_sequences: int = 16, seq_len: int = 512, seed: int = 0) -> Tensor:
    """Fixed windows of train-split text [n_sequences, seq_len], from files drawn across the split."""
    from .data import read_texts
    texts = read_texts("train")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    windows = []
    for i in order:
        ids = tok.encode(texts[i], add_special_tokens=False)
        if len(ids) >= seq_len:
            windows.append(ids[:seq_len])
        if len(windows) == n_sequences:
            break
    return torch.tensor(windows)                                  # (n_sequences, seq_len)


@torch.no_grad()
def input_moments(model: nn.Module, input_ids: Tensor) -> dict[str, Tensor]:
    """H = X.T X / rows of the inputs X [rows, K] every nn.Linear sees on `input_ids` [B, T]: {name: [K, K]}."""
    moments: dict[str, Tensor] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def hook(mod, args, out, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).float()  # (B*T, K)
                moments[name] = x.T @ x / x.shape[0]                 # (K, K)
            hooks.append(m.register_forward_hook(hook))
    try:
        model(input_ids.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return moments


@torch.no_grad()
def gptq_int4(w: Tensor, H: Tensor, group_size: int | None, damp: float = 0.01) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ int4 of w [N, K] given H [K, K]: (q uint8 [N, K], scale [N, K/G], zero uint8 [N, K/G])."""
    W = w.float().clone()                                         # (N, K)
    N, K = W.shape
    group_size = group_size or K                                  # None: one group per row
    H = H + damp * H.diagonal().mean() * torch.eye(K, device=W.device)   # damping keeps H invertible
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # (K, K)
    Q = torch.zeros(N, K, dtype=torch.uint8, device=W.device)
    scales, zeros = [], []
    for i in range(K):
        if i % group_size == 0:                                   # the group's range, from the updated weights
            _, s, z = quantize_asymmetric(W[:, i:i + group_size], 4, None)
            s, z = s.float()[:, 0], z.float()[:, 0]               # (N,)
            scales.append(s), zeros.append(z)
        q = torch.clamp(torch.round(W[:, i] / s + z), 0, 15)      # (N,)
        Q[:, i] = q.to(torch.uint8)
        err = (W[:, i] - (q - z) * s) / U[i, i]
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]     # spread the error over later columns
    return Q, torch.stack(scales, 1).to(w.dtype), torch.stack(zeros, 1).to(torch.uint8)


@torch.no_grad()
def gptq_quantize_model(model: nn.Module, calib_ids: Tensor, group_size: int | None = 64) -> nn.Module:
    """A new int4 model (same format as quantize_model(model, "int4")) rounded by GPTQ on `calib_ids` [B, T]."""
    moments = input_moments(model, calib_ids)
    new = quantize_model(model, "int4", group_size, quantize_tied_head=False)   # calibrated layers only
    for name, layer in new.named_modules():
        if not isinstance(layer, QuantLinear) or name not in moments:
            continue
        w = model.get_submodule(name).weight.detach().contiguous()
        q, scale, zero = gptq_int4(w, moments[name].to(w.device), group_size)
        layer.weight_q, layer.scales, layer.zeros = pack_int4(q), scale, zero
        layer.calibration = "gptq"
    return fuse_quantized(new)                 # the new buffers replaced the fused views: stack them again

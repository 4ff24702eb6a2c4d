"""The attention contract between the model and every KV cache, and the one causal mask.

The model computes q, k, v for the T new tokens of a call and hands them to its
cache: `y = cache.attend(layer, q, k, v, input_pos)`. A cache stores the new keys
and values its own way (contiguous, int8, paged blocks) and attends the queries
over everything the sequence has cached; the model never asks which cache it
has. `NoCache` is the cache of a call that keeps nothing (training, recompute).

Causal attention here is bottom-right aligned: the T queries are the last T of
S >= T positions, so query i sees keys 0 .. i + (S - T).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(n_q: int, n_k: int, device=None) -> Tensor:
    """[n_q, n_k] True where query i may see key j (bottom-right aligned): the package's only causal mask."""
    return torch.arange(n_k, device=device)[None, :] <= torch.arange(n_q, device=device)[:, None] + (n_k - n_q)


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of T queries [B, H, T, D] over S >= T keys [B, H_kv, S, D] -> [B, H, T, D]."""
    T, S = q.shape[2], k.shape[2]
    if T == 1:
        mask, causal = None, False               # one new query sees every cached position
    elif T == S:
        mask, causal = None, True                # plain causal self-attention over this call
    else:
        mask, causal = causal_mask(T, S, q.device), False   # new queries after a cached prefix
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


class NoCache:
    """The cache of a call that keeps nothing: attention over this call's own tokens."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Causal attention over the call's T tokens (`layer` and `input_pos` are not needed)."""
        return attend(q, k, v)

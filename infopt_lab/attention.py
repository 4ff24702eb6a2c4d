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


def _partial(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax attention left unnormalized: (sum of p v, running max m, sum of p), p = exp(q k / sqrt(D) - m)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    return torch.matmul(p, v), m, p.sum(-1, keepdim=True)


def shared_prefix_attend(q: Tensor, k_prefix: Tensor, v_prefix: Tensor, k: Tensor, v: Tensor,
                         allowed: Tensor) -> Tensor:
    """Attention of B sequences that share a prefix, reading the prefix's keys once (cascade attention).

    q [B, H, T, D] are the new tokens of B sequences; each sees all P keys of one shared prefix
    (k_prefix, v_prefix [1, H_kv, P, D]) and then its own keys k, v [B, H_kv, S, D] where
    `allowed` [B, 1, T, S] is True. The two parts are attended apart, every sequence's queries
    against the prefix in one matmul per KV head, and merged by their softmax maxima and sums:
    equal to attention over the concatenation, up to float rounding. -> [B, H, T, D]
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    G = H // H_kv                                                   # query heads per KV head (h = kv * G + g)
    qg = q.reshape(B, H_kv, G * T, D)                               # rows (g, t) of each KV head
    o1, m1, l1 = _partial(qg.transpose(0, 1).reshape(H_kv, B * G * T, D), k_prefix[0], v_prefix[0], None)
    o1, m1, l1 = (x.view(H_kv, B, G * T, -1).transpose(0, 1) for x in (o1, m1, l1))   # (B, H_kv, G*T, .)
    rows = allowed.unsqueeze(2).expand(B, 1, G, T, allowed.shape[-1]).reshape(B, 1, G * T, -1)
    o2, m2, l2 = _partial(qg, k, v, rows)                           # (B, H_kv, G*T, .)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return ((o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)).reshape(B, H, T, D)


class NoCache:
    """The cache of a call that keeps nothing: attention over this call's own tokens."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Causal attention over the call's T tokens (`layer` and `input_pos` are not needed)."""
        return attend(q, k, v)

"""Batch invariance: every row of a pass computed as if it were alone, so the number of rows cannot change a bit.

Float addition is not associative: (a + b) + c and a + (b + c) can differ in the last bit. A matrix
product over 4 rows may sum each dot product in another order than the same product over 1 row (a
matrix-matrix kernel tiles the reduction differently from a matrix-vector one), and the quantized
CPU kernels round to bf16 in different places at different row counts. So the logits of a token can
depend on how many other tokens share its pass: a speculative verify pass (k + 1 rows), a batched
engine step, a chunked prefill. A near tie between the top two logits then flips a greedy token.

Under `BatchInvariant` (vLLM's batch-invariant mode, on this package's scale) each row is computed
by the very call a one-row pass makes: linear layers (`F.linear`, fused projections, quantized
layers) one row at a time, and attention one query at a time over exactly the keys it may see,
copied to one layout. Normalisation, rotary embeddings and activations are row-wise already. The
price: each weight is streamed once per row instead of once per pass (measured by `infopt-lab bench
--only invariant`). Paths that read several rows at once by design (cascade attention, the Triton
paged kernel) are off in this mode.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_unary


def by_rows(fn: Callable[..., Tensor], x: Tensor, *args, **kwargs) -> Tensor:
    """fn(x, ...) for x [..., K] computed one row at a time, each row by the call a one-row pass makes."""
    rows = x.reshape(-1, x.shape[-1])                                        # (R, K)
    if rows.shape[0] <= 1:
        return fn(x, *args, **kwargs)
    out = torch.cat([fn(rows[i:i + 1], *args, **kwargs) for i in range(rows.shape[0])])   # (R, N)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def visible_keys(attn_mask: Tensor | None, is_causal: bool, T: int, S: int) -> Tensor:
    """[B', T] how many leading keys each query sees; the mask must allow a prefix of the keys (causal masks do)."""
    if attn_mask is None:
        n = torch.full((1, T), S) if not is_causal else (torch.arange(T) + 1)[None]
        return n
    if attn_mask.dtype != torch.bool:
        raise ValueError("batch_invariant=True attends with boolean masks only (True: may attend)")
    allowed = attn_mask.any(dim=1) if attn_mask.dim() == 4 else attn_mask[None]   # (B', T, S)
    n = allowed.sum(-1)                                                            # (B', T)
    prefix = torch.arange(S, device=attn_mask.device)[None, None] < n[..., None]
    if not torch.equal(prefix, allowed):
        raise ValueError("batch_invariant=True needs each query to see a prefix of the keys")
    return n.cpu()


def attention_by_query(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                       is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """Scaled dot-product attention, each query [b, :, t] alone over the keys it sees, in one layout."""
    B, H, T, D = q.shape
    S = k.shape[2]
    if dropout_p:
        raise ValueError("batch_invariant=True runs inference only: dropout_p must be 0")
    seen = visible_keys(attn_mask, is_causal, T, S).expand(B, T).tolist()
    out = torch.empty_like(q)                                                      # (B, H, T, D)
    for b in range(B):
        for t in range(T):
            n = seen[b][t]
            qt = q[b:b + 1, :, t:t + 1].contiguous()                              # (1, H, 1, D)
            kt, vt = k[b:b + 1, :, :n].contiguous(), v[b:b + 1, :, :n].contiguous()   # (1, H_kv, n, D)
            out[b:b + 1, :, t:t + 1] = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=enable_gqa)
    return out


def rowwise(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Mark a function of an input [..., K] as one that batch-invariant mode runs one row at a time.

    The function becomes overridable (`torch.overrides.handle_torch_function`), so `BatchInvariant`
    sees its calls even when it is no torch function (a quantized layer's product).
    """
    def wrapper(x: Tensor, *args, **kwargs) -> Tensor:
        if has_torch_function_unary(x):
            return handle_torch_function(wrapper, (x,), x, *args, **kwargs)
        return fn(x, *args, **kwargs)
    wrapper.__name__, wrapper.__doc__, wrapper.rowwise = fn.__name__, fn.__doc__, True
    return wrapper


class BatchInvariant(TorchFunctionMode):
    """Inside it, linear layers run row by row and attention query by query (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or getattr(func, "rowwise", False):
            return by_rows(func, *args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return attention_by_query(*args, **kwargs)
        return func(*args, **kwargs)


def invariant(enabled: bool):
    """`with invariant(enabled):` batch-invariant mode when enabled, nothing otherwise."""
    return BatchInvariant() if enabled else contextlib.nullcontext()

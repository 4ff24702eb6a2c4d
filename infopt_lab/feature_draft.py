"""A feature-level draft (EAGLE's idea, Li et al. 2024): one decoder layer that predicts the target's next hidden state.

A draft model (speculative.py) reads tokens only and must relearn the language from them. This draft
reads what the target already computed: its last hidden state h_t (before the final norm) and the
embedding of the token that follows. One decoder layer turns the pair into a guess of h_{t+1}; the
target's own final norm and head, restricted to the vocabulary entries the target says most often
(FR-Spec's idea), turn the guess into a token. The next step feeds the guess back, so k proposals
cost k passes of one layer and a small head.

Indexing. Draft position j reads (h_{j-1}, x_j): the target's feature after token j - 1 and token j,
and predicts h_j, whose logits name x_{j+1}. After a verify pass the target's true features replace
the guesses: the draft rolls back its k - 1 guessed positions and feeds the accepted ones again with
the features the target computed. Verification is the target's, so the tokens are exactly the target's.

The draft stores its own weights only (the fc that merges the pair, its layer, the covered token ids);
the embedding, final norm and head are the target's, read at call time (`attach`).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import validate
from .attention import NoCache
from .config import ModelConfig
from .kv_cache import KVCache
from .model import Block, rope_cache

BUNDLED_NAME = "smollm2-135m-eagle"


class FeatureDraft(nn.Module):
    """fc([h_{j-1}, embed(x_j)]) -> one decoder layer -> guessed h_j; logits over `token_ids` through the target's head."""

    def __init__(self, config: ModelConfig, token_ids: Tensor):
        super().__init__()
        C = config.dim
        self.config = ModelConfig(**{**asdict(config), "n_layers": 1})     # one layer: its cache has one
        self.fc = nn.Linear(2 * C, C, bias=True)
        self.block = Block(self.config, 0)
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if token_ids.dim() != 1 or not 0 < len(token_ids) <= config.vocab_size \
                or len(set(token_ids.tolist())) != len(token_ids) \
                or not 0 <= int(token_ids.min()) <= int(token_ids.max()) < config.vocab_size:
            raise ValueError(f"token_ids must be distinct ids in [0, {config.vocab_size}), at most the vocabulary")
        self.register_buffer("token_ids", token_ids)                         # (N,) most frequent first
        cos, sin = rope_cache(self.config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._target: list = []                                             # not a submodule: never saved
        self.quantization: tuple[str, int | None] | None = None             # (scheme, group size): `quantized`

    # -- the target's pieces -------------------------------------------------------------------
    def attach(self, target) -> "FeatureDraft":
        """Read the embedding, final norm and head from `target` (same width and vocabulary). Returns self."""
        validate.model("target", target)
        if target.config.dim != self.config.dim or target.config.vocab_size != self.config.vocab_size:
            raise ValueError(f"this draft reads features of width {self.config.dim} over {self.config.vocab_size} "
                             f"tokens; the target has width {target.config.dim} over {target.config.vocab_size}")
        self._target = [target]
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        self.head = target.lm_head.weight.detach()[self.token_ids]          # (N, C): the covered rows, a copy
        if self.quantization is not None:                                   # a quantized draft: its head too
            self.head = _quantized_head(self.head, *self.quantization)
        return self

    def bind(self, target) -> "FeatureDraft":
        """Attach `target` unless attached already; ValueError if attached to another model. Returns self."""
        if self._target and self._target[0] is not target:
            raise ValueError("this feature draft reads another model's embedding and head: call "
                             "draft.attach(target) with the target you decode with")
        return self if self._target else self.attach(target)

    @property
    def target(self):
        if not self._target:
            raise RuntimeError("attach the target first: draft.attach(target) (its embedding, norm and head)")
        return self._target[0]

    @property
    def coverage_size(self) -> int:
        return len(self.token_ids)

    def hidden(self, features: Tensor, tokens: Tensor, input_pos: Tensor, cache=None) -> Tensor:
        """Guessed next features [B, T, C] from target features [B, T, C] and the tokens after them [B, T]."""
        x = self.fc(torch.cat([features, self.target.embed_tokens(tokens)], dim=-1))
        dtype = x.dtype
        cos, sin = self.rope_cos[input_pos].to(dtype), self.rope_sin[input_pos].to(dtype)
        return self.block(x, cos, sin, input_pos, NoCache() if cache is None else cache)

    def covered_logits(self, h: Tensor) -> Tensor:
        """Logits over the covered tokens [..., N] of features [..., C] (the target's norm, the covered head rows)."""
        if self.quantization is not None:
            return self.head(self.target.norm(h))
        return F.linear(self.target.norm(h), self.head)

    def logits(self, h: Tensor) -> Tensor:
        """What the engine's runner reads as this model's logits: those over the covered tokens [..., N]."""
        return self.covered_logits(h)

    def full_logits(self, h: Tensor) -> Tensor:
        """Logits over the whole vocabulary [..., V]: the covered ones, -inf elsewhere (never proposed)."""
        covered = self.covered_logits(h)
        out = covered.new_full((*covered.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, covered)

    def num_parameters(self) -> int:
        """Its own weights, float or quantized (the target's embedding, norm and head are not counted)."""
        from .quantize import QuantLinear
        stored = sum(m.in_features * m.out_features + (0 if m.bias is None else m.bias.numel())
                     for m in self.modules() if isinstance(m, QuantLinear) and m is not getattr(self, "head", None))
        return sum(p.numel() for p in self.parameters()) + stored

    def quantized(self, scheme: str = "int8", group_size: int | None = None) -> "FeatureDraft":
        """A copy whose own products (fc, its layer) and covered head read `scheme` weights; this draft is untouched.

        A draft step streams its own weights and head, so on a CPU it costs about their bytes: int8 gives a
        quarter of fp32's. The draft only proposes, so the tokens stay the target's; what rounding costs is
        acceptance, which the bench measures beside the float draft's. On a CPU where the hand-written kernel
        runs (cpu_q8.py) the layers compute with it. The target's embedding and norm stay as they are.
        """
        from .quantize import quantize_model
        if self.quantization is not None:
            raise ValueError(f"this draft is already quantized ({self.quantization[0]}); quantize the float draft")
        target, head = self._target, self.__dict__.pop("head", None)
        self._target = []                                                   # neither the target nor the head
        try:                                                                # is the copy's to deep-copy
            new = quantize_model(self, scheme, group_size)
        finally:
            self._target = target
            if head is not None:
                self.head = head
        new.quantization = (scheme, group_size)
        _on_cpu_kernel(new)
        return new.attach(target[0]) if target else new

    # -- storage -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16, card: dict | None = None) -> Path:
        """Write draft.safetensors (its own weights and covered ids) and config.json (the target's shape)."""
        from safetensors.torch import save_file
        if self.quantization is not None:
            raise ValueError("save the float draft and quantize it after loading (draft.quantized()): a quantized "
                             "draft is remade from it in a second")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(path / "draft.safetensors"), metadata={"format": "pt"})
        config = {"kind": "feature_draft", "target": asdict(self.config) | {"n_layers": None}, **(card or {})}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, target=None) -> "FeatureDraft":
        """Load a saved draft; attach `target` when given (dtype and device follow it)."""
        from safetensors.torch import load_file
        path = Path(path)
        meta = json.loads((path / "config.json").read_text())
        if meta.get("kind") != "feature_draft":
            raise ValueError(f"{path} does not hold a feature draft (config.json kind={meta.get('kind')!r})")
        shape = {k: v for k, v in meta["target"].items() if k != "n_layers"}
        state = load_file(str(path / "draft.safetensors"))
        draft = cls(ModelConfig(**shape, n_layers=1), state["token_ids"])
        draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        draft.eval()
        return draft.attach(target) if target is not None else draft


def _on_cpu_kernel(module: nn.Module) -> None:
    """Switch a quantized module's layers on a CPU to the hand-written kernel where it runs here (cpu_q8.py)."""
    from . import cpu_q8
    from .quantize import use_q8_kernel
    p = next(module.buffers())
    if p.device.type == "cpu" and cpu_q8.why_not() is None:
        use_q8_kernel(module)


def _quantized_head(rows: Tensor, scheme: str, group_size: int | None) -> nn.Module:
    """The covered head rows [N, C] as a quantized linear layer (N outputs), on the kernel a CPU runs."""
    from .quantize import quantize_linear
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    with torch.no_grad():
        linear.weight.copy_(rows)
    head = quantize_linear(linear, scheme, group_size)
    _on_cpu_kernel(head)
    return head


def load_feature_draft(target, name_or_path: str | Path = BUNDLED_NAME) -> FeatureDraft:
    """A saved feature draft (the bundled name, or a directory that `save_pretrained` wrote), attached to `target`."""
    from .loading import ASSETS
    validate.instance("the feature draft", name_or_path, (str, Path), "named by a string or a path")
    path = ASSETS / BUNDLED_NAME if str(name_or_path) == BUNDLED_NAME else Path(name_or_path).expanduser()
    if not (path / "draft.safetensors").exists():
        if str(name_or_path) == BUNDLED_NAME:
            raise FileNotFoundError(f"the bundled feature draft is missing from {path}; remake it with "
                                    f"`python scripts/train_feature_draft.py --out {path}`")
        raise FileNotFoundError(f"{path} holds no feature draft (draft.safetensors); give {BUNDLED_NAME!r} or a "
                                "directory that FeatureDraft.save_pretrained wrote")
    return FeatureDraft.from_pretrained(path, target)


def initial_draft(target, token_ids: Tensor, seed: int = 0) -> FeatureDraft:
    """A fresh draft for `target`: its layer starts as a copy of the target's last layer, fc passes h through."""
    torch.manual_seed(seed)
    draft = FeatureDraft(target.config, token_ids)
    last = target.layers[-1]
    with torch.no_grad():
        for name, p in draft.block.named_parameters():
            p.copy_(last.get_parameter(name).float())
        C = target.config.dim
        draft.fc.weight.zero_()
        draft.fc.weight[:, :C] = torch.eye(C)                               # the feature through, unchanged
        draft.fc.weight[:, C:].normal_(0, 0.02)                             # a little of the token
        draft.fc.bias.zero_()
    return draft.float().attach(target)


# -- the step loop: propose k, verify, keep the target's features ------------------------------
class FeatureState:
    """One sequence's draft cache and the (feature, token) pairs it has not seen yet."""

    def __init__(self, draft: FeatureDraft, capacity: int):
        self.draft = draft
        self.cache = KVCache.for_model(draft, 1, capacity)
        self.pos = 0
        self.pending_h: Tensor | None = None     # (n, C) target features
        self.pending_x: list[int] = []           # the n tokens after them
        self.forwards = 0
        self._guessed = 0                        # positions of the last proposal that hold the draft's own guesses

    def catch_up(self, features: Tensor, tokens: list[int]) -> None:
        """Queue true target features [n, C] with the tokens that follow each."""
        self.pending_h = features if self.pending_h is None else torch.cat([self.pending_h, features])
        self.pending_x += tokens

    @torch.inference_mode()
    def _step(self, h: Tensor, x: list[int]) -> Tensor:
        T = len(x)
        pos = torch.arange(self.pos, self.pos + T, device=h.device)
        out = self.draft.hidden(h[None], torch.tensor([x], device=h.device), pos, self.cache)[0]    # (T, C)
        self.pos += T
        self.forwards += 1
        return out

    @torch.inference_mode()
    def propose(self, k: int, greedy: bool = True, probs=None, generator=None) -> tuple[list[int], list[Tensor]]:
        """k tokens from the queued pairs then from its own guesses; with `probs` (logits -> distribution), q too.

        Afterwards the guessed positions (k - 1) stay in the cache until `settle` replaces them.
        """
        from .sampling import draw
        h = self._step(self.pending_h, self.pending_x)[-1]
        self.pending_h, self.pending_x = None, []
        tokens, q = [], []
        for i in range(k):
            if greedy:
                tokens.append(int(self.draft.token_ids[self.draft.covered_logits(h).argmax()]))
            else:
                q.append(probs(self.draft.full_logits(h)))
                tokens.append(int(draw(q[-1], generator)))
            if i < k - 1:
                h = self._step(h[None], [tokens[-1]])[-1]
        self._guessed = k - 1
        return tokens, q

    def settle(self) -> None:
        """Forget the guessed positions of the last proposal (the target's features replace them)."""
        self.pos -= self._guessed
        self._guessed = 0

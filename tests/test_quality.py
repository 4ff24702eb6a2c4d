"""infopt_lab.quality: perplexity and bits per byte in one pass, over a split tokenized once per tokenizer."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import infopt_lab as lab
from infopt_lab import data, quality
from infopt_lab.loading import bundled_model_dir

# Computed by the separate lab.perplexity and lab.bits_per_byte before they shared `evaluate`,
# on the val split of this Python's standard library (179,288 tokens), seq_len=64, max_tokens=513.
PINNED_VAL_TOKENS = 179_288
PINNED = {"target": (39.97591886982839, 1.4694618967436783),
          "draft": (81.79107490927005, 1.75468296530636)}


@pytest.mark.parametrize("name", ["target", "draft"])
def test_evaluate_gives_the_numbers_the_separate_functions_gave(name):
    model, tok = lab.load_model(name, dtype=torch.float32, device="cpu")
    tokens, _ = quality.split_tokens(tok, "val")
    if len(tokens) != PINNED_VAL_TOKENS:
        pytest.skip(f"this Python's stdlib gives {len(tokens)} val tokens, the pinned values {PINNED_VAL_TOKENS}")
    e = lab.evaluate(model, tok, split="val", seq_len=64, max_tokens=513)
    ppl, bpb = PINNED[name]
    assert e.perplexity == pytest.approx(ppl, rel=1e-6)
    assert e.bits_per_byte == pytest.approx(bpb, rel=1e-6)
    assert (e.n_tokens, e.n_bytes) == (512, 1854)
    assert lab.perplexity(model, tok, split="val", seq_len=64, max_tokens=513) == pytest.approx(ppl, rel=1e-6)
    assert lab.bits_per_byte(model, tok, split="val", seq_len=64, max_tokens=513) == pytest.approx(bpb, rel=1e-6)


def test_evaluate_equals_the_definitions(tiny):
    model, tok = tiny
    tokens, _ = data.encode_split(tok, "val")
    windows = data.eval_windows(tokens[:257], 128)                            # (2, 129)
    with torch.no_grad():
        logits = model(windows[:, :-1]).float()                                # (2, 128, V)
    nats = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").item()
    n_bytes = int(data.token_byte_lengths(tok)[windows[:, 1:]].sum())
    e = quality.evaluate(model, tok, seq_len=128, max_tokens=256)
    assert (e.n_tokens, e.n_bytes) == (256, n_bytes)
    assert e.perplexity == pytest.approx(math.exp(nats / 256), rel=1e-6)
    assert e.bits_per_byte == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)


def test_perplexity_and_bits_per_byte_agree(tiny):
    model, tok = tiny
    ppl = lab.perplexity(model, tok, max_tokens=2048)
    bpb = lab.bits_per_byte(model, tok, max_tokens=2048)
    # a random model is close to uniform over the vocabulary
    assert 0.5 * 4096 < ppl < 2 * 4096
    assert bpb == pytest.approx(math.log2(ppl) * 2048 / _bytes_of_first_tokens(tok, 2048), rel=1e-6)


def _bytes_of_first_tokens(tok, n):
    tokens, _ = data.encode_split(tok, "val")
    lengths = data.token_byte_lengths(tok)
    windows = data.eval_windows(tokens[:n + 1], 256)
    return int(lengths[windows[:, 1:]].sum())


class CountingTokenizer:
    """A tokenizer's backend that counts how many times it encodes a batch of texts."""

    def __init__(self, backend, counts: list):
        self.backend, self.counts = backend, counts

    def encode_batch(self, *args, **kwargs):
        self.counts.append(1)
        return self.backend.encode_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_the_split_is_tokenized_once_per_tokenizer(tiny):
    from tokenizers import Tokenizer
    model, _ = tiny
    counts = []
    target_tok = CountingTokenizer(data.load_tokenizer(bundled_model_dir("target")).backend_tokenizer, counts)
    draft_tok = CountingTokenizer(data.load_tokenizer(bundled_model_dir("draft")).backend_tokenizer, counts)
    quality._tokenize_split.cache_clear()
    e = quality.evaluate(model, target_tok, max_tokens=256)
    assert lab.perplexity(model, target_tok, max_tokens=256) == e.perplexity
    assert lab.bits_per_byte(model, draft_tok, max_tokens=256) == e.bits_per_byte
    assert len(counts) == 1                          # the target and the draft share one tokenizer
    other = Tokenizer.from_str(target_tok.to_str())
    other.add_special_tokens(["<|other|>"])         # a different tokenizer: its own entry
    quality.split_tokens(CountingTokenizer(other, counts), "val")
    assert len(counts) == 2


def test_cached_tokens_are_read_only(tiny):
    tokens, _ = quality.split_tokens(tiny[1], "val")
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 0


def test_evaluate_needs_one_full_window(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="no window of seq_len=64 tokens fits in the 11 tokens"):
        quality.evaluate(model, tok, seq_len=64, max_tokens=10)

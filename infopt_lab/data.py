"""The corpus: the Python standard library source of the running interpreter.

It is on every machine that runs the course, it is real code, and it needs no
download. Test suites are left out (their boilerplate teaches a model to loop).
Files are split into train and val by a hash of their relative path, so the
split is deterministic and a file never straddles it.
"""
from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

from . import validate

VAL_PERCENT = 5                      # share of files held out for validation
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SPECIAL_TOKEN = "<|endoftext|>"      # separates files; also BOS and EOS


def stdlib_dir() -> Path:
    """Where the running interpreter's standard library lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(rel: Path) -> bool:
    return any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_")


def split_of(rel_path: str) -> str:
    """'val' or 'train' for a path relative to the standard library root."""
    h = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return "val" if h % 100 < VAL_PERCENT else "train"


@functools.lru_cache(maxsize=None)
def corpus_files(split: str = "train", root: str | None = None) -> tuple[Path, ...]:
    """Sorted source files of one split ('train', 'val' or 'all')."""
    validate.choice("split", split, ("train", "val", "all"))
    base = Path(root) if root else stdlib_dir()
    files = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if _is_excluded(rel):
            continue
        if split == "all" or split_of(rel.as_posix()) == split:
            files.append(path)
    return tuple(files)


def read_texts(split: str = "train", root: str | None = None) -> list[str]:
    """File contents of a split, in sorted order; undecodable files are skipped."""
    texts = []
    for path in corpus_files(split, root):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def train_tokenizer(vocab_size: int = 4096, root: str | None = None):
    """A byte-level BPE tokenizer trained on the train split (the `tokenizers` library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(read_texts("train", root), trainer=trainer)
    add_bos(tok)
    return tok


def add_bos(tok) -> None:
    """Start every encoded text with the special token, as every training file starts after one.

    Without it a prompt looks like the middle of some file, and greedy decoding of a
    function header drifts into whatever text it guesses came before.
    """
    from tokenizers import processors
    bos = tok.token_to_id(SPECIAL_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKEN} $A", pair=f"{SPECIAL_TOKEN} $A {SPECIAL_TOKEN} $B",
        special_tokens=[(SPECIAL_TOKEN, bos)])


def save_tokenizer(tok, path: str | Path):
    """tokenizer.json plus the small config that lets AutoTokenizer open the directory."""
    import json
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKEN,
           "eos_token": SPECIAL_TOKEN, "unk_token": None, "pad_token": SPECIAL_TOKEN,
           "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(path: str | Path):
    """The directory's tokenizer through transformers' fast tokenizer."""
    from transformers import PreTrainedTokenizerFast
    path = Path(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                   bos_token=SPECIAL_TOKEN, eos_token=SPECIAL_TOKEN,
                                   pad_token=SPECIAL_TOKEN, clean_up_tokenization_spaces=False)


def encode_split(tok, split: str, root: str | None = None) -> tuple[np.ndarray, int]:
    """All files of a split as one uint16 token stream (files joined by the special token),
    and the number of UTF-8 bytes of text it encodes."""
    backend = getattr(tok, "backend_tokenizer", tok)
    eot = backend.token_to_id(SPECIAL_TOKEN)
    texts = read_texts(split, root)
    ids: list[int] = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return np.asarray(ids, dtype=np.uint16), n_bytes


def random_batch(tokens: np.ndarray, batch_size: int, seq_len: int,
                 rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs [B, T] and next-token targets [B, T]."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    window = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(window[:, :-1])
    y = torch.from_numpy(window[:, 1:])
    return x, y


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens, [N, T + 1], in order."""
    n = (len(tokens) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


def token_byte_lengths(tok) -> torch.Tensor:
    """UTF-8 bytes each token id stands for ([V]); the special token counts 0.

    A byte-level BPE piece spells each byte with one printable character, so a
    piece's length is its byte count.
    """
    backend = getattr(tok, "backend_tokenizer", tok)
    vocab = backend.get_vocab()
    out = torch.zeros(max(vocab.values()) + 1, dtype=torch.long)
    for piece, idx in vocab.items():
        if piece != SPECIAL_TOKEN:
            out[idx] = len(piece)
    return out

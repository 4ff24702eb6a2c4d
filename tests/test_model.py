import json

import pytest
import torch

import infopt_lab as lab
from infopt_lab.config import ModelConfig, get_preset
from infopt_lab.kv_cache import KVCache
from infopt_lab.model import Transformer


def test_logits_match_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM
    ours = Transformer.from_pretrained(tiny_dir)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    x = torch.randint(0, ours.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(x) - theirs(x).logits).abs().max().item()
    assert diff <= 1e-4


def test_bundled_target_matches_transformers():
    from transformers import AutoModelForCausalLM
    import infopt_lab as lab
    path = lab.loading.bundled_model_dir("target")
    ours = Transformer.from_pretrained(path)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randint(0, ours.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= 1e-4


def test_cached_forward_equals_full_forward(tiny):
    model, _ = tiny
    x = torch.randint(0, model.config.vocab_size, (2, 24))
    cache = KVCache.for_model(model, batch_size=2)
    with torch.no_grad():
        full = model(x)
        parts = [model(x[:, :10], torch.arange(10), cache),          # prefill
                 model(x[:, 10:16], torch.arange(10, 16), cache)]     # a chunk after a prefix
        parts += [model(x[:, t:t + 1], torch.tensor([t]), cache) for t in range(16, 24)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_save_load_roundtrip_and_tied_head(tmp_path):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny")).eval()
    model.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    loaded = Transformer.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_untied_grouped_query_model_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    config = ModelConfig(vocab_size=300, dim=48, n_layers=2, n_heads=6, n_kv_heads=3,
                         intermediate_size=96, max_seq_len=64, tie_embeddings=False)
    torch.manual_seed(0)
    Transformer(config).save_pretrained(tmp_path, dtype=torch.float32)
    ours = Transformer.from_pretrained(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, 300, (3, 20))
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=100, n_heads=3), "divisible by n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(n_layers=0), "n_layers must be an integer >= 1, got 0"),
])
def test_config_rejects_bad_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        get_preset("huge")


def test_positions_past_context_are_rejected(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="past the model's context"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([model.config.max_seq_len]))


def test_loaded_models_run_fused_column_major_projections_with_the_same_logits():
    from infopt_lab.model import Transformer, set_weight_layout, weight_layout
    model, _ = lab.load_model("target")
    plain = Transformer.from_pretrained(lab.loading.resolve_model_dir("target"))
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert weight_layout(model) == "column" and weight_layout(plain) == "row"
    assert attn.fused.holds((attn.q_proj, attn.k_proj, attn.v_proj)) and mlp.fused.holds((mlp.gate_proj, mlp.up_proj))
    assert model.lm_head.weight is model.embed_tokens.weight                       # still tied
    assert sorted(model.state_dict()) == sorted(plain.state_dict())               # same names, same tensors
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=1e-5)
        seen = []                                                                 # a hook must see its layer
        handle = attn.k_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=1e-5)
        handle.remove()
        assert seen == [(2, 19, model.config.n_kv_heads * model.config.head_dim)]
        attn.q_proj.weight.mul_(2.0)                                              # in place: the fused weight sees it
        plain.layers[0].self_attn.q_proj.weight.mul_(2.0)
        torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=1e-5)
        half = model.to(torch.bfloat16)                                           # new tensors: fusion steps aside
        assert not half.layers[0].self_attn.fused.holds((half.layers[0].self_attn.q_proj,
                                                         half.layers[0].self_attn.k_proj,
                                                         half.layers[0].self_attn.v_proj))
        # against the same layout: a CPU's bf16 product may round a column-major weight unlike a row-major one
        same_layout = set_weight_layout(plain.to(torch.bfloat16), "column")
        torch.testing.assert_close(half(ids).float(), same_layout(ids).float(), rtol=0, atol=0)


def test_weight_layout_round_trips_and_refuses_unknown_layouts():
    from infopt_lab.model import set_weight_layout, weight_layout
    model, _ = lab.load_model("draft")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        before = model(ids)
        assert weight_layout(set_weight_layout(model, "row")) == "row"
        torch.testing.assert_close(model(ids), before, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="'row' or 'column'"):
        set_weight_layout(model, "diagonal")

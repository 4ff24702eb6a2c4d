"""The bundled models meet the course's bar, and their cards say what they measure."""
import re

import pytest

import infopt_lab as lab
from infopt_lab.loading import bundled_model_dir


# The quality bar is measured on the validation split's first 32,768 tokens, the amount SmolLM2's cards are
# measured on: a fifth of the split and of its time. The cards give the whole split's figures.
BAR_TOKENS = 32_768


@pytest.fixture(scope="module")
def figures():
    out = {}
    for name in ("target", "draft"):
        model, tok = lab.load_model(name)
        out[name] = {"params": model.num_parameters(), "bpb": lab.bits_per_byte(model, tok, max_tokens=BAR_TOKENS)}
    return out


def test_quality_bar(figures):
    assert figures["target"]["bpb"] <= 1.3
    assert figures["draft"]["bpb"] >= 1.1 * figures["target"]["bpb"]


def test_sizes(figures):
    assert 4e6 <= figures["target"]["params"] <= 30e6
    assert figures["draft"]["params"] <= figures["target"]["params"] / 8
    on_disk = sum((bundled_model_dir(n) / "model.safetensors").stat().st_size for n in ("target", "draft"))
    assert on_disk <= 40e6


def test_target_and_draft_share_the_tokenizer():
    a, b = (bundled_model_dir(n) / "tokenizer.json" for n in ("target", "draft"))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("name", ["target", "draft"])
def test_model_card_reports_the_measured_figures(figures, name):
    card = (bundled_model_dir(name) / "MODEL_CARD.md").read_text()
    # the stdlib (and so the val split) differs a little between Python versions
    stated = float(re.search(r"bits per byte: ([0-9.]+)", card).group(1))
    assert stated == pytest.approx(figures[name]["bpb"], abs=0.02)
    assert f"{figures[name]['params']:,}" in card
    assert re.search(rf"infopt-lab train --preset {name} --out \S+", card)
    assert card.count("```python") == 3


def test_smollm2_draft_is_small_and_shares_smollm2s_tokenizer():
    import json
    from infopt_lab import hub
    draft_dir = bundled_model_dir("smollm2-135m-draft")
    config = json.loads((draft_dir / "config.json").read_text())
    target = json.loads((hub.model_dir("smollm2-135m") / "config.json").read_text()) if hub.is_cached("smollm2-135m") \
        else None
    draft, tok = lab.load_model("smollm2-135m-draft")
    assert (draft_dir / "model.safetensors").stat().st_size <= 30e6                # bf16, bundled
    assert draft.num_parameters() <= 134_515_008 / 8                                # SmolLM2-135M's count / 8
    assert config["vocab_size"] == 49152 and config["eos_token_id"] == 2
    if target is not None:
        assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == \
            (target["vocab_size"], target["bos_token_id"], target["eos_token_id"])
        assert (draft_dir / "tokenizer.json").read_bytes() == (hub.model_dir("smollm2-135m") / "tokenizer.json").read_bytes()
    assert tok.encode("def f(x):\n    return x + 12345\n") == \
        lab.loading.load_tokenizer_dir(draft_dir).encode("def f(x):\n    return x + 12345\n")


def test_smollm2_draft_card_reports_the_measured_figures():
    from infopt_lab.model_card import QUALITY_TOKENS
    draft, tok = lab.load_model("smollm2-135m-draft")
    card = (bundled_model_dir("smollm2-135m-draft") / "MODEL_CARD.md").read_text()
    measured = lab.bits_per_byte(draft, tok, max_tokens=QUALITY_TOKENS["smollm2-135m-draft"])
    assert float(re.search(r"bits per byte: ([0-9.]+)", card).group(1)) == pytest.approx(measured, abs=0.02)
    assert f"{draft.num_parameters():,}" in card
    assert "infopt-lab train --preset smollm2-draft --out" in card
    assert "infopt-lab train --preset smollm2-draft-distill --init" in card

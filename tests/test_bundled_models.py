"""The bundled models meet the course's bar, and their cards say what they measure."""
import re

import pytest

import infopt_lab as lab
from infopt_lab.loading import bundled_model_dir


@pytest.fixture(scope="module")
def figures():
    out = {}
    for name in ("target", "draft"):
        model, tok = lab.load_model(name)
        out[name] = {"params": model.num_parameters(), "bpb": lab.bits_per_byte(model, tok)}
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

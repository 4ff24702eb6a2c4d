"""Distillation: the loss, the teacher's top-k cache (built once, resumable, never mixed) and the recipe around it."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import infopt_lab as lab
from infopt_lab.distill import (TeacherCache, distill, distillation_loss, teacher_cache,
                               validation_prompts)
from infopt_lab.config import get_preset
from infopt_lab.device import bf16_autocast
from infopt_lab.loading import bundled_model_dir
from infopt_lab.model import Transformer
from infopt_lab.train import RECIPES, Recipe, train


def test_loss_with_weight_zero_is_cross_entropy():
    torch.manual_seed(0)
    s, t, y = torch.randn(6, 50), torch.randn(6, 50), torch.randint(0, 50, (6,))
    torch.testing.assert_close(distillation_loss(s, y, t, weight=0.0), F.cross_entropy(s, y))


def test_kl_term_vanishes_when_the_student_is_the_teacher_and_matches_kl_div():
    torch.manual_seed(0)
    s, t, y = torch.randn(6, 50), torch.randn(6, 50), torch.randint(0, 50, (6,))
    ce = F.cross_entropy(s, y)
    torch.testing.assert_close(distillation_loss(s, y, s, weight=0.5), 0.5 * ce)
    kl = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(distillation_loss(s, y, t, weight=1.0), kl)
    # temperature softens both sides and scales the term by T^2
    kl2 = F.kl_div((s / 2).log_softmax(-1), (t / 2).log_softmax(-1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(distillation_loss(s, y, t, weight=1.0, temperature=2.0), 4 * kl2)


def test_top_k_term_is_non_negative_and_zero_only_for_a_matching_student():
    torch.manual_seed(0)
    t = torch.randn(4, 40)
    top = t.topk(8, dim=-1)
    y = torch.randint(0, 40, (4,))
    student = torch.randn(4, 40)
    assert distillation_loss(student, y, top.values, top.indices, weight=1.0) > 0
    # a student whose mass sits on the teacher's top 8, in the teacher's proportions
    match = torch.full((4, 40), -1e4).scatter(-1, top.indices, top.values)
    assert distillation_loss(match, y, top.values, top.indices, weight=1.0).abs() < 1e-4


@pytest.mark.parametrize("kwargs, match", [({"weight": 1.5}, "weight"), ({"weight": -0.1}, "weight"),
                                           ({"temperature": 0.0}, "temperature"),
                                           ({"temperature": float("nan")}, "temperature")])
def test_loss_refuses_bad_settings(kwargs, match):
    s, y = torch.randn(2, 10), torch.randint(0, 10, (2,))
    with pytest.raises(ValueError, match=match):
        distillation_loss(s, y, s, **kwargs)


@pytest.fixture(scope="module")
def teacher_and_windows(tiny_dir):
    teacher, _ = lab.load_model(tiny_dir)
    torch.manual_seed(0)
    return teacher, torch.randint(0, 4096, (5, 17))


def test_cache_holds_the_teachers_top_k_and_resumes_from_disk(tmp_path, teacher_and_windows):
    teacher, windows = teacher_and_windows
    cache = TeacherCache.build(teacher, windows, tmp_path, k=4, batch_size=2, progress=False)
    assert cache.values.shape == cache.indices.shape == (5, 16, 4) and len(cache) == 5
    with torch.no_grad(), bf16_autocast("cpu"):                # the precision the cache is built in here
        expected = teacher(windows[:, :-1].long()).float().topk(4, dim=-1)
    torch.testing.assert_close(cache.values.float(), expected.values.half().float())
    chunks = sorted(tmp_path.glob("topk-*.safetensors"))
    assert len(chunks) == 3                                      # 5 windows in batches of 2
    chunks[1].unlink()                                           # an interrupted build: one chunk missing
    again = TeacherCache.build(teacher, windows, tmp_path, k=4, batch_size=2, progress=False)
    assert torch.equal(again.indices, cache.indices) and torch.equal(again.values, cache.values)
    with pytest.raises(ValueError, match="built differently"):
        TeacherCache.build(teacher, windows, tmp_path, k=8, batch_size=2, progress=False)
    x, y, v, i = cache.batch(np.random.default_rng(0), 3)
    assert x.shape == y.shape == (3, 16) and v.shape == i.shape == (3, 16, 4)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_distill_moves_a_student_towards_the_teacher():
    teacher, tok = lab.load_model("target")
    config = get_preset("tiny")
    config.vocab_size = teacher.config.vocab_size
    torch.manual_seed(0)
    student = Transformer(config)
    cache = teacher_cache(teacher, tok, windows=8, seq_len=64, k=16, progress=False)
    x = cache.windows[:4, :-1].long()

    def kl():
        with torch.no_grad():
            t, s = teacher(x).log_softmax(-1), student(x).log_softmax(-1)
        return (t.exp() * (t - s)).sum(-1).mean().item()
    before = kl()
    log = distill(student, teacher, tok, steps=30, cache=cache, batch_size=4, lr=1e-2, warmup=2,
                    eval_every=15, progress=False)
    assert [e["step"] for e in log] == [15, 30] and all(0 <= e["agreement"] <= 1 for e in log)
    assert kl() < before


def test_distill_refuses_a_student_with_another_vocabulary():
    teacher, tok = lab.load_model("target")
    with pytest.raises(ValueError, match="vocabulary"):
        distill(Transformer(get_preset("tiny")), teacher, tok, steps=1, progress=False)


def test_validation_prompts_come_from_the_held_out_split_and_are_distinct():
    from infopt_lab.data import read_texts
    prompts = validation_prompts(6)
    assert len(prompts) == len(set(prompts)) == 6
    val = "\n".join(read_texts("val"))
    assert all(p.lstrip().startswith("def ") and p.rstrip("\n") in val for p in prompts)


def test_recipe_refuses_half_a_cached_teacher():
    with pytest.raises(ValueError, match="teacher_topk"):
        Recipe(teacher="target", distill_weight=0.5, teacher_topk=8)


def test_recipe_with_a_cached_teacher_trains_resumes_and_records_its_stages(tmp_path):
    tok_dir = bundled_model_dir("target")
    base = replace(RECIPES["tiny"], steps=6, eval_every=3, seq_len=32)
    train(base, tmp_path / "pre", tokenizer_dir=tok_dir, progress=False)
    recipe = replace(base, teacher="target", distill_weight=0.9, teacher_topk=8, teacher_windows=6,
                     init_from=str(tmp_path / "pre"))
    train(recipe, tmp_path / "kd", tokenizer_dir=tok_dir, progress=False, stop_after=3)
    assert len(list((tmp_path / "kd" / "teacher-topk").glob("topk-*.safetensors"))) == 2
    train(recipe, tmp_path / "kd", tokenizer_dir=tok_dir, progress=False)       # resumes
    assert not (tmp_path / "kd" / "teacher-topk").exists()                     # removed once the model is saved
    saved = json.loads((tmp_path / "kd" / "recipe.json").read_text())
    assert saved["teacher_topk"] == 8 and saved["init_recipe"]["steps"] == 6
    stages = [(e["stage"], e["step"]) for e in map(json.loads, (tmp_path / "kd" / "train_log.jsonl").open())]
    assert stages == [("pretrain", 3), ("pretrain", 6), ("distill", 3), ("distill", 6)]



class _DeviceProbe(torch.nn.Module):
    """A stand-in model whose weights live on `device` ("meta" stands in for a GPU on a CPU machine); it
    records where each input it is handed lives and answers uniform logits on the CPU."""

    def __init__(self, device: str, vocab: int = 7):
        super().__init__()
        self.w = torch.nn.Linear(1, 1, device=device)
        self.vocab, self.seen = vocab, set()

    def forward(self, x):
        self.seen.add(x.device.type)
        return torch.zeros(*x.shape, self.vocab)                 # (B, T, V)


def test_agreement_hands_each_model_its_inputs_on_its_own_device():
    from infopt_lab.distill import agreement
    student, teacher = _DeviceProbe("meta"), _DeviceProbe("cpu")
    assert agreement(student, teacher, torch.zeros(3, 5, dtype=torch.long), batch_size=2) == 1.0
    assert student.seen == {"meta"} and teacher.seen == {"cpu"}

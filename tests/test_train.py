"""The recipe trains, and stopping then resuming gives the same model as one run."""
import json

import torch

from infopt_lab.loading import bundled_model_dir
from infopt_lab.model import Transformer
from infopt_lab.train import RECIPES, lr_at, train
from dataclasses import replace


def _train(out, **kwargs):
    recipe = replace(RECIPES["tiny"], steps=20, eval_every=10)
    return train(recipe, out, tokenizer_dir=bundled_model_dir("target"), progress=False, **kwargs)


def test_resume_equals_uninterrupted(tmp_path):
    _train(tmp_path / "one")
    _train(tmp_path / "two", stop_after=10)           # interrupted after a checkpoint
    assert (tmp_path / "two" / "checkpoint" / "state.json").exists()
    assert not (tmp_path / "two" / "model.safetensors").exists()
    _train(tmp_path / "two")                          # the same command again resumes
    a = Transformer.from_pretrained(tmp_path / "one").state_dict()
    b = Transformer.from_pretrained(tmp_path / "two").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [10, 20]
    assert not (tmp_path / "two" / "checkpoint").exists()


def test_learning_rate_schedule():
    r = RECIPES["target"]
    assert lr_at(0, r) < lr_at(r.warmup - 1, r) == r.lr
    assert lr_at(r.steps, r) == r.lr * r.min_lr_ratio


def test_distillation_starts_from_init_and_moves_towards_the_teacher(tmp_path):
    import infopt_lab as lab
    _train(tmp_path / "student")                      # a short pretrain: the starting point
    train(replace(RECIPES["tiny"], steps=40, seed=1), tmp_path / "teacher", tokenizer_dir=bundled_model_dir("target"),
          progress=False)                            # a different model to imitate
    recipe = replace(RECIPES["tiny"], steps=30, eval_every=30, lr=1e-2, warmup=2, teacher=str(tmp_path / "teacher"),
                     distill_weight=1.0, init_from=str(tmp_path / "student"))
    train(recipe, tmp_path / "distilled", tokenizer_dir=bundled_model_dir("target"), progress=False)
    teacher, tok = lab.load_model(tmp_path / "teacher")
    x = torch.tensor([tok.encode("def read(path):\n    with open(path) as f:\n        return f.read()")])

    def kl_to_teacher(path):
        student, _ = lab.load_model(path)
        with torch.no_grad():
            t, s = teacher(x).log_softmax(-1), student(x).log_softmax(-1)
        return (t.exp() * (t - s)).sum(-1).mean().item()
    assert kl_to_teacher(tmp_path / "distilled") < kl_to_teacher(tmp_path / "student")
    saved = json.loads((tmp_path / "distilled" / "recipe.json").read_text())
    assert saved["teacher"] == str(tmp_path / "teacher") and saved["init_from"] == str(tmp_path / "student")


def test_distillation_needs_a_teacher():
    import pytest
    with pytest.raises(ValueError, match="teacher"):
        replace(RECIPES["tiny"], distill_weight=0.5)

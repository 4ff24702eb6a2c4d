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

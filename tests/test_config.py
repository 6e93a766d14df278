import json

import pytest

from labs import config, models
from labs import resolve as resolver
from labs.errors import LabsError

BASE = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"}}


def resolve(cfg, **kw):
    args = dict(world_size=2, micro_batch=None, grad_accum=None, steps=20, dims=models.shape("tiny"), on_gpu=False)
    return resolver.ds_config(cfg, **{**args, **kw})


def test_autos_are_resolved_like_hf():
    out = resolve(BASE, micro_batch=4, grad_accum=2, lr=1e-3)
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == \
        (16, 4, 2)
    zero = out["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640
    assert out["optimizer"]["params"]["lr"] == 1e-3
    assert out["scheduler"]["params"] == {"total_num_steps": 20, "warmup_num_steps": 2}
    assert out["optimizer"]["params"]["torch_adam"] is True          # no GPU: no just-in-time FusedAdam build
    assert BASE["train_batch_size"] == "auto"                          # input left untouched


def test_train_batch_size_from_file_derives_accumulation():
    out = resolve({**BASE, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert out["gradient_accumulation_steps"] == 4


def test_batch_mismatch_names_the_key():
    with pytest.raises(LabsError, match="'train_batch_size' is 10 but micro-batch 4 x gradient accumulation 1 x 2"):
        resolve({**BASE, "train_batch_size": 10}, micro_batch=4, grad_accum=1)


def test_cli_value_conflicting_with_file():
    with pytest.raises(LabsError, match="'train_micro_batch_size_per_gpu' is 8 but --micro-batch is 4"):
        resolve({**BASE, "train_micro_batch_size_per_gpu": 8}, micro_batch=4)


def test_unresolvable_auto_names_the_key():
    cfg = {**BASE, "zero_optimization": {"stage": 3, "sub_group_size": "auto"}}
    with pytest.raises(LabsError, match="'zero_optimization.sub_group_size' is \"auto\""):
        resolve(cfg)


def test_fp16_refused_on_cpu():
    with pytest.raises(LabsError, match="fp16"):
        resolve({**BASE, "fp16": {"enabled": True}})


def test_load_errors(tmp_path):
    with pytest.raises(LabsError, match="does not exist"):
        config.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"stage": 3,}')
    with pytest.raises(LabsError, match="not valid JSON: line 1 column 13"):
        config.load(tmp_path / "bad.json")
    (tmp_path / "ok.json").write_text(json.dumps(BASE))
    assert config.load(tmp_path / "ok.json") == BASE


def test_config_names_resolve_against_ds_configs_from_any_directory(tmp_path, monkeypatch):
    from labs import CONFIGS

    monkeypatch.chdir(tmp_path)
    assert config.find("zero2.json") == CONFIGS / "zero2.json"
    assert config.load("zero2.json")["zero_optimization"]["stage"] == 2
    (tmp_path / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert config.find("zero2.json").resolve() == tmp_path / "zero2.json"      # a file here wins over the course's
    with pytest.raises(LabsError, match="config 'nope.json' does not exist"):
        config.load("nope.json")

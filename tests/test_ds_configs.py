"""ds_configs/: every file resolves through labs and parses through DeepSpeed's own config class; the helpers
the chapters use to compare and vary configs."""
import pytest

from conftest import ROOT
from labs import config, models, resolve
from labs.errors import LabsError

FILES = sorted((ROOT / "ds_configs").glob("*.json"))
# FSDP2 files (an "fsdp" block, no zero_optimization) are checked by labs' own parser: tests/test_fsdp.py.
DEEPSPEED_FILES = [f for f in FILES if "fsdp" not in config.load(f)]
TINY = models.shape("tiny")


def _resolve(raw, on_gpu=False, **kw):
    return resolve.ds_config(raw, world_size=2, micro_batch=2, grad_accum=1, steps=20, dims=TINY, on_gpu=on_gpu, **kw)


class _TwoRanks:
    """DeepSpeedConfig asks an mpu for the data-parallel world size: these configs are for 2 ranks."""

    def get_data_parallel_world_size(self):
        return 2


def test_the_chapter_files_are_all_there():
    names = {f.name for f in FILES}
    assert {"zero0_ddp.json", "zero1.json", "zero2.json", "zero3.json", "zero2_offload_optimizer.json",
            "zero3_offload_optimizer.json", "zero3_offload_all.json", "zero3_nvme.json"} <= names


@pytest.mark.parametrize("path", DEEPSPEED_FILES, ids=[f.name for f in DEEPSPEED_FILES])
def test_every_config_parses_through_deepspeed(path):
    import single_process_group
    from deepspeed.runtime.config import DeepSpeedConfig

    single_process_group.ensure()
    raw = config.load(path)
    nvme = "nvme" in config.offloads(raw).values()
    resolved = _resolve(raw, on_gpu=nvme)          # NVMe is for GPU hosts: resolve it as one would
    parsed = DeepSpeedConfig(resolved, mpu=_TwoRanks())
    assert parsed.train_batch_size == 4 and parsed.train_micro_batch_size_per_gpu == 2
    assert parsed.zero_optimization_stage == config.stage(raw)
    zero = parsed.zero_config
    for part, section in (("optimizer", zero.offload_optimizer), ("param", zero.offload_param)):
        wanted = config.offloads(raw)[part]
        device = getattr(section, "device", None) or "none"
        assert getattr(device, "value", device) == (wanted or "none"), (part, section)
    if nvme:
        assert zero.offload_param.buffer_size == TINY["vocab_size"] * TINY["hidden_size"]   # "auto" resolved
        assert parsed.aio_config["queue_depth"] == 8


def test_nvme_refused_without_gpu_and_needs_a_real_path(tmp_path):
    raw = config.load(ROOT / "ds_configs/zero3_nvme.json")
    with pytest.raises(LabsError, match="NVMe offload needs a GPU host"):
        _resolve(raw)
    resolved = _resolve(raw, on_gpu=True)
    with pytest.raises(LabsError, match=r"offload_optimizer.nvme_path' is '/local_nvme'"):
        config.check_nvme_paths(resolved)
    z = "zero_optimization."
    here = config.variant(resolved, {z + "offload_optimizer.nvme_path": str(tmp_path),
                                     z + "offload_param.nvme_path": str(tmp_path)})
    config.check_nvme_paths(here)


def test_precision_override():
    raw = config.load(ROOT / "ds_configs/zero2.json")
    assert config.precision(_resolve(raw)) == "bf16"
    fp32 = _resolve(raw, precision="fp32")
    assert config.precision(fp32) == "fp32" and fp32["bf16"] == {"enabled": False}
    with pytest.raises(LabsError, match="unknown precision 'fp8'"):
        _resolve(raw, precision="fp8")


def test_diff_names_added_removed_and_changed_keys():
    a = {"zero_optimization": {"stage": 2, "allgather_bucket_size": 5}, "bf16": {"enabled": True}}
    b = {"zero_optimization": {"stage": 3, "prefetch": "auto"}, "bf16": {"enabled": True}}
    assert config.diff(a, b) == ["~ zero_optimization.stage: 2 -> 3", '+ zero_optimization.prefetch: "auto"',
                                 "- zero_optimization.allgather_bucket_size: 5"]
    assert config.diff(a, a) == []


def test_variant_sets_and_removes_dotted_keys_without_touching_the_input():
    base = {"zero_optimization": {"stage": 2, "overlap_comm": True}}
    out = config.variant(base, {"zero_optimization.overlap_comm": None, "zero_optimization.reduce_bucket_size": 7,
                                "aio.queue_depth": 4})
    assert out == {"zero_optimization": {"stage": 2, "reduce_bucket_size": 7}, "aio": {"queue_depth": 4}}
    assert base == {"zero_optimization": {"stage": 2, "overlap_comm": True}}


def test_lesson_configs_share_everything_but_their_lesson():
    """Chapter 2 compares stages on 'the same math': every lesson file must carry the same optimizer, schedule,
    batch keys, clipping and precision, so that a difference between runs is the lesson's own keys."""
    import json

    from labs import CONFIGS

    shared = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "gradient_clipping", "bf16")
    files = sorted(CONFIGS.glob("*.json"))
    first = json.loads(files[0].read_text())
    for path in files[1:]:
        config = json.loads(path.read_text())
        for key in shared:
            assert config.get(key) == first.get(key), (path.name, key)

"""labs.offload_copy: ZeRO-3 offload's copy of the updated weights, cast on the GPU instead of the CPU (opt-in with
LABS_OFFLOAD_COPY=gpu). The same values as DeepSpeed's copy, in the restated method and in a real run."""
import json
import os
from types import SimpleNamespace

import torch

from conftest import ROOT, run_labs
from labs import offload_copy


def test_the_restated_method_is_deepspeeds_but_for_the_copy():
    """DeepSpeed 0.19.8's method (inside the nvtx wrapper DeepSpeed puts around it: the wrapper's source is every
    wrapped method's) hashes to what labs restates; labs' source differs from it in the marked copy (and its
    comments) only."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    import inspect
    original = Stage3.__dict__["_reassign_or_swap_out_partitioned_parameters"]
    ours = offload_copy._reassign_or_swap_out_partitioned_parameters
    assert original is not ours, "an earlier test left labs' copy installed"
    assert offload_copy.source_sha256(original) == offload_copy.RESTATED_SHA256

    def code(function):
        lines = inspect.getsource(offload_copy.unwrapped(function)).splitlines()
        return [line.strip() for line in lines if line.strip() and not line.strip().startswith(("#", '"""', "@"))]
    ours, theirs = code(offload_copy._reassign_or_swap_out_partitioned_parameters), code(original)
    assert [line for line in theirs if line not in ours] == [
        "self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(",
        "self.fp32_partitioned_groups_flat[sub_group_id].data)"]
    assert [line for line in ours if line not in theirs] == [
        "copy_updated_weights(self.fp16_partitioned_groups_flat[sub_group_id].data,          # the change",
        "self.fp32_partitioned_groups_flat[sub_group_id].data, _register_host_memory)"]
    assert len(ours) == len(theirs)


def test_the_copy_gives_the_cast_deepspeed_gives_and_unflattens():
    """On a stand-in optimizer: an fp32 sub-group on the host written into a bf16 partition, a chunk boundary inside,
    equals bf16.copy_(fp32); the partition's views are then reassigned as DeepSpeed does."""
    fp32 = torch.randn(70 * 2**20 + 3) * 10
    ours, theirs = torch.empty_like(fp32, dtype=torch.bfloat16), torch.empty_like(fp32, dtype=torch.bfloat16)
    unflattened = []
    stand_in = SimpleNamespace(fp16_partitioned_groups_flat=[ours], fp32_partitioned_groups_flat=[fp32],
                               _unflatten_partitioned_parameters=unflattened.append)
    offload_copy._reassign_or_swap_out_partitioned_parameters(stand_in, 0)
    theirs.copy_(fp32)
    assert torch.equal(ours, theirs) and unflattened == [0]
    same_dtype = torch.empty_like(fp32)                  # no cast: DeepSpeed's copy_
    offload_copy.copy_updated_weights(same_dtype, fp32, register=None)
    assert torch.equal(same_dtype, fp32)


def test_masters_are_page_locked_once_and_only_for_a_gpu(monkeypatch):
    """On a GPU the pageable master is registered before its first copy, once; on a CPU host nothing is."""
    registered = []
    src = torch.randn(1000)
    offload_copy.copy_updated_weights(torch.empty(1000, dtype=torch.bfloat16), src,
                                      register=lambda *args: registered.append(args))
    assert registered == []
    gpu_like = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16, is_contiguous=lambda: True)
    monkeypatch.setattr(offload_copy, "copy_in_chunks", lambda dst, source: None)
    for _ in range(2):                                    # the second copy finds it registered
        offload_copy.copy_updated_weights(gpu_like, src, register=lambda *args: registered.append(args))
    assert registered == [(src.untyped_storage().data_ptr(), 4000)]


def test_install_replaces_the_method_only_when_asked(monkeypatch):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    name = "_reassign_or_swap_out_partitioned_parameters"
    monkeypatch.setattr(Stage3, name, Stage3.__dict__[name])          # restored after the test
    monkeypatch.delenv(offload_copy.OPT_IN, raising=False)
    assert offload_copy.install() is False and getattr(Stage3, name) is not \
        offload_copy._reassign_or_swap_out_partitioned_parameters
    monkeypatch.setenv(offload_copy.OPT_IN, "gpu")
    assert offload_copy.install() is True and offload_copy.install() is True
    assert getattr(Stage3, name) is offload_copy._reassign_or_swap_out_partitioned_parameters


def test_a_zero3_offload_run_trains_the_same_with_either_copy(tmp_path, monkeypatch):
    """The tiny model under ZeRO-3 with the optimizer offloaded, 1 rank, 4 steps: labs' copy and DeepSpeed's give the
    same loss at every step, to the bit, and the run folder records which one ran."""
    losses = {}
    for name, opt_in in (("labs", "gpu"), ("deepspeed", None)):
        monkeypatch.delenv(offload_copy.OPT_IN, raising=False)
        if opt_in:
            monkeypatch.setenv(offload_copy.OPT_IN, opt_in)
        result = run_labs("train", "--preset", "tiny", "--config", ROOT / "ds_configs/zero3_offload_optimizer.json",
                          "--nproc", 1, "--steps", 4, "--lr", 1e-3, "--out", tmp_path / name, "--quiet", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        recorded = json.loads((tmp_path / name / "environment.json").read_text())
        assert recorded[offload_copy.OPT_IN] == opt_in
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in metrics]
    assert losses["labs"] == losses["deepspeed"] and losses["labs"][-1] < losses["labs"][0], losses

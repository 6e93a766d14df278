"""labs.offload_copy: ZeRO-3 offload's copy of the updated weights, cast on the GPU instead of the CPU (labs' default;
LABS_OFFLOAD_COPY=deepspeed keeps DeepSpeed's). The same values as DeepSpeed's copy, in the restated method and in a
real run."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, run_labs
from labs import offload_copy
from labs.errors import LabsError


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
        "self.fp32_partitioned_groups_flat[sub_group_id].data, _register_host_memory,",
        "wait=waits_after(sub_group_id, len(self.fp16_partitioned_groups_flat)))"]
    assert len(ours) == len(theirs) + 1


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
    monkeypatch.setattr(offload_copy, "_REGISTERED", set())     # the set lives as long as the process
    src = torch.randn(1000)
    offload_copy.copy_updated_weights(torch.empty(1000, dtype=torch.bfloat16), src,
                                      register=lambda *args: registered.append(args))
    assert registered == []
    gpu_like = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16, is_contiguous=lambda: True)
    monkeypatch.setattr(offload_copy, "copy_in_chunks", lambda dst, source, wait: None)
    for _ in range(2):                                    # the second copy finds it registered
        offload_copy.copy_updated_weights(gpu_like, src, register=lambda *args: registered.append(args))
    assert registered == [(src.untyped_storage().data_ptr(), 4000)]


def test_a_master_cuda_refuses_to_page_lock_is_copied_as_deepspeed_copies_it(monkeypatch, capsys):
    """A register that fails (a locked-memory limit, say) leaves that master on DeepSpeed's copy_, with one note, and
    is not tried again."""
    tried, copied = [], []

    def refuse(*args):
        tried.append(args)
        raise RuntimeError("CUDA error: out of memory")
    src = torch.randn(1000)
    gpu_like = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16, is_contiguous=lambda: True,
                               copy_=copied.append)
    monkeypatch.setattr(offload_copy, "_UNREGISTRABLE", set())
    monkeypatch.setattr(offload_copy, "_REGISTERED", set())     # an earlier test's tensor may have had this address
    monkeypatch.setattr(offload_copy, "copy_in_chunks", lambda dst, source, wait: copied.append("chunks"))
    for _ in range(2):
        offload_copy.copy_updated_weights(gpu_like, src, register=refuse)
    assert len(tried) == 1 and copied == [src, src]
    assert capsys.readouterr().err.count("could not page-lock") == 1


def test_the_choice_defaults_to_labs_copy_and_refuses_other_values():
    assert offload_copy.chosen({}) == "gpu" and offload_copy.chosen({offload_copy.CHOICE: ""}) == "gpu"
    assert offload_copy.chosen({offload_copy.CHOICE: "deepspeed"}) == "deepspeed"
    assert offload_copy.chosen({offload_copy.CHOICE: "gpu-wait"}) == "gpu-wait"
    with pytest.raises(LabsError, match="LABS_OFFLOAD_COPY 'cpu'; choose one of: gpu, gpu-wait, deepspeed"):
        offload_copy.chosen({offload_copy.CHOICE: "cpu"})
    zero3_offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert offload_copy.applies(zero3_offload, stock=False) and not offload_copy.applies(zero3_offload, stock=True)
    assert not offload_copy.applies({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, False)
    assert not offload_copy.applies({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, False)
    assert not offload_copy.applies({"zero_optimization": {"stage": 3}}, False)


def test_a_step_waits_for_the_copies_once_after_its_last_sub_group(monkeypatch):
    """DeepSpeed's step walks the sub-groups in order and calls the restated method for each: labs' copy returns
    without waiting for the GPU for every sub-group but the last (whose wait covers the copies queued before it on
    the same stream), or waits after each under LABS_OFFLOAD_COPY=gpu-wait."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    name = "_reassign_or_swap_out_partitioned_parameters"
    monkeypatch.setattr(Stage3, name, Stage3.__dict__[name])          # restored after the test
    monkeypatch.setattr(offload_copy, "_WAIT_EACH", False)               # so is what install() sets
    waits = []
    monkeypatch.setattr(offload_copy, "copy_updated_weights", lambda dst, src, register, wait: waits.append(wait))
    stand_in = SimpleNamespace(fp16_partitioned_groups_flat=[torch.empty(2)] * 3,
                               fp32_partitioned_groups_flat=[torch.empty(2)] * 3,
                               _unflatten_partitioned_parameters=lambda sub_group_id: None)
    for choice, expected in (("gpu", [False, False, True]), ("gpu-wait", [True, True, True])):
        monkeypatch.setenv(offload_copy.CHOICE, choice)
        assert offload_copy.install() is True
        waits.clear()
        for sub_group_id in range(3):
            offload_copy._reassign_or_swap_out_partitioned_parameters(stand_in, sub_group_id)
        assert waits == expected, (choice, waits)


def test_install_replaces_the_method_unless_told_not_to(monkeypatch):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    name = "_reassign_or_swap_out_partitioned_parameters"
    monkeypatch.setattr(Stage3, name, Stage3.__dict__[name])          # restored after the test
    monkeypatch.setenv(offload_copy.CHOICE, "deepspeed")
    assert offload_copy.install() is False and getattr(Stage3, name) is not \
        offload_copy._reassign_or_swap_out_partitioned_parameters
    monkeypatch.delenv(offload_copy.CHOICE)
    assert offload_copy.install() is True and offload_copy.install() is True
    assert getattr(Stage3, name) is offload_copy._reassign_or_swap_out_partitioned_parameters


def test_a_bad_choice_stops_the_run_before_any_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(offload_copy.CHOICE, "fast")
    result = run_labs("train", "--preset", "tiny", "--config", ROOT / "ds_configs/zero3_offload_optimizer.json",
                      "--steps", 2, "--out", tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "unknown LABS_OFFLOAD_COPY 'fast'; choose one of: gpu, gpu-wait, deepspeed" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_zero3_offload_run_trains_the_same_with_either_copy(tmp_path, monkeypatch):
    """The tiny model under ZeRO-3 with the optimizer offloaded, 1 rank, 4 steps: labs' copy (the default) and
    DeepSpeed's give the same loss at every step, to the bit, and the run folder records which one ran."""
    losses = {}
    for name, choice in (("labs", None), ("deepspeed", "deepspeed")):
        monkeypatch.delenv(offload_copy.CHOICE, raising=False)
        if choice:
            monkeypatch.setenv(offload_copy.CHOICE, choice)
        result = run_labs("train", "--preset", "tiny", "--config", ROOT / "ds_configs/zero3_offload_optimizer.json",
                          "--nproc", 1, "--steps", 4, "--lr", 1e-3, "--out", tmp_path / name, "--quiet", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        recorded = json.loads((tmp_path / name / "environment.json").read_text())
        assert recorded[offload_copy.CHOICE] == choice and recorded["offload_copy"] == (choice or "gpu")
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in metrics]
    assert losses["labs"] == losses["deepspeed"] and losses["labs"][-1] < losses["labs"][0], losses

"""labs.memory proven against the ZeRO paper's Table 1 and DeepSpeed's own estimators; the CLI's contract."""
import dataclasses
import json
from decimal import ROUND_HALF_UP, Decimal

import pytest

from conftest import ROOT, run_labs
from labs import CONFIGS, config, memory, models, resolve
from labs.bench import offload_plan
from labs.memory import accounting
from labs.memory.accounting import PAPER_TABLE1, PAPER_TABLE1_ND

# Rajbhandari et al. 2019 (arXiv:1910.02054), Table 1, as printed (labs.memory.accounting keeps the published values)
ND, TABLE1 = PAPER_TABLE1_ND, PAPER_TABLE1


def _paper_gb(psi, stage, nd):
    return memory.estimate(params=psi, stage=stage, gpus_per_node=nd).paper_model_states_per_gpu_bytes / 1e9


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_paper_table1_7p5b_every_stage_and_dp_degree(stage):
    """The 7.5B column is rounded half-up to the digits printed (41.25 -> 41.3, 30.35 -> 30.4, 1.875 -> 1.88)."""
    for nd, printed in zip(ND, TABLE1[7.5e9][stage]):
        ours = Decimal(repr(_paper_gb(7.5e9, stage, nd)))
        digits = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent)
        assert ours.quantize(digits, rounding=ROUND_HALF_UP) == Decimal(printed), (stage, nd, ours, printed)


@pytest.mark.parametrize("psi", [128e9, 1e12])
def test_paper_table1_larger_models_are_truncated_not_rounded(psi):
    """The 128B and 1T columns print integers cut, not rounded: 257.75 -> 257, 4046.9 -> 4046."""
    for stage in (1, 2, 3):
        for nd, printed in zip(ND, TABLE1[psi][stage]):
            ours = Decimal(repr(_paper_gb(psi, stage, nd)))
            digits = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent)
            assert ours.quantize(digits, rounding="ROUND_DOWN") == Decimal(printed), (psi, stage, nd, ours)


def test_chapter_1s_table_puts_the_printed_values_beside_the_estimates(monkeypatch):
    """The rows chapter 1 shows: the estimate's paper accounting beside Table 1's printed 7.5B values, each equal to
    ours rounded as the paper prints it (half up, to its last digit). A misprint half a unit off does not agree: ours,
    1.875 at N_d = 64 for P_os+g+p, prints 1.88, not 1.87."""
    rows = accounting.paper_table1_rows()
    assert [r["N_d"] for r in rows] == list(ND)
    for row in rows:
        for stage, name in ((1, "P_os"), (2, "P_os+g"), (3, "P_os+g+p")):
            assert row[name] == pytest.approx(_paper_gb(7.5e9, stage, row["N_d"])) and row[f"{name} agrees"]
            assert row[f"{name} paper"] == TABLE1[7.5e9][stage][ND.index(row["N_d"])]
    misprint = {**TABLE1, 7.5e9: {**TABLE1[7.5e9], 3: ("120", "30", "7.5", "1.87", "0.47", "0.12")}}
    monkeypatch.setattr(accounting, "PAPER_TABLE1", misprint)
    at_64 = next(r for r in accounting.paper_table1_rows() if r["N_d"] == 64)
    assert at_64["P_os+g+p"] == 1.875 and not at_64["P_os+g+p agrees"] and at_64["P_os+g agrees"]


def test_paper_baseline_is_16_bytes_per_parameter_at_any_dp_degree():
    for nd in ND:
        assert _paper_gb(7.5e9, 0, nd) == 120


def _deepspeed():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


CASES = [dict(preset="tiny"), dict(preset="qwen-7b"), dict(preset="qwen2.5-7b"),
         dict(params=7.5e9, largest_layer=545_000_000), dict(params=1.3e9, largest_layer=100_000_000)]


@pytest.mark.parametrize("model", CASES, ids=lambda m: m.get("preset") or f"{m['params']:.2g}")
def test_model_states_equal_deepspeeds_own_estimators(model):
    zero2, zero3 = _deepspeed()
    params = memory.estimate(**model).params
    largest = model.get("largest_layer") or memory.layout.largest_layer_params(models.shape(model["preset"]))
    for gpus, nodes in ((1, 1), (2, 1), (8, 1), (8, 4), (4, 16)):
        for offload in (False, True):
            est = memory.estimate(**model, stage=2, gpus_per_node=gpus, nodes=nodes,
                                  offload_optimizer="cpu" if offload else None)
            cpu, gpu = zero2(params, gpus, nodes, cpu_offload=offload)
            assert (est.model_states_per_gpu_bytes, est.deepspeed_estimator["cpu"]) == (gpu, cpu), (gpus, nodes)
            for offload_param in (False, True) if offload else (False,):
                est = memory.estimate(**model, stage=3, gpus_per_node=gpus, nodes=nodes,
                                      offload_optimizer="cpu" if offload else None,
                                      offload_param="cpu" if offload_param else None)
                cpu, gpu, _ = zero3(params, largest, gpus, nodes, cpu_offload=offload, cpu_offload_params=offload_param)
                assert (est.model_states_per_gpu_bytes, est.deepspeed_estimator["cpu"]) == (gpu, cpu), \
                    (gpus, nodes, offload, offload_param)


def test_deepspeed_adds_fp32_gradients_and_the_largest_layer_to_the_paper():
    """Where the two accountings differ: 18 vs 14 bytes per partitioned parameter at ZeRO-2 (the fp32 copy of
    the gradient partition), and at ZeRO-3 18 vs 16 plus 4 bytes per parameter of the largest layer."""
    psi, n = 7.5e9, 64
    zero2 = memory.estimate(params=psi, stage=2, gpus_per_node=n)
    assert zero2.model_states_per_gpu_bytes - zero2.paper_model_states_per_gpu_bytes == pytest.approx(4 * psi / n, 1e-9)
    zero3 = memory.estimate(params=psi, stage=3, gpus_per_node=n, largest_layer=10 ** 9)
    assert zero3.model_states_per_gpu_bytes - zero3.paper_model_states_per_gpu_bytes == \
        pytest.approx(2 * psi / n + 4e9, 1e-9)


def test_parameter_layout_matches_the_real_model():
    """labs.layout lists the HF model's parameters in DeepSpeed's order, with the right sizes."""
    import torch
    from transformers import AutoModelForCausalLM

    for preset in ("tiny", "qwen2.5-7b"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(models.qwen2_config(preset))
        real = [(n, p.numel()) for n, p in model.named_parameters()]
        assert memory.layout.param_layout(models.shape(preset)) == real
        assert max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) == \
            memory.layout.largest_layer_params(models.shape(preset))


def test_peak_parts_add_up_and_more_gpus_never_need_more_memory():
    for stage in (0, 1, 2, 3):
        totals = []
        for gpus in (1, 2, 4, 8):
            est = memory.estimate("qwen2.5-7b", stage=stage, gpus_per_node=gpus, micro_batch=2)
            parts = (est.params_per_gpu_bytes, est.grads_per_gpu_bytes, est.optimizer_per_gpu_bytes,
                     est.activations_per_gpu_bytes, est.buffers_per_gpu_bytes)
            assert sum(parts) == est.total_per_gpu_bytes == est.phases[est.peak_phase]["total"]
            totals.append(est.total_per_gpu_bytes)
        assert totals == sorted(totals, reverse=True), (stage, totals)


def test_checkpointing_and_fused_loss_shrink_activations():
    est = {ck: memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8, micro_batch=2, activation_checkpointing=ck)
           for ck in ("none", 14, "full")}
    assert est["none"].total_per_gpu_bytes > est[14].total_per_gpu_bytes > est["full"].total_per_gpu_bytes
    hf = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8, micro_batch=2, activation_checkpointing="full")
    liger = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8, micro_batch=2, activation_checkpointing="full",
                            loss="liger")
    # the stock loss's three fp32 [8192, 152064] tensors: 14.9 GB, gone with the fused loss
    assert hf.breakdown["loss"]["fp32 log-softmax output + its grad + grad of logits"] == 12 * 8192 * 152064
    assert hf.total_per_gpu_bytes - liger.total_per_gpu_bytes > 10e9


def test_offload_moves_states_to_the_host():
    on_gpu = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=4, micro_batch=1)
    offloaded = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=4, micro_batch=1, offload_optimizer="cpu",
                                offload_param="cpu")
    assert on_gpu.host_per_node_bytes == 0 and offloaded.optimizer_per_gpu_bytes == 0
    # per rank: 4 master + 8 Adam + 4 fp32 grads + 2 bf16 grads + 2 bf16 params per partitioned parameter
    assert offloaded.host_per_node_bytes == pytest.approx(20 * on_gpu.params, rel=0.01)


def test_advice_finds_the_cheapest_change_that_fits():
    advice = memory.advise("A100-40GB", preset="qwen2.5-7b", stage=2, gpus_per_node=8, micro_batch=2)
    assert not advice.fits_as_is and advice.suggestion is not None
    assert advice.suggestion.fits(memory.gpu_bytes("A100-40GB"))
    assert all(o["slowdown"] >= advice.slowdown for o in advice.options)
    assert "cheapest change that fits" in str(advice)
    assert memory.advise("24GiB", **memory.estimate("tiny", stage=3, gpus_per_node=2).inputs).fits_as_is


def test_advice_of_equal_cost_changes_no_more_than_it_needs():
    """Moving from ZeRO-1 to ZeRO-2 and the fused loss are both free by the rules; the loss alone fits, so the
    advice must not add the stage."""
    advice = memory.advise("H100", preset="qwen2.5-7b", stage=1, gpus_per_node=8, offload_optimizer="cpu")
    tied = [o for o in advice.options if round(o["slowdown"], 6) == round(advice.slowdown, 6)]
    assert len(tied) > 1 and advice.change == min((o["change"] for o in tied), key=len) == {"loss": "liger"}


# The reader's case: every training moment fits a 24 GB card, only ZeRO-2's start-up flatten (the model copied into one
# flat buffer beside the original tensors) does not; it is larger than the whole card, so DeepSpeed makes it on the CPU.
ON_64_4090S = dict(preset="qwen2.5-7b", stage=2, gpus_per_node=8, nodes=8, activation_checkpointing="full",
                   loss="liger")


def test_a_start_up_flatten_larger_than_the_card_decides_no_fit():
    """DeepSpeed 0.19.8's ZeRO-1/2 optimizer flattens on the GPU when `available_memory()` holds the flat buffer;
    without pynvml that is the card's total less what is allocated (the parameters), so it falls back to the CPU
    (stage_1_and_2.py, `flatten_on_accelerator`) when parameters and copy exceed the card's total: the GPU then holds
    the flat buffer alone, which every later moment holds too, and the host holds each rank's weights twice."""
    est = memory.estimate(**ON_64_4090S)
    card, usable = memory.gpu_bytes("RTX4090"), memory.usable_bytes("RTX4090")
    init = est.phases["init"]["total"]
    assert est.peak_phase == "init" and est.init_falls_back and init > card
    assert est.fit_phase_on(card) == "layer_backward"
    assert est.fit_bytes_on(card) == max(p["total"] for name, p in est.phases.items() if name != "init") < usable
    assert est.total_per_gpu_bytes > usable                    # the peak itself is unchanged
    assert est.phases["init"]["params"] <= est.fit_bytes_on(card)     # what the fallback leaves: the flat buffer alone
    assert est.fits(card) and any("start-up flatten" in note for note in est.notes)
    host = est.start_up_host_per_node_bytes_on(card)
    assert host == 8 * init and init == pytest.approx(2 * 2 * est.params, rel=1e-3)   # bf16 weights twice, 8 ranks
    advice = memory.advise(card, **ON_64_4090S)
    verdict = advice.as_dict()
    assert advice.fits_as_is and advice.change == {} and verdict["fit_bytes"] == est.fit_bytes_on(card)
    assert verdict["peak_bytes"] == est.total_per_gpu_bytes and verdict["start_up_host_per_node_bytes"] == host
    assert str(advice) == (f"fits: {est.fit_bytes_on(card) / 2**30:.1f} GiB at layer_backward of {usable / 2**30:.1f} "
                           f"GiB usable; its start-up flatten ({init / 2**30:.1f} GiB, more than the card's "
                           f"{card / 2**30:.1f} GiB) is made on the CPU, with {host / 2**30:.1f} GiB of host memory "
                           "per node of 8 GPUs at start-up")
    # ZeRO-1 holds every gradient at the end of backward, more than the card: moving to ZeRO-2 is the free fix
    zero1 = memory.advise(card, **{**ON_64_4090S, "stage": 1})
    assert not zero1.fits_as_is and zero1.change == {"stage": 2}
    assert zero1.as_dict()["suggested_fit_bytes"] == est.fit_bytes_on(card) < zero1.as_dict()["suggested_peak_bytes"]
    assert zero1.as_dict()["suggested_start_up_host_per_node_bytes"] == host
    assert str(zero1).endswith("of host memory per node of 8 GPUs at start-up")
    # a card with room for the copy: the flatten runs on the GPU, is the peak, and fits
    room = memory.usable_bytes("A100-40GB") / 2**30
    assert str(memory.advise("A100-40GB", **ON_64_4090S)) == \
        f"fits: peak {est.total_per_gpu_bytes / 2**30:.1f} GiB of {room:.1f} GiB usable"
    assert est.start_up_host_per_node_bytes_on("A100-40GB") == 0


# The review's case: the 3B's start-up flatten (11.5 GiB) is over a 12 GiB card's usable memory but within its total.
SMALL_CARD_3B = dict(preset="qwen2.5-3b", stage=2, gpus_per_node=8, nodes=8, micro_batch=1, seq_len=2048,
                     activation_checkpointing="full", loss="liger")


def test_a_start_up_flatten_within_the_cards_total_counts_against_usable_memory():
    """Between the usable memory and the card's total, DeepSpeed (without pynvml, not in labs' requirements) sees
    room for the copy, flattens on the GPU, where it may run out: the flatten counts like every moment there. Above
    the card's total it falls back to the CPU, with or without pynvml, and the fit weighs the largest other moment."""
    est = memory.estimate(**SMALL_CARD_3B)
    init, rest = est.phases["init"]["total"], max(p["total"] for name, p in est.phases.items() if name != "init")
    within = memory.parse_bytes("12GiB")                 # usable < init <= total
    assert est.peak_phase == "init" and memory.usable_bytes(within) < init <= within
    assert est.fit_phase_on(within) == "init" and est.fit_bytes_on(within) == init and not est.fits(within)
    assert est.start_up_host_per_node_bytes_on(within) == 0
    advice = memory.advise(within, **SMALL_CARD_3B)
    assert not advice.fits_as_is and advice.change == {"stage": 3}
    assert str(advice).startswith(f"does not fit: peak {init / 2**30:.1f} GiB > ")
    above = init - 1                                     # a card one byte smaller than the copy: it falls back
    assert est.fit_phase_on(above) != "init" and est.fit_bytes_on(above) == rest and est.fits(above)
    assert est.start_up_host_per_node_bytes_on(above) == 8 * init
    assert memory.advise(above, **SMALL_CARD_3B).fits_as_is


def test_under_a_cap_the_flatten_falls_back_by_the_whole_cards_memory():
    """--gpu-memory caps PyTorch's share of a larger card, but DeepSpeed's available_memory() reads the whole card:
    there the start-up flatten is made on the GPU, inside the cap, and counts against it."""
    est = memory.estimate(**SMALL_CARD_3B)
    cap = memory.parse_bytes("10GiB")                    # smaller than the flatten: alone, it would fall back
    assert est.phases["init"]["total"] > cap and est.fit_phase_on(cap) != "init"
    whole = memory.gpu_bytes("H100")
    assert est.fit_phase_on(cap, total=whole) == "init" and est.start_up_host_per_node_bytes_on(cap, whole) == 0


@pytest.mark.parametrize("stage, precision, data_types, offload, engine, falls_back", [
    (1, "bf16", None, None, "deepspeed", True),
    (2, "fp32", None, None, "deepspeed", True),
    (0, "bf16", None, None, "deepspeed", False),          # FP16_Optimizer (bf16 too) clones and flattens on the GPU
    (3, "bf16", None, None, "deepspeed", False),          # ZeRO-3 makes no whole flat copy
    (1, "bf16", {"grad_accum_dtype": "fp32"}, None, "deepspeed", False),   # ZeRO-1's BF16_Optimizer: no check either
    (1, "bf16", {"grad_accum_dtype": "fp32"}, "cpu", "deepspeed", True),   # offloaded: DeepSpeedZeroOptimizer again
    (1, "bf16", {"grad_accum_dtype": "fp32"}, "nvme", "deepspeed", False),  # zero_cpu_offload() is cpu only
    (2, "bf16", {"grad_accum_dtype": "fp32"}, None, "deepspeed", True),
    (2, "bf16", None, None, "fsdp2", False),
])
def test_only_zero1_and_2s_optimizer_flattens_on_the_cpu_when_short(stage, precision, data_types, offload, engine,
                                                                     falls_back):
    assert memory.fit.init_falls_back(stage, precision, offload, data_types, engine) is falls_back


def test_the_fallback_follows_the_estimates_offload_not_its_config_files():
    """advise() varies offload_optimizer over the same config: ZeRO-1 with fp32 accumulation picks BF16_Optimizer
    (no fallback) unless the estimate offloads, whatever the file says."""
    fp32_accumulation = config.variant(resolve.default_config(1), {"data_types": {"grad_accum_dtype": "fp32"}})
    offloaded_file = config.variant(fp32_accumulation, {"zero_optimization.offload_optimizer": {"device": "cpu"}})
    setting = dict(preset="qwen2.5-3b", gpus_per_node=8)
    assert not memory.estimate(**setting, ds_config=fp32_accumulation).init_falls_back
    assert memory.estimate(**setting, ds_config=fp32_accumulation, offload_optimizer="cpu").init_falls_back
    assert memory.estimate(**setting, ds_config=offloaded_file).init_falls_back
    assert not memory.estimate(**setting, ds_config=offloaded_file, offload_optimizer="none").init_falls_back


def test_zero0s_start_up_copy_counts_in_its_fit():
    """ZeRO-0 has no fallback: where its start-up copies were the peak and larger than the card, they would still be
    what the fit weighs. Its real start-up is below its optimizer step, so the case is built from a real estimate
    with the init moment made the largest; the same estimate marked as falling back weighs the next moment."""
    real = memory.estimate("qwen2.5-7b", stage=0, gpus_per_node=8)
    assert not real.init_falls_back and real.fits(memory.gpu_bytes("H200")) == (
        real.total_per_gpu_bytes <= memory.usable_bytes("H200"))
    phases = {name: dict(p) for name, p in real.phases.items()}
    phases["init"]["total"] = real.total_per_gpu_bytes + 2**30
    start_up_peak = dataclasses.replace(real, phases=phases, peak_phase="init",
                                        total_per_gpu_bytes=phases["init"]["total"])
    card = phases["init"]["total"] - 1                   # smaller than the copy, room for every other moment
    assert start_up_peak.fit_phase_on(card) == "init" and not start_up_peak.fits(card)
    assert start_up_peak.start_up_host_per_node_bytes_on(card) == 0
    falls_back = dataclasses.replace(start_up_peak, init_falls_back=True)
    assert falls_back.fit_phase_on(card) == real.peak_phase
    assert falls_back.fit_bytes_on(card) == real.total_per_gpu_bytes


def test_accumulation_keeps_zero2_gradients_through_the_next_loss():
    """ZeRO-2's gradient partition lives from the first backward to the step: with accumulation it is on the GPU
    when a later micro-batch's stock loss peaks. Measured: one H200, Qwen2.5-3B, micro-batch 2 x 4 (run x)."""
    from labs.bench import results

    single = memory.estimate("qwen2.5-3b", stage=2, micro_batch=2, grad_accum=1, loss="hf")
    accumulating = memory.estimate("qwen2.5-3b", stage=2, micro_batch=2, grad_accum=4, loss="hf")
    assert single.phases["loss_backward"]["grads"] == 0
    assert accumulating.phases["loss_backward"]["grads"] == 2 * accumulating.params     # bf16, one rank holds all
    assert accumulating.peak_phase == "loss_backward"
    rows = [r for r in results.peak_comparisons(merge_repeats=True)
            if r["case"] == "stock-zero2-cknone-mb2-ga4" and r["gpus"] == 1]
    assert rows and all(abs(r["ratio"] - 1) < 0.01 for r in rows), rows


@pytest.mark.parametrize("stage, overlap", [(1, False), (1, True), (2, False), (2, True)])
def test_what_a_real_engine_keeps_between_micro_batches_is_what_labs_memory_counts(stage, overlap, monkeypatch):
    """A DeepSpeed engine on this CPU, accumulating over 2 micro-batches: the gradient bytes it holds when the second
    micro-batch starts (ZeRO-2: the bf16 partition; ZeRO-1: every p.grad plus the reduce buckets its hooks set up)
    are what labs.memory puts at the loss moment of a later micro-batch, and nothing is held at accumulation 1."""
    import single_process_group
    import torch

    from labs.instruments.state import engine_state_bytes

    single_process_group.ensure()
    monkeypatch.setenv("LOCAL_RANK", "0")
    import deepspeed

    held = {}
    for accumulation in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(3)])
        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
                     "train_batch_size": accumulation, "bf16": {"enabled": True}, "steps_per_print": 10**9,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                     "zero_optimization": {"stage": stage, "overlap_comm": overlap, "contiguous_gradients": True,
                                           "reduce_bucket_size": 100_000}}
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        engine.backward(engine(torch.randn(2, 128, dtype=torch.bfloat16)).float().pow(2).mean())
        engine.step()                        # at accumulation 2 not yet an optimizer step
        state = engine_state_bytes(engine)
        # once a step has run, DeepSpeed keeps its gradient norm: one fp32 scalar, not gradients
        norm = sum(r["bytes"] for r in state["largest"] if r["what"] == "_global_grad_norm")
        held[accumulation] = state["grads_bytes"] - norm
        params = sum(p.numel() for p in model.parameters())
        loss = memory.estimate(params=params, ds_config=ds_config).phases["loss_backward"]
        assert held[accumulation] == loss["grads"] + loss["buffers"], (accumulation, held, loss)
    assert held[1] == 0 < held[2]


def test_fsdp2_advice_keeps_the_engine_and_its_offload(capsys):
    """FSDP2 has no stage to raise and offloads through its own config block: the advice may change the loss and
    checkpointing only, and `labs memory --engine fsdp2 --gpu-memory` prints it (it once raised a TypeError)."""
    from labs import cli

    est = memory.estimate("qwen2.5-3b", engine="fsdp2", micro_batch=4, loss="hf")
    assert est.breakdown["fsdp"]["offload"] == "none"
    advice = memory.advise("H200", **est.inputs)
    assert not advice.fits_as_is and advice.options
    assert all(set(o["change"]) <= {"loss", "activation_checkpointing"} for o in advice.options)
    assert all(o["estimate"].inputs["engine"] == "fsdp2" for o in advice.options)
    assert cli.main(["memory", "--preset", "qwen2.5-3b", "--engine", "fsdp2", "--micro-batch", "4",
                     "--gpu-memory", "H200"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2, 1 GPU(s)" in out and "cheapest change that fits: loss=liger" in out


def test_bad_inputs_raise_labs_errors():
    from labs.errors import LabsError

    for kwargs in (dict(preset="giant"), dict(), dict(params=7e9, stage=4), dict(params=7e9, gpus_per_node=0),
                   dict(preset="tiny", activation_checkpointing="half"), dict(params=7e9, stage=2, offload_param="cpu"),
                   dict(params=7e9, loss="fast"), dict(params=7e9, optimizer="adamax")):
        with pytest.raises(LabsError):
            memory.estimate(**kwargs)
    with pytest.raises(LabsError):
        memory.parse_bytes("80XB")
    for tiny in ("80", "80b", "1e3"):                   # 80 bytes is never what a user meant
        with pytest.raises(LabsError, match=f"memory size '{tiny}' is .* bytes, less than any memory: write e.g."):
            memory.parse_bytes(tiny)
    for malformed in ("1.2.3", ".", "e9"):
        with pytest.raises(LabsError, match="write e.g. 80GiB"):
            memory.parse_bytes(malformed)
    assert memory.parse_bytes("24e9") == 24 * 10 ** 9 and memory.parse_bytes(".5GiB") == 2 ** 29
    assert memory.parse_bytes("80GiB") == 80 * 2 ** 30 and memory.parse_bytes("141 GB") == 141 * 10 ** 9


def test_cli_json():
    result = run_labs("memory", "--preset", "qwen2.5-7b", "--stage", "3", "--gpus", "2", "--json",
                      "--gpu-memory", "80GiB")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    expected = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=2)
    for key in ("model_states_per_gpu_bytes", "paper_model_states_per_gpu_bytes", "activations_per_gpu_bytes",
                "total_per_gpu_bytes", "host_per_node_bytes"):
        assert out[key] == getattr(expected, key), key
    assert out["fits"] is False and "cheapest change" in out["verdict"]["verdict"]
    table = run_labs("memory", "--params", "7.5e9", "--stage", "2", "--gpus", "64")
    assert table.returncode == 0 and "paper model states / GPU" in table.stdout and "(16.64 GB)" in table.stdout


@pytest.mark.parametrize("args,message", [
    (("--preset", "tiny", "--stage", "7"), "invalid choice: 7"),
    (("--preset", "tiny", "--micro-batch", "0"), "--micro-batch: must be at least 1, not 0"),
    (("--preset", "tiny", "--grad-accum", "0"), "--grad-accum: must be at least 1, not 0"),
    (("--params", "nan"), "params must be a positive, finite number"),
    (("--params", "lots"), "params 'lots' is not a number"),
    (("--preset", "tiny", "--gpu-memory", "80"), "--gpu-memory: memory size '80' is 80 bytes, less than any memory"),
    (("--preset", "tiny", "--params", "7e9"), "exactly one of --preset"),
    (("--preset", "tiny", "--gpu-memory", "80XB"), "memory size '80XB'"),
    (("--preset", "tiny", "--offload-optimizer", "disk"), "unknown offload_optimizer device 'disk'"),
])
def test_cli_bad_input_is_one_line_exit_2(args, message, capsys):
    from labs import cli

    code = cli.main(["memory", *args])        # what the `labs` entry point runs (in-process: no torch start-up)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("labs: error: ") and message in lines[0], captured.err
    assert captured.out == ""


def test_offloaded_optimizer_host_bytes_follow_deepspeeds_allocations():
    """Per partitioned parameter on the host: fp32 master 4 + Adam 8 + fp32 gradient 4 + a bf16 partition 2 (ZeRO-1/2:
    the updated weights on their way back; ZeRO-3: the gradient partition) = 18 at every stage; ZeRO-1/2 also stage
    each gradient through a host buffer and a GPU buffer of the largest parameter, per rank."""
    for stage in (1, 2, 3):
        est = memory.estimate(params=1e9, stage=stage, gpus_per_node=4, offload_optimizer="cpu")
        assert est.host_per_node_bytes == pytest.approx(18e9, rel=1e-6), stage
    largest = max(n for _, n in memory.layout.param_layout(models.shape("qwen2.5-7b")))
    gpus = 8
    zero2 = memory.estimate("qwen2.5-7b", stage=2, gpus_per_node=gpus, offload_optimizer="cpu")
    assert zero2.host_per_node_bytes == pytest.approx(18 * zero2.params + gpus * 2 * largest, rel=1e-6)
    assert all(zero2.phases[p]["buffers"] >= 2 * largest for p in ("loss_backward", "optimizer_step"))


def test_nvme_offload_swaps_the_optimizer_side_to_the_drive():
    """ZeRO-Infinity swaps the fp32 master, Adam's moments and the fp32 gradients (16 bytes per parameter) and, with
    offload_param, the bf16 parameters (2) to NVMe. The host keeps the bf16 gradient partition (2), one sub-group's
    fp32 gradient buffer and 4 swap buffers of a sub-group (1e9 elements each), and 5 parameter swap buffers of 1e8."""
    from labs.errors import LabsError

    psi = 70e9
    est = memory.estimate(params=psi, stage=3, gpus_per_node=1, offload_optimizer="nvme", offload_param="nvme")
    assert est.nvme_per_node_bytes == 18 * psi
    assert est.host_per_node_bytes == 2 * psi + 5 * 4 * 1e9 + 5 * 2 * 1e8
    with pytest.raises(LabsError, match="needs ZeRO stage 3"):
        memory.estimate(params=7e9, stage=2, offload_optimizer="nvme")


def test_partial_offload_keeps_the_first_sub_groups_on_the_gpu():
    """offload_optimizer.ratio 0.5 (ZeRO-3): DeepSpeed steps sub-groups 0 .. int(0.5 x count) - 1 on the GPU, so
    their fp32 master and Adam moments (12 bytes per element) leave the host for the GPU, and their fp32 gradient
    (4) too (the run's state_bytes instrument saw it on cuda); GPU round 5 measured 23.0 GiB more than full offload
    for the 3B case (results/gpu/2026-12-02_p_*), 16 bytes x the 1.54e9 elements of the GPU's sub-groups."""

    from labs import CONFIGS
    # host bytes at their own size: which sub-groups move is the question here, not PyTorch's pinning (tested below)
    full, half = (memory.estimate("qwen2.5-3b", stage=3, gpus_per_node=1, micro_batch=8, seq_len=4096,
                                  ds_config=json.loads((CONFIGS / "bench" / name).read_text()), host_pinning="exact")
                  for name in ("labs_zero3_offload.json", "labs_zero3_offload_half.json"))
    knobs = resolve.zero_knobs(json.loads((CONFIGS / "bench" / "labs_zero3_offload.json").read_text()))
    groups = memory.layout.zero3_partition(memory.layout.param_layout(models.shape("qwen2.5-3b")), 1,
                                           knobs["stage3_param_persistence_threshold"], knobs["sub_group_size"])
    kept = sum(groups["sub_groups"][:len(groups["sub_groups"]) // 2])
    assert (len(groups["sub_groups"]), round(kept / 1e7), round(groups["partition"] / 1e7)) == (7, 154, 309)  # 09.6
    assert 0.4 < kept / groups["partition"] < 0.6             # whole sub-groups: about half, rarely exactly
    assert full.host_per_node_bytes - half.host_per_node_bytes == pytest.approx(16 * kept, rel=1e-9)
    assert half.phases["optimizer_step"]["optimizer"] - full.phases["optimizer_step"]["optimizer"] == \
        pytest.approx(12 * kept, rel=1e-9)
    assert half.phases["layer_backward"]["grads"] - full.phases["layer_backward"]["grads"] == \
        pytest.approx(4 * kept, rel=1e-9)                     # their fp32 gradients: on the GPU too


def test_pinned_host_buffers_take_a_power_of_two_each_on_a_gpu():
    """The one GPU record of an offloaded optimizer's host memory (results/gpu/zenflow_1xh200/off20b: the 3B shape,
    ZeRO-2 offload, one H200, tools/host_memory.sh each second): the training rank's shared memory, which holds what
    DeepSpeed page-locked, is the four pinned buffers each rounded up to a power of two by PyTorch's pinned
    allocator (fp32 master 11.5 -> 16 GiB, fp32 gradient 11.5 -> 16, bf16 partition 5.7 -> 8, staging 0.6 -> 1);
    its private memory is the Adam states, 8 bytes per parameter, plus the process itself. Without the rounding the
    model misses 13 GiB of 65.5."""
    from labs import RESULTS
    from labs.course import host_samples

    assert memory.units.torch_pinned_bytes(11.5 * 2**30) == 16 * 2**30
    assert memory.units.torch_pinned_bytes(2**30) == 2**30 and memory.units.torch_pinned_bytes(0) == 0
    off20b = RESULTS / "gpu" / "zenflow_1xh200" / "off20b"
    record = host_samples.read(off20b, free_txt=off20b.parent / "round10_free.txt")["at_tightest"]
    shared, private = record[("training rank", "RssShmem")], record[("training rank", "RssAnon")]
    config = json.loads((off20b / "ds_config.json").read_text())
    kwargs = dict(ds_config=config, gpus_per_node=1, seq_len=4096, loss="liger", kernels="liger")
    torch_pinned = memory.estimate("qwen2.5-3b", **kwargs)
    exact = memory.estimate("qwen2.5-3b", **kwargs, host_pinning="exact")
    states = 8 * torch_pinned.params / 2**30
    assert shared == pytest.approx(torch_pinned.host_per_node_bytes / 2**30 - states, abs=0.1)
    assert 0.97 < torch_pinned.host_per_node_bytes / 2**30 / (shared + private) < 1.0
    assert exact.host_per_node_bytes / 2**30 / (shared + private) < 0.81
    # the same run with DeepSpeed's native backend (round 11): page-locked at their own sizes, as private memory
    native = host_samples.read(RESULTS / "gpu" / "pinned_host_1xh200" / "native4")["at_tightest"]
    held = sum(gib for (role, _), gib in native.items() if role == "training rank")
    assert native[("training rank", "RssShmem")] < 0.1
    assert 0.97 < exact.host_per_node_bytes / 2**30 / held < 1.0


def test_from_run_follows_the_pinning_backend_the_run_recorded(tmp_path):
    """A run folder records DS_PIN_MEMORY_BACKEND (environment.json); from_run then estimates the host as the run
    pinned it: rounded on a GPU under PyTorch's allocator, exact under DeepSpeed's native one or on a CPU."""
    from labs import RESULTS
    from labs.runfolder import Run

    record = RESULTS / "gpu" / "zenflow_1xh200" / "off20b"          # a GPU run, offload with pin_memory: true
    run = tmp_path / "off20b"
    run.mkdir()
    for name in ("run.json", "ds_config.json", "summary.json"):
        (run / name).write_text((record / name).read_text())
    hosts = {}
    for backend in (None, "native", "torch"):
        (run / "environment.json").write_text(json.dumps({"DS_PIN_MEMORY_BACKEND": backend}))
        hosts[backend] = memory.from_run(Run(run)).host_per_node_bytes
    assert hosts[None] == hosts["torch"] > hosts["native"]
    assert Run(tmp_path / "no-such-run").environment == {}
    assert [memory.host_pinning_of(gpu, b) for gpu, b in ((True, None), (True, " Native"), (False, None))] == \
        ["torch", "exact", "exact"]


def test_zenflow_overlap_host_model_against_both_h200_records():
    """labs.memory.host (ZenFlow) against the two recorded overlapped runs (the 3B on one H200, results/gpu/zenflow_1xh200;
    round 10 before labs' copy back, round 12 with it): the four shared fp32 buffers are the optimizer process's
    shared memory, its moments are its private memory, each 16 bytes per parameter; the rest of the model (the shared
    buffers, the pinned slice and staging buffer, and the gradients kept between updates, which ZenFlow accumulates
    on the host as gradient accumulation does) is the training rank's shared memory, to 0.2 GiB. The processes' own
    private memory comes on top (round 10's larger: DeepSpeed's copy back allocated a pageable bf16 copy each
    update). ZenFlow without the overlap: plain offload's host figure plus the same accumulation buffers, none at
    update_interval 1."""
    from labs import RESULTS
    from labs.course import host_samples

    folder = RESULTS / "gpu" / "zenflow_1xh200"
    optimizer, trainer = "ZenFlow's optimizer process", "training rank"
    for name, free in (("zf_overlap20", "round10_free.txt"), ("zf_fast20", "round12_free.txt")):
        est = memory.from_run(folder / name, zenflow_moments="deepspeed")       # both ran before labs.zenflow_moments
        held = host_samples.read(folder / name, free_txt=folder / free)["at_tightest"]
        slice_gib = est.params / 2**30                    # one rank: its slice is the whole model (padded by <2)
        assert held[(optimizer, "RssShmem")] == pytest.approx(16 * slice_gib, abs=0.1), name
        assert held[(optimizer, "RssAnon")] == pytest.approx(16 * slice_gib, abs=0.5), name
        in_trainers_shared = est.host_per_node_bytes / 2**30 - 16 * slice_gib    # all but the moments
        assert held[(trainer, "RssShmem")] == pytest.approx(in_trainers_shared, abs=0.2), name
        assert any("kept between updates" in note for note in est.notes)
    sync = json.loads((folder / "zf_sync20b" / "ds_config.json").read_text())
    plain = json.loads((folder / "off20b" / "ds_config.json").read_text())
    kwargs = dict(gpus_per_node=1, seq_len=4096, loss="liger", kernels="liger")
    host = {name: memory.estimate("qwen2.5-3b", ds_config=c, **kwargs).host_per_node_bytes
            for name, c in (("sync", sync), ("plain", plain))}
    acc4x2 = memory.estimate("qwen2.5-3b", ds_config=plain, micro_batch=4, grad_accum=2, **kwargs).host_per_node_bytes
    assert host["sync"] - host["plain"] == acc4x2 - host["plain"] > 8 * 2**30
    sync["zero_optimization"]["zenflow"]["update_interval"] = 1
    assert memory.estimate("qwen2.5-3b", ds_config=sync, **kwargs).host_per_node_bytes == host["plain"]
    # labs.zenflow_moments: one set of moments in the optimizer process, 8 bytes per parameter less than both records
    labs = memory.from_run(folder / "zf_fast20")
    assert est.host_per_node_bytes - labs.host_per_node_bytes == 8 * est.params
    assert any("one set" in note for note in labs.notes) and any("two sets" in note for note in est.notes)


def test_zero2_offload_with_accumulation_keeps_each_parameters_gradient_on_the_host():
    """ZeRO-1/2 offload under gradient accumulation (stage_1_and_2.py async_accumulate_grad_in_cpu_via_gpu): one bf16
    buffer per parameter of the rank's partition, whole, pinned one by one (each rounded up under PyTorch's
    allocator), checked on one H200 (acc4x2); none without accumulation, none at ZeRO-3. On 2 ranks a parameter that
    straddles the two slices is held by both."""
    config = json.loads((ROOT / "ds_configs" / "bench" / "labs_zero2_offload.json").read_text())
    kwargs = dict(ds_config=config, seq_len=4096, micro_batch=4, loss="liger", kernels="liger")
    numels = [n for _, n in memory.layout.param_layout(models.shape("qwen2.5-3b"))]

    def host(gpus, accumulation, pinning):
        return memory.estimate("qwen2.5-3b", gpus_per_node=gpus, grad_accum=accumulation, host_pinning=pinning,
                               **kwargs).host_per_node_bytes
    assert host(1, 2, "exact") - host(1, 1, "exact") == 2 * sum(numels)
    assert host(1, 4, "torch") - host(1, 1, "torch") == sum(memory.units.torch_pinned_bytes(2 * n) for n in numels)
    per_rank = memory.layout.zero12_params_per_rank(memory.layout.param_layout(models.shape("qwen2.5-3b")), 2)
    assert sum(len(r) for r in per_rank) == len(numels) + 1                 # one parameter straddles the slices
    assert host(2, 2, "exact") - host(2, 1, "exact") == 2 * sum(sum(r) for r in per_rank)
    # the record (results/gpu/pinned_host_1xh200/acc4x2, one H200): its shared memory is off20b's four pinned buffers
    # plus these, and in all the rank held the prediction plus the process itself, as in off20b
    from labs import RESULTS
    from labs.course import host_samples
    records = {name: host_samples.read(RESULTS / "gpu" / folder / name, free_txt=RESULTS / "gpu" / "zenflow_1xh200" /
                                       "round10_free.txt")["at_tightest"]
               for folder, name in (("pinned_host_1xh200", "acc4x2"), ("zenflow_1xh200", "off20b"))}
    rank = {name: {kind: gib for (role, kind), gib in r.items() if role == "training rank"} for name, r in records.items()}
    extra = rank["acc4x2"]["RssShmem"] - rank["off20b"]["RssShmem"]
    assert extra == pytest.approx((host(1, 2, "torch") - host(1, 1, "torch")) / 2**30, abs=0.1)
    assert 0.97 < host(1, 2, "torch") / 2**30 / sum(rank["acc4x2"].values()) < 1.0
    zero3 = json.loads((ROOT / "ds_configs" / "zero3_offload_optimizer.json").read_text())
    assert (memory.estimate("qwen2.5-3b", ds_config=zero3, gpus_per_node=1, grad_accum=2).host_per_node_bytes
            == memory.estimate("qwen2.5-3b", ds_config=zero3, gpus_per_node=1, grad_accum=1).host_per_node_bytes)


def test_zero3_pins_each_host_sub_groups_gradient_and_the_whole_bf16_partition():
    """ZeRO-3 with the optimizer on the host (stage3.py): the fp32 master and Adam's states are pageable; each host
    sub-group's fp32 gradient buffer is pinned on its own (1e9 elements: 4.0 GB -> 4 GiB) and the bf16 gradient
    partition once (7.6 B parameters: 14.2 GiB -> 16 GiB)."""
    config = json.loads((ROOT / "ds_configs" / "zero3_offload_optimizer.json").read_text())
    kwargs = dict(ds_config=config, gpus_per_node=1, micro_batch=1, seq_len=4096)
    pinned, exact = (memory.estimate("qwen2.5-7b", **kwargs, host_pinning=how) for how in ("torch", "exact"))
    groups = memory.layout.zero3_partition(memory.layout.param_layout(models.shape("qwen2.5-7b")), 1,
                                           pinned.breakdown["knobs"]["stage3_param_persistence_threshold"],
                                           pinned.breakdown["knobs"]["sub_group_size"])["sub_groups"]
    assert all(4e9 <= 4 * n <= 2**32 for n in groups[:-1]) and 4 * groups[-1] <= 2**32
    extra = len(groups) * 2**32 - 4 * sum(groups) + 16 * 2**30 - 2 * sum(groups)
    assert pinned.host_per_node_bytes - exact.host_per_node_bytes == pytest.approx(extra, rel=1e-9)


def test_no_recorded_offload_run_would_have_been_refused_for_host_memory():
    """labs train refuses on a GPU host an offload whose predicted host memory exceeds the host's: every offload case
    that ran in results/gpu is predicted within its machine's memory (the 7B ones ran on the 252 GiB machine)."""
    from labs.bench import results
    from labs.errors import LabsError

    checked = 0
    for name, record in results.load_all().items():
        for case in record["cases"].values():
            if case.get("status") != "ok" or "offload" not in str(case.get("options", {}).get("config", "")):
                continue
            s = case["summary"]
            checkpointing = s["activation_checkpointing"]
            try:
                est = memory.estimate(s["preset"], ds_config=case["ds_config"], gpus_per_node=s["world_size"],
                                      seq_len=s["seq_len"], micro_batch=s["micro_batch"],
                                      grad_accum=s["gradient_accumulation"], host_pinning="torch",
                                      activation_checkpointing=checkpointing if checkpointing in ("none", "full")
                                      else int(checkpointing))
            except LabsError:      # run m's ZenFlow case, with the update_interval "auto" labs now refuses
                continue
            assert est.host_per_node_bytes <= record["host"]["host_memory_gib"] * 2**30, (name, s["preset"])
            checked += 1
    assert checked >= 19, checked               # every ok offload case of results/gpu but run m's ZenFlow


def test_zero3_offload_pins_its_gradient_buffers_and_leaves_the_master_pageable():
    """ZeRO-3 optimizer offload on one H200 (results/gpu/pinned_host_1xh200/z3_offload, the 3B, PyTorch's pinning): the
    training rank's shared memory is what labs.memory pins (each host sub-group's fp32 gradient buffer and the bf16
    gradient partition, each rounded up), and its private memory holds the pageable fp32 master and Adam's moments,
    12 bytes per parameter, plus the process itself (2.5 GiB here)."""
    from labs import RESULTS
    from labs.course import host_samples

    folder = RESULTS / "gpu" / "pinned_host_1xh200" / "z3_offload"
    est = memory.from_run(folder)
    assert json.loads((folder / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    held = host_samples.read(folder, free_txt=folder / "free.txt")["at_tightest"]
    pageable_gib = 12 * est.params / 2**30
    pinned_gib = est.host_per_node_bytes / 2**30 - pageable_gib
    assert held[("training rank", "RssShmem")] == pytest.approx(pinned_gib, abs=0.1)
    assert 0 < held[("training rank", "RssAnon")] - pageable_gib < 3
    exact = memory.from_run(folder, host_pinning="exact").host_per_node_bytes / 2**30
    assert pinned_gib > exact - pageable_gib + 2          # the rounding is what the record shows, not the exact sizes


def test_advise_keeps_a_zenflow_config_off_zero3_and_the_sizing_table_names_the_fewest_layers():
    # labs.resolve refuses ZenFlow under ZeRO-3, so the advisor must not try it (it raised before)
    zenflow = config.load(CONFIGS / offload_plan.SETUPS["ZenFlow"]["config"])
    advice = memory.advise("H100", preset="qwen2.5-7b", ds_config=zenflow, micro_batch=8, grad_accum=1,
                           loss="liger", kernels="liger")
    assert advice.options and all(o["change"].get("stage", 2) <= 2 for o in advice.options)
    rows = offload_plan.rows("qwen2.5-7b", cards=("H100",))
    assert {r["setup"] for r in rows} == set(offload_plan.SETUPS)
    for r in rows:
        assert r["gpu_gib"] <= r["usable_gib"]
        micro_batch, grad_accum = (int(x) for x in r["batch"].split(" x "))
        how = offload_plan.SETUPS[r["setup"]]
        inputs = dict(micro_batch=micro_batch, grad_accum=grad_accum, loss="liger", kernels="liger",
                      host_pinning=how.get("host_pinning", "torch"))
        if r["checkpointed"]:     # one layer fewer does not fit: the fewest, not merely some
            fewer = memory.estimate("qwen2.5-7b", ds_config=offload_plan.setup_config(r["config"], r["offloaded"]),
                                    activation_checkpointing=r["checkpointed"] - 1, **inputs)
            assert fewer.total_per_gpu_bytes / 2**30 > r["usable_gib"], r
        if r["offloaded"] < 1:    # a tenth less offloaded does not fit at any checkpointing: the smallest share
            assert offload_plan.fewest_checkpointed("qwen2.5-7b", offload_plan.setup_config(
                r["config"], round(r["offloaded"] - 0.1, 1)), "H100", micro_batch, grad_accum) is None
    host = {(r["setup"], r["batch"]): r["host_gib"] for r in rows}
    # ZenFlow's host holds the four shared buffers and a set of moments above plain offload's 18 bytes per parameter;
    # pinned at their own size, plain offload's buffers take less than rounded up to powers of two
    assert host[("ZenFlow", "8 x 1")] > host[("plain offload", "8 x 1")] > host[("plain offload, native pinning", "8 x 1")]
    assert host[("ZeRO-3, part offloaded", "8 x 1")] < host[("plain offload, native pinning", "8 x 1")]


def test_cli_grad_accum_reaches_the_estimate_and_its_host_buffers(capsys):
    """Under ZeRO-2 optimizer offload, accumulation keeps each gradient on the host between micro-batches: the
    calculator has to be told the accumulation to count them (it once had no --grad-accum)."""
    from labs import cli

    host = {}
    for accumulation in (1, 4):
        assert cli.main(["memory", "--preset", "qwen2.5-3b", "--config", "bench/labs_zero2_offload.json",
                         "--micro-batch", "2", "--grad-accum", str(accumulation), "--json"]) == 0
        host[accumulation] = json.loads(capsys.readouterr().out)["host_per_node_bytes"]
        expected = memory.estimate("qwen2.5-3b", ds_config=config.load(CONFIGS / "bench/labs_zero2_offload.json"),
                                   micro_batch=2, grad_accum=accumulation)
        assert host[accumulation] == expected.host_per_node_bytes
    assert host[4] > host[1]


def test_plan_with_nothing_fitting_without_offload_names_the_offload_setups_and_the_host_each_needs(capsys):
    """`labs memory --plan` for the 7B on one 80 GB card: no GPU-resident candidate fits, so it prints what fits with
    the optimizer offloaded, checked against --host-memory (it printed an empty table before)."""
    from labs import cli

    assert cli.main(["memory", "--plan", "--preset", "qwen2.5-7b", "--gpus", "1", "--gpu-memory", "H100",
                     "--host-memory", "128GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing fits 1 x H100 without offload")
    verdicts = {line.split("  ")[0]: line.split()[-1] for line in out.splitlines()[1:] if "  8 x 1  " in line}
    expected = {r["setup"]: "yes" if r["host_gib"] <= 128 else "no"
                for r in offload_plan.rows("qwen2.5-7b", cards=("H100",)) if r["batch"] == "8 x 1"}
    assert verdicts == expected and expected["ZeRO-3, part offloaded"] == "yes" and expected["plain offload"] == "no"
    assert cli.main(["memory", "--plan", "--preset", "qwen2.5-7b", "--gpu-memory", "H100", "--host-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labs: error: --host-memory: memory size 'lots'")


def test_plan_without_gpu_memory_says_which_card_it_planned_for(capsys):
    """Most readers have 80 GB cards: a plan made for an H200 because --gpu-memory was left out must say so."""
    from labs import cli

    assert cli.main(["memory", "--plan", "3", "--preset", "qwen2.5-7b", "--gpus", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("no --gpu-memory given: planning for H200") and "--gpu-memory H100" in first
    assert cli.main(["memory", "--plan", "3", "--preset", "qwen2.5-7b", "--gpus", "2", "--gpu-memory", "H100"]) == 0
    assert "no --gpu-memory given" not in capsys.readouterr().out


def test_host_memory_is_checked_against_the_predicted_host_figure(capsys):
    from labs import cli

    args = ["memory", "--preset", "qwen2.5-3b", "--config", "bench/labs_zero2_offload.json", "--micro-batch", "8"]
    assert cli.main([*args, "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host_per_node_bytes"]
    for given, fits in ((host + 2**30, True), (host - 2**30, False)):
        assert cli.main([*args, "--json", "--host-memory", str(given)]) == 0
        assert json.loads(capsys.readouterr().out)["host_fits"] is fits
        assert cli.main([*args, "--host-memory", str(given)]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith(
            f"host: {host / 2**30:.1f} GiB per node {'fits' if fits else 'does not fit'}")


def test_max_live_parameters_caps_only_prefetching():
    """DeepSpeed 0.19.8 uses stage3_max_live_parameters only to cap what it prefetches
    (partitioned_param_coordinator.py, `max_params_to_prefetch`); the module being computed is gathered whatever
    the limit, and chapter 2 measured live=1 giving the same peak as prefetching off. So the gathered lm_head and
    decoder layer stay in the estimate at live=1, and only the prefetched elements go (before, live=1 dropped them:
    Qwen2.5-7B on 8 GPUs read 76.50 GiB, not 77.5)."""
    def phases(**zero):
        raw = resolve.default_config(3)
        raw["zero_optimization"].update(zero)
        return memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8, ds_config=raw)

    default, live1, no_prefetch = phases(), phases(stage3_max_live_parameters=1), phases(stage3_prefetch_bucket_size=0)
    prefetch = default.breakdown["knobs"]["stage3_prefetch_bucket_size"]
    counts = models.param_counts(models.shape("qwen2.5-7b"))
    for moment, module in (("loss_backward", counts["lm_head"]), ("layer_backward", counts["per_layer"])):
        assert default.phases[moment]["buffers"] - live1.phases[moment]["buffers"] == 2 * prefetch   # bf16
        assert live1.phases[moment]["buffers"] == no_prefetch.phases[moment]["buffers"]
        assert live1.phases[moment]["buffers"] >= 2 * module, moment                    # the module itself, gathered
    assert live1.total_per_gpu_bytes == no_prefetch.total_per_gpu_bytes
    assert default.total_per_gpu_bytes - live1.total_per_gpu_bytes == 2 * prefetch
    assert live1.total_per_gpu_bytes / 2**30 > 77.5

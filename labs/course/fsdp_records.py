"""Chapter 7's readings of what was not run on this machine: the H200 runs that chapter 9's benchmark recorded in
results/gpu, what the installed libraries accept, and the decision guide that puts them next to the chapter's runs.

    gpu = fsdp_records.gpu_rows()                 # FSDP2, labs ZeRO-3 and ZeRO-2, same levers, labs.memory's peaks
    fsdp_records.gpu_losses()                     # run a: the losses of FSDP2 and DeepSpeed's ZeRO stages
    Table(fsdp_records.decision_rows(pairs, gpu, grid))
"""
from __future__ import annotations

from labs import env
from labs.bench import results
from labs.course import fsdp_vs_zero
from labs.course.fsdp_vs_zero import ENGINES

RUN_A = "a_zero3_2xh200"
# The recorded H200 cases of this comparison: FSDP2 in runs a and d; labs-zero3 in runs a and e (run d has no
# labs-zero3 case, and run c's is marked invalid); labs-zero2 in run a (the decision guide compares it). Same levers
# for all: Liger kernels and loss, no checkpointing.
GPU_CASES = ((RUN_A, "labs-fsdp2"), ("d_zero3_repeat_2xh200", "labs-fsdp2"), (RUN_A, "labs-zero3"),
             ("e_zero3_final_2xh200", "labs-zero3"), (RUN_A, "labs-zero2"))
# Run a's cases that trained the same model with the same data and constant lr: FSDP2 and DeepSpeed's stages.
LOSS_CASES = ("labs-fsdp2", "labs-zero1", "labs-zero2", "labs-zero3", "stock-zero3")


# ---------------------------------------------------------------------------------------------- GPU results
def gpu_rows() -> list[dict]:
    """The recorded H200 rows (results/gpu), with labs.memory's predicted peak for each and the peak FLOP/s the
    MFU was computed against (TFLOP/s per GPU divided by MFU)."""
    table = results.rows(results.load_all())
    found = []
    for run, case in GPU_CASES:
        row = results.find(table, run, case)
        found.append(dict(row, label=f"{case} (run {run[0]})", predicted_peak_gib=results.predicted_peak_gib(row),
                          peak_tflops=row["tflops_per_gpu"] / row["mfu"], loss_at_step=row["losses"][-1],
                          steps=len(row["losses"]), buckets=_buckets(row["ds_config"])))
    return found


def gpu_losses(run: str = RUN_A, cases=LOSS_CASES) -> list[dict]:
    """Per case of one recorded run: how the engine builds the model (hence where its fp32 master starts), the
    learning rate of every step, and the losses."""
    table = results.rows(results.load_all())
    found = []
    for case in cases:
        row = results.find(table, run, case)
        optimizer = row["ds_config"]["optimizer"]["params"]
        found.append(dict(case=case, engine=row["engine"], stage="-" if row["engine"] == "fsdp2" else row["stage"],
                          lr=optimizer["lr"],
                          scheduler=row["ds_config"].get("scheduler", {}).get("type", "none (constant lr)"),
                          built_in="fp32" if row["engine"] == "fsdp2" else "bf16", losses=row["losses"]))
    return found


def _buckets(ds_config: dict) -> dict:
    zero = ds_config.get("zero_optimization", {})
    return {key: zero[key] for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                       "stage3_max_live_parameters") if key in zero}


# ---------------------------------------------------------------------------------------------- the libraries' word
def deepspeed_config_error(config: dict) -> str | None:
    """The message DeepSpeed's own config class stops with for `config`, checked before any process group is
    needed (DeepSpeed 0.19 refuses the keys of features it removed); None when it passes that check."""
    env.name_deepspeed_accelerator()
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    try:
        DeepSpeedConfig(config)
    except DeepSpeedConfigError as error:
        return str(error)
    except Exception:        # past the removed-keys check: it now wants a process group, which is not ours to start
        return None
    return None


def offload_options() -> list[dict]:
    """What each engine lets a run offload, read from the installed libraries: FSDP2's offload policies and their
    fields, DeepSpeed's offload devices and the keys of its offload_optimizer section."""
    import dataclasses

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    env.name_deepspeed_accelerator()
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum

    devices = [device.value for device in OffloadDeviceEnum]
    return [dict(engine="FSDP2", what="offload_policy", choices=", ".join(
                     f"{cls.__name__}({', '.join(f.name for f in dataclasses.fields(cls))})"
                     for cls in (OffloadPolicy, CPUOffloadPolicy)), moves="parameters, gradients, optimizer: together"),
            dict(engine="DeepSpeed", what="offload_optimizer.device", choices=", ".join(devices),
                 moves="optimizer states and step (stages 1-3)"),
            dict(engine="DeepSpeed", what="offload_param.device", choices=", ".join(devices),
                 moves="parameter partitions (stage 3)"),
            dict(engine="DeepSpeed", what="offload_optimizer keys",
                 choices=", ".join(k for k in DeepSpeedZeroOffloadOptimizerConfig.model_fields if k != "device"),
                 moves="ratio: part of the optimizer only (stage 3)")]


# ---------------------------------------------------------------------------------------------- the guide
def decision_rows(pairs: dict, gpu: list[dict], grid: dict) -> list[dict]:
    """The chapter's decision guide: each choice with the measured number behind it (these runs, the bf16-grid
    probe, results/gpu). Rows whose runs were skipped on this machine say so."""
    held_by = {(r["row"], r["engine"]): r for r in fsdp_vs_zero.held_rows(pairs)}
    moved = {(r["row"], r["engine"]): r for r in fsdp_vs_zero.comm_rows(pairs)}
    by_case = {r["case"]: r for r in results.rows(results.load_all()) if r["run"].endswith(RUN_A)}
    fsdp_a, zero3_a, zero2_a = (by_case[c] for c in ("labs-fsdp2", "labs-zero3", "labs-zero2"))
    full = [held_by[("full shard", e)]["bytes_per_param"] for e in ENGINES]
    ranks = pairs["full shard"]["fsdp2"].spec["nproc"]
    lr = pairs["full shard"]["fsdp2"].ds_config["optimizer"]["params"]["lr"]
    reduce = [moved[("full shard", e)]["reduce_scatter_per_param"] for e in ENGINES]
    small = fsdp_vs_zero.grid_summary(grid)[0]
    files = fsdp_vs_zero.checkpoint_files(pairs["full shard"]["fsdp2"])
    if "hybrid" in pairs:
        hybrid = [held_by[("hybrid", e)]["bytes_per_param"] for e in ENGINES]
        hybrid_because = (f"collectives stay in a replica but one gradient all-reduce; per rank it holds "
                          f"{hybrid[0]:.2f} bytes per parameter (4 ranks, 2 replicas), hpZ {hybrid[1]:.2f} but "
                          "reduce-scatters over all ranks; DeepSpeed 0.19 removed MiCS")
    else:
        hybrid_because = ("collectives stay in a replica but one gradient all-reduce (the 4-rank runs were skipped "
                          "on this machine); DeepSpeed 0.19 removed MiCS")
    return [
        dict(if_="the sharded model states fit either way", choose="either (FSDP2: PyTorch alone, no extra package)",
             because=f"same bytes of model state: {full[0]:.2f} (FSDP2) and {full[1]:.2f} (ZeRO-3) per parameter per "
                     f"rank on {ranks} ranks; same losses to bf16 rounding on CPU at lr {lr:g}, but at lr "
                     f"{small['lr']:g} the probe's master on the bf16 grid (DeepSpeed's) learned "
                     f"{'less than' if small['ratio'] < 0.9 else 'about as much as'} one off it (FSDP2's)"),
        dict(if_="GPU speed and peak memory matter most", choose="FSDP2 (one recorded configuration)",
             because=f"H200 run a, same levers: FSDP2 {fsdp_a['tokens_per_s_per_gpu'] / zero3_a['tokens_per_s_per_gpu']:.2f}"
                     f"x ZeRO-3's tokens/s and {fsdp_a['tokens_per_s_per_gpu'] / zero2_a['tokens_per_s_per_gpu']:.2f}x "
                     f"ZeRO-2's; peak {fsdp_a['peak_gib']:.1f} GiB against ZeRO-3's {zero3_a['peak_gib']:.1f} GiB "
                     "(speed-tuned DeepSpeed buckets; FSDP2 reduces gradients in fp32, DeepSpeed in bf16)"),
        dict(if_="gradient traffic is the bottleneck (slow links)",
             choose="DeepSpeed bf16, or FSDP2 with reduce_dtype bf16",
             because=f"FSDP2 reduce-scatters {reduce[0]:.1f} bytes per parameter per step (fp32), DeepSpeed "
                     f"{reduce[1]:.1f} (bf16)"),
        dict(if_="only the optimizer may leave the GPU, or the states exceed host memory", choose="DeepSpeed offload",
             because="FSDP2 offloads all model states to the CPU or nothing; no optimizer-only or NVMe offload"),
        dict(if_="several nodes, slow links between them", choose="FSDP2 with replicas = nodes (HYBRID_SHARD)",
             because=hybrid_because),
        dict(if_="checkpoints must reload on another number of ranks", choose="FSDP2 (DCP)",
             because=f"DCP wrote {len(files) - 1} shard files and an index (.metadata) of every slice, which its "
                     "loader documents resharding from (not run here); DeepSpeed converts offline first "
                     "(ds_to_universal, zero_to_fp32)"),
    ]

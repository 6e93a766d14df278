"""Chapter 7's experiments: PyTorch FSDP2 and DeepSpeed ZeRO on the same model, data and seed, one pair of launches
per row of the mapping between their strategies, and what to read off each pair.

    pairs = fsdp_vs_zero.run_mapping(RUNS / "07_fsdp")    # {"full shard": {"fsdp2": Run, "deepspeed": Run}, ...}
    fsdp_vs_zero.parity(pairs["full shard"])               # loss differences and the bf16 tolerance
    Table(fsdp_vs_zero.held_rows(pairs))                   # bytes per rank, measured and predicted

Every run is a plain `labs.launch.run` of a file in ds_configs/: FSDP2 is selected by the file's "fsdp" block
(labs.fsdp), DeepSpeed by its absence, so each row can be rerun with `labs train --config FILE`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from labs import CONFIGS, launch, memory, preflight
from labs.bench import results
from labs.instruments import comm

ENGINES = ("fsdp2", "deepspeed")
# The first row is the chapter's main comparison: it also saves a real checkpoint of each engine at the end.
MAIN_INSTRUMENTS = ("state_bytes", "comm", "state_dict")
ROW_INSTRUMENTS = ("state_bytes", "comm")
# bf16 keeps 8 significant bits: rounding a value to bf16 moves it by at most 2^-8 of itself (half the spacing of
# bf16 numbers). FSDP2 reduces gradients in fp32 (reduce_dtype), DeepSpeed's bf16 engines in bf16, so their updates
# can differ by about one such rounding per step; two runs of the same math then drift apart by about 2^-8 of how
# far training moved the loss.
BF16_DRIFT = 2.0 ** -8


@dataclass(frozen=True)
class Row:
    """One row of the mapping: what both engines do, their names for it, their config files, the ranks it needs."""
    what: str
    fsdp1: str
    fsdp_file: str
    zero: str
    zero_file: str
    ranks: int


MAPPING = (
    Row("full shard", "FULL_SHARD", "fsdp2.json", "ZeRO-3", "zero3.json", 2),
    Row("shard grads + optimizer", "SHARD_GRAD_OP", "fsdp2_shard_grad_op.json", "ZeRO-2", "zero2.json", 2),
    Row("no sharding", "NO_SHARD", "fsdp2_no_shard.json", "DDP (ZeRO-0)", "zero0_ddp.json", 2),
    Row("hybrid", "HYBRID_SHARD", "fsdp2_hybrid.json", "ZeRO++ hpZ", "zero3_hpz.json", 4),
    Row("offload", "CPUOffloadPolicy", "fsdp2_offload.json", "ZeRO-3 offload optimizer + params",
        "zero3_offload_all.json", 2),
)
ROWS = {row.what: row for row in MAPPING}


def run_mapping(out, steps=6, rows=MAPPING, **launch_options) -> dict:
    """One FSDP2 and one DeepSpeed launch per row, same preset, seed, data and steps (so every 2-rank run has the
    same batches and learning-rate schedule, and any two can be compared); bf16 as the files say. Returns
    {row name: {"fsdp2": Run, "deepspeed": Run}}. The first row also writes and describes a real checkpoint.

    Every run uses CPU ranks (gloo), on a GPU host too: the tiny model needs no GPU, one GPU could not hold two
    ranks, and the chapter's checked numbers (bf16 rounding on a CPU) come out the same on every machine. A row
    that needs more ranks than this host starts (labs.preflight.ranks_that_fit) is skipped with one printed line."""
    launch_options = {"preset": "tiny", "device": "cpu", **launch_options}
    fit = preflight.ranks_that_fit(on_gpu=launch_options["device"] != "cpu" and torch.cuda.is_available())
    pairs = {}
    for index, row in enumerate(rows):
        if row.ranks > fit:
            print(f"{row.what} row skipped: it needs {row.ranks} ranks and this machine starts at most {fit}")
            continue
        instruments = MAIN_INSTRUMENTS if index == 0 else ROW_INSTRUMENTS
        pairs[row.what] = {engine: _launch(Path(out) / f"{_slug(row.what)}_{engine}", file, steps, row.ranks,
                                           instruments, launch_options)
                           for engine, file in (("fsdp2", row.fsdp_file), ("deepspeed", row.zero_file))}
    return pairs


def _launch(out, file, steps, ranks, instruments, options):
    where = "CPU ranks" if options.get("device") == "cpu" else "ranks"
    print(f"{file}: {steps} steps of '{options['preset']}' on {ranks} {where} ...", end=" ", flush=True)
    start = time.perf_counter()
    run = launch.run(config=CONFIGS / file, steps=steps, nproc=ranks, out=out, stream=False, instruments=instruments,
                     **options)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return run



def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


# ---------------------------------------------------------------------------------------------- same math
def parity(pair: dict) -> dict:
    """Step-by-step |loss difference| between the two engines, and the tolerance bf16 allows (BF16_DRIFT times
    the largest distance the loss moved from its first value)."""
    a, b = pair["fsdp2"].losses, pair["deepspeed"].losses
    differences = [abs(x - y) for x, y in zip(a, b)]
    moved = max(abs(x - a[0]) for x in a)
    tolerance = BF16_DRIFT * moved
    return dict(steps=len(differences), first=differences[0], largest=max(differences), moved=moved,
                same_start=differences[0] <= 1e-6,
                tolerance=tolerance, within=max(differences) <= tolerance, differences=differences)


def adam_first_update_ratio(betas=(0.9, 0.95), steps_before: int = 1) -> float:
    """Size of Adam's first real update when its step counter already stands at `steps_before` (zero-gradient
    steps: the moments are still zero), relative to a fresh Adam's, for the same gradient and eps neglected:
    bias correction then divides by 1 - beta^(steps_before + 1) instead of 1 - beta."""
    (b1, b2), t = betas, steps_before + 1
    return ((1 - b1) / (1 - b1 ** t)) / ((1 - b2) / (1 - b2 ** t)) ** 0.5


def parity_rows(pairs: dict) -> list[dict]:
    return [dict(row=name, ranks=pair["fsdp2"].spec["nproc"], **{k: v for k, v in parity(pair).items()
                                                                  if k != "differences"})
            for name, pair in pairs.items()]


# ---------------------------------------------------------------------------------------------- held bytes
def held(run, rank=0) -> dict:
    """What the state_bytes instrument found on one rank (after the last backward), with the dtype of the largest
    tensor of each category, and labs.memory's prediction for the same run."""
    state = run.summary["state_bytes"][rank]
    predicted = memory.from_run(run).resident_per_rank[rank]
    found = dict(params=state["params_bytes"], grads=state["grads_bytes"], optimizer=state["optimizer_bytes"])
    dtypes = {c: next((t["dtype"].removeprefix("torch.") for t in state["largest"] if t["category"] == c), "-")
              for c in found}
    return dict(found, total=sum(found.values()), predicted=sum(predicted[f"{c}_bytes"] for c in found),
                dtypes=dtypes, params_count=run.summary["params"])


def held_rows(pairs: dict, rank=0) -> list[dict]:
    """Per row and engine: bytes of parameters, gradients and optimizer states on one rank, bytes per model
    parameter, the dtype the parameters are kept in, and labs.memory's prediction of the total."""
    rows = []
    for name, pair in pairs.items():
        for engine in ENGINES:
            h = held(pair[engine], rank)
            rows.append(dict(row=name, engine=engine, ranks=pair[engine].spec["nproc"], params_bytes=h["params"],
                             grads_bytes=h["grads"], optimizer_bytes=h["optimizer"], total_bytes=h["total"],
                             bytes_per_param=h["total"] / h["params_count"], param_dtype=h["dtypes"]["params"],
                             predicted_bytes=h["predicted"], ratio=h["total"] / h["predicted"]))
    return rows


def largest_tensors(run, rank=0, n=4) -> list[dict]:
    """The largest tensors the state_bytes instrument found on one rank: what holds the fp32 copy, and where."""
    return run.summary["state_bytes"][rank]["largest"][:n]


# ---------------------------------------------------------------------------------------------- moved bytes
def comm_rows(pairs: dict, skip=1) -> list[dict]:
    """Per row and engine: payload bytes per step of each collective on rank 0, per model parameter."""
    rows = []
    for name, pair in pairs.items():
        for engine in ENGINES:
            run = pair[engine]
            per_step = comm.per_step(run.metrics, skip=skip)
            params = run.summary["params"]
            rows.append(dict(row=name, engine=engine,
                             **{f"{kind}_per_param": per_step.get(kind, {}).get("bytes", 0) / params
                                for kind in ("all_gather", "reduce_scatter", "all_reduce")}))
    return rows


# ---------------------------------------------------------------------------------------------- time
def time_rows(pairs: dict) -> list[dict]:
    """Median step time of each run (after its warm-up steps) and how many steps that median covers."""
    rows = []
    for name, pair in pairs.items():
        seconds = {engine: pair[engine].summary["median_step_time_s"] for engine in ENGINES}
        timed = len(pair["fsdp2"].losses) - pair["fsdp2"].spec["warmup_steps"]
        rows.append(dict(row=name, timed_steps=max(timed, 1), fsdp2_s=seconds["fsdp2"],
                         deepspeed_s=seconds["deepspeed"], ratio=seconds["deepspeed"] / seconds["fsdp2"]))
    return rows


# ---------------------------------------------------------------------------------------------- checkpoints
def state_dict_rows(pair: dict, rank=0) -> list[dict]:
    """The named tensors of each engine's checkpoint on one rank: as saved (FSDP2's sharded state dict, DeepSpeed's
    model-states file) and gathered whole (FSDP2's full_state_dict on rank 0, DeepSpeed's zero_to_fp32)."""
    rows = []
    for engine in ENGINES:
        found = pair[engine].summary["state_dict"][rank]
        for kind, samples in (("saved", found["samples"]), ("gathered", found["full_samples"])):
            rows += [dict(engine=engine, kind=kind, **sample) for sample in samples]
    return rows


def checkpoint_files(run, rank=0) -> list[dict]:
    return run.summary["state_dict"][rank]["files"]


# ---------------------------------------------------------------------------------------------- GPU results
# The recorded H200 cases of this comparison: FSDP2 in runs a and d; labs-zero3 in runs a and e (run d has no
# labs-zero3 case, and run c's is marked invalid). Same levers for both: Liger kernels and loss, no checkpointing.
GPU_CASES = (("a_zero3_2xh200", "labs-fsdp2"), ("d_zero3_repeat_2xh200", "labs-fsdp2"),
             ("a_zero3_2xh200", "labs-zero3"), ("e_zero3_final_2xh200", "labs-zero3"))


def gpu_rows() -> list[dict]:
    """The recorded H200 rows (results/gpu), with labs.memory's predicted peak for each."""
    table = results.rows(results.load_all())
    found = []
    for run, case in GPU_CASES:
        row = results.find(table, run, case)
        found.append(dict(row, label=f"{case} (run {run[0]})", predicted_peak_gib=results.predicted_peak_gib(row),
                          loss_at_step=row["losses"][-1], steps=len(row["losses"])))
    return found


# ---------------------------------------------------------------------------------------------- the libraries' word
def deepspeed_config_error(config: dict) -> str | None:
    """The message DeepSpeed's own config class stops with for `config`, checked before any process group is
    needed (DeepSpeed 0.19 refuses the keys of features it removed); None when it passes that check."""
    _quiet_deepspeed_import()
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

    _quiet_deepspeed_import()
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


def _quiet_deepspeed_import():
    """Name the accelerator before DeepSpeed is first imported here, so it does not warn while guessing."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------- the guide
def decision_rows(pairs: dict, gpu: list[dict]) -> list[dict]:
    """The chapter's decision guide: each choice with the measured number behind it (these runs, results/gpu)."""
    held_by = {(r["row"], r["engine"]): r for r in held_rows(pairs)}
    moved = {(r["row"], r["engine"]): r for r in comm_rows(pairs)}
    fsdp_a, zero3_a = (next(r for r in gpu if r["case"] == case and r["run"].endswith("a_zero3_2xh200"))
                       for case in ("labs-fsdp2", "labs-zero3"))
    full = [held_by[("full shard", e)]["bytes_per_param"] for e in ENGINES]
    ranks = pairs["full shard"]["fsdp2"].spec["nproc"]
    reduce = [moved[("full shard", e)]["reduce_scatter_per_param"] for e in ENGINES]
    hybrid = [held_by[("hybrid", e)]["bytes_per_param"] for e in ENGINES]
    files = checkpoint_files(pairs["full shard"]["fsdp2"])
    return [
        dict(if_="the sharded model states fit either way", choose="either (FSDP2: PyTorch alone, no extra package)",
             because=f"same bytes of model state: {full[0]:.2f} (FSDP2) and {full[1]:.2f} (ZeRO-3) per parameter per "
                     f"rank on {ranks} ranks, same losses to bf16 rounding"),
        dict(if_="GPU speed and peak memory matter most", choose="FSDP2",
             because=f"H200 run a, same levers: "
                     f"{fsdp_a['tokens_per_s_per_gpu'] / zero3_a['tokens_per_s_per_gpu']:.2f}x the tokens/s, "
                     f"peak {fsdp_a['peak_gib']:.1f} GiB against {zero3_a['peak_gib']:.1f} GiB"),
        dict(if_="gradient traffic is the bottleneck (slow links)",
             choose="DeepSpeed bf16, or FSDP2 with reduce_dtype bf16",
             because=f"FSDP2 reduce-scatters {reduce[0]:.1f} bytes per parameter per step (fp32), DeepSpeed "
                     f"{reduce[1]:.1f} (bf16)"),
        dict(if_="only the optimizer may leave the GPU, or the states exceed host memory", choose="DeepSpeed offload",
             because="FSDP2 offloads all model states to the CPU or nothing; no optimizer-only or NVMe offload"),
        dict(if_="several nodes, slow links between them", choose="FSDP2 with replicas = nodes (HYBRID_SHARD)",
             because=f"collectives stay in a replica but one gradient all-reduce; per rank it holds {hybrid[0]:.2f} "
                     f"bytes per parameter (4 ranks, 2 replicas), hpZ {hybrid[1]:.2f} but reduce-scatters over all "
                     "ranks; DeepSpeed 0.19 removed MiCS"),
        dict(if_="checkpoints must reload on another number of ranks", choose="FSDP2 (DCP)",
             because=f"DCP wrote {len(files) - 1} shard files and an index (.metadata) of every slice, and reshards "
                     "on load; DeepSpeed converts offline first (ds_to_universal, zero_to_fp32)"),
    ]

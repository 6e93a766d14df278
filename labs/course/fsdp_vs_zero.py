"""Chapter 7's experiments: PyTorch FSDP2 and DeepSpeed ZeRO on the same model, data and seed, one pair of launches
per row of the mapping between their strategies, and what to read off each pair.

    pairs = fsdp_vs_zero.run_mapping(RUNS / "07_fsdp")    # {"full shard": {"fsdp2": Run, "deepspeed": Run}, ...}
    fsdp_vs_zero.parity(pairs["full shard"])               # loss differences and the bf16 tolerance
    Table(fsdp_vs_zero.held_rows(pairs))                   # bytes per rank, measured and predicted

Every run is a plain `labs.launch.run` of a file in ds_configs/: FSDP2 is selected by the file's "fsdp" block
(labs.fsdp), DeepSpeed by its absence, so each row can be rerun with `labs train --config FILE`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from labs import CONFIGS, env, launch, memory, preflight
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


def adam_update_ratio(betas=(0.9, 0.95), steps_before: int = 1, real_steps: int = 1) -> float:
    """Size of Adam's update at its `real_steps`-th gradient when its counter had already counted `steps_before`
    zero-gradient steps (they leave the moments at zero), relative to a fresh Adam's, for a steady gradient and
    eps neglected: the moments hold the same (1 - beta^k) share of the gradient, but bias correction divides by
    1 - beta^(k + steps_before) instead of 1 - beta^k."""
    (b1, b2), k, t = betas, real_steps, real_steps + steps_before
    return ((1 - b1 ** k) / (1 - b1 ** t)) / ((1 - b2 ** k) / (1 - b2 ** t)) ** 0.5


def schedule_lrs(config_file: str, steps: int, preset: str = "tiny") -> list[float]:
    """The learning rate each of `steps` optimizer steps uses, from the scheduler labs resolves for the file
    (DeepSpeed's own class, as both engines run it): WarmupCosineLR starts at warmup_min_lr, 0 here."""
    env.name_deepspeed_accelerator()
    from deepspeed.runtime import lr_schedules

    _, resolved = launch.prepare(preset=preset, config=CONFIGS / config_file, steps=steps, device="cpu")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=resolved["optimizer"]["params"]["lr"])
    logger, level = lr_schedules.logger, lr_schedules.logger.level
    logger.setLevel("ERROR")        # it warns that its lr is read before a first step: the step-1 lr is what we want
    try:
        scheduler = getattr(lr_schedules, resolved["scheduler"]["type"])(optimizer, **resolved["scheduler"]["params"])
    finally:
        logger.setLevel(level)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def bf16_spacing(value: float) -> float:
    """The gap between neighbouring bf16 numbers around `value` (8 significant bits: 2^(exponent - 7))."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def grid_summary(grid: dict) -> list[dict]:
    """Per learning rate of fsdp_probes.bf16_grid: how far below the untrained loss each recipe got by the last
    step, the ratio (on grid / off grid), and the share of bf16 weights each had changed by then."""
    rows = []
    for lr in sorted({run["lr"] for run in grid["runs"].values()}):
        off, on = (grid["runs"][f"{lr:g} {recipe}"] for recipe in ("off grid", "on grid"))
        rows.append(dict(lr=lr, off_fell=off["fell"][-1], on_fell=on["fell"][-1], ratio=on["fell"][-1] / off["fell"][-1],
                         off_changed=off["changed"][-1], on_changed=on["changed"][-1], steps=len(off["fell"])))
    return rows


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
    model-states file) and gathered whole (FSDP2's full_state_dict on rank 0, DeepSpeed's zero_to_fp32). ZeRO-3's
    model-states file holds empty placeholders: their placement says so, and their full shape is not in the file."""
    rows = []
    for engine in ENGINES:
        found = pair[engine].summary["state_dict"][rank]
        for kind, samples in (("saved", found["samples"]), ("gathered", found["full_samples"])):
            for sample in samples:
                if engine == "deepspeed" and kind == "saved" and sample["local_shape"] == [0]:
                    sample = dict(sample, full_shape="-", placement="empty placeholder")
                rows.append(dict(engine=engine, kind=kind, **sample))
    return rows


def checkpoint_contents(pair: dict, rank=0) -> list[dict]:
    """What fills one rank's checkpoint file(s), by kind of tensor, with bytes and bytes per parameter this rank
    owns: DCP's own index of its .distcp file, and the tensors of DeepSpeed's optimizer-states file."""
    rows = []
    for engine in ENGINES:
        run = pair[engine]
        owned = run.summary["params"] / run.spec["nproc"]
        tied = run.spec["dims"].get("tie_word_embeddings", False)
        kinds: dict[str, int] = {}
        for key, found in run.summary["state_dict"][rank]["file_contents"].items():
            kind = _content_kind(key, tied)
            kinds[kind] = kinds.get(kind, 0) + (found if isinstance(found, int) else found["bytes"])
        rows += [dict(engine=engine, what=kind, bytes=kinds[kind], per_param=kinds[kind] / owned)
                 for kind in CONTENT_KINDS if kind in kinds]
    return rows


CONTENT_KINDS = ("fp32 parameters", "fp32 master (fp32_flat_groups)", "tied head: the embedding again",
                 "Adam exp_avg", "Adam exp_avg_sq", "other (step counters)")


def _content_kind(key: str, tied: bool) -> str:
    for suffix, kind in (("exp_avg", "Adam exp_avg"), ("exp_avg_sq", "Adam exp_avg_sq")):
        if key.endswith(suffix):
            return kind
    if key.startswith("model."):
        return "tied head: the embedding again" if tied and key.endswith("lm_head.weight") else "fp32 parameters"
    return "fp32 master (fp32_flat_groups)" if "fp32_flat_groups" in key else "other (step counters)"


def checkpoint_files(run, rank=0) -> list[dict]:
    return run.summary["state_dict"][rank]["files"]

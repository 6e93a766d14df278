"""Where the one-card 7B rounds' run folders are, and the readings every report of them shares: DeepSpeed's timers,
the offloaded share, the card's memory, the host's CPU model, the host sampled, the runs that ran out of GPU memory.
Read by labs.course.one_card_7b (chapter 10's 7B row), labs.course.offload_copy_report (labs' copy of the updated
weights) and labs.course.offload_vs_stock (against stock)."""
from __future__ import annotations

import json
import re
import statistics

from labs import RESULTS, memory, models, resolve
from labs.course import host_samples
from labs.memory.layout import zero3_offloaded_share
from labs.metrics import read_jsonl

H200, H100 = RESULTS / "gpu" / "one_card_7b_1xh200", RESULTS / "gpu" / "one_card_7b_1xh100"


def median_timers(run_dir) -> dict[str, float]:
    """Medians over steps 3-6 (as the median speed) of DeepSpeed's forward, backward and optimizer step timers
    (seconds) and of the optimizer step's share of the whole step."""
    timed = read_jsonl(run_dir / "metrics.jsonl")[2:]
    found = {timer: statistics.median(m["timers_ms"][timer] for m in timed) / 1e3 for timer in ("fwd", "bwd", "step")}
    found["share"] = statistics.median(m["timers_ms"]["step"] / 1e3 / m["step_time_s"] for m in timed)
    return found


def offloaded(ds_config: dict) -> float:
    """The share of the optimizer offloaded in a run's resolved config (`offload_optimizer.ratio`)."""
    return ds_config["zero_optimization"]["offload_optimizer"]["ratio"]


def sub_group_size(ds_config: dict) -> float:
    """A resolved config's `sub_group_size`, DeepSpeed's default (1e9) where unset."""
    return float(ds_config["zero_optimization"].get("sub_group_size", resolve.ZERO_DEFAULTS["sub_group_size"]))


def offloaded_params(share: float, sub_group: float, preset: str = "qwen2.5-7b") -> float:
    """The share of a preset's parameters whose optimizer state ZeRO-3 actually offloads at a setting: whole
    sub-groups (labs.memory.layout.zero3_offloaded_share), so on the 7B 65% of 5e8-parameter sub-groups offloads 71%
    of the parameters, and 70% of 1e9 offloads 73%. This, not the setting, is the CPU's work."""
    return zero3_offloaded_share(models.PRESETS[preset], share, sub_group)


def card_bytes(folder) -> int:
    """The card's memory as nvidia-smi reported it in the round's gpus.csv (81,559 MiB for an H100 80GB)."""
    mib = (folder / "gpus.csv").read_text().splitlines()[1].split(",")[2]
    assert mib.strip().endswith(" MiB"), mib
    return int(mib.split()[0]) * 2**20


def cpu_model(path) -> str:
    """lscpu's model number: hosts that all report "Intel(R) Xeon(R) Processor" differ there."""
    return next(line.split(":")[1].strip() for line in path.read_text().splitlines() if line.startswith("Model:"))


def round28_run() -> tuple[int, float, float]:
    """Round 28's 8 x 1 run: its parameters, those whose optimizer state it offloaded (the figure round 29's parts are
    scaled to: whole sub-groups, so 71.4% of them at its 70% setting), and its median optimizer step."""
    run_dir = H100 / "round28" / "z3off70_7b"
    params = json.loads((run_dir / "summary.json").read_text())["params"]
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    share = offloaded_params(offloaded(ds_config), sub_group_size(ds_config))
    return params, share * params, median_timers(run_dir)["step"]


# round: (run, what it was, its config in the round's folder, the `labs train` options it ran with)
OUT_OF_MEMORY = {"37": (("labs57", "labs, 60.1% offloaded, 27 layers checkpointed, 0.57 of 3e8 sub-groups",
                         "labs_zero3_offload_57.json", dict(micro_batch=8, grad_accum=1, loss="liger",
                                                            kernels="liger", activation_checkpointing=27)),),
                 "42": (("stock74_mb4", "stock, 76.3% offloaded, 4 x 2, full checkpointing, 0.74 of 3e8 sub-groups",
                         "stock_z3_off74_sg3.json", dict(micro_batch=4, grad_accum=2, loss="hf", kernels="stock",
                                                         activation_checkpointing="full")),)}
# Runs that set PyTorch's allocator (PYTORCH_CUDA_ALLOC_CONF) before run folders recorded it (environment.json has
# since the twenty-seventh session): round, run -> the setting, as the round's jobs file has it (tests/test_round42.py)
ALLOCATOR = {("42", "stock74_mb4_exp"): "expandable_segments:True",
             ("42", "stock61_sg2_exp"): "expandable_segments:True"}


def allocator(run_dir, recorded: dict | None = None) -> str | None:
    """The PYTORCH_CUDA_ALLOC_CONF a run ran with (None: PyTorch's default allocator), from its environment.json
    (`recorded`, where the caller has read it already) or ALLOCATOR."""
    recorded = recorded if recorded is not None else json.loads((run_dir / "environment.json").read_text())
    return (recorded.get("PYTORCH_CUDA_ALLOC_CONF")
            or ALLOCATOR.get((run_dir.parent.name.removeprefix("round"), run_dir.name)))


def out_of_memory_lines() -> list[str]:
    """Runs that ran out of GPU memory, from their job logs: what PyTorch had allocated and held reserved but
    unallocated (labs.memory predicts allocated memory only)."""
    out = []
    for n, runs in OUT_OF_MEMORY.items():
        for name, what, config_file, options in runs:
            log = (H100 / f"round{n}" / f"{name}.job.log").read_text()
            found = re.search(r"Tried to allocate ([\d.]+) GiB.*?([\d.]+) GiB is allocated by PyTorch, and "
                              r"([\d.]+) GiB is reserved by PyTorch but unallocated", log)
            ds_config = json.loads((H100 / f"round{n}" / config_file).read_text())
            predicted = memory.estimate("qwen2.5-7b", ds_config=ds_config, seq_len=4096,
                                        **options).total_per_gpu_bytes / 2**30
            out.append(f"round {n} {name} ({what}; labs.memory predicted {predicted:.2f} GiB): out of GPU memory "
                       f"asking {found[1]} GiB, with {found[2]} GiB allocated and {found[3]} GiB reserved by PyTorch "
                       "but unallocated")
    return out


def round_parts(round_name: str) -> dict:
    """A round's optimizer-step parts timed one by one (tools/offload_step_parts.py, its JSON on the last line): seconds
    per `numel` parameters for CPU Adam, the unscale, each copy, and the setting they ran with."""
    return json.loads((H100 / f"round{round_name}" / "offload_step_parts.txt").read_text().splitlines()[-1])


def sampled_host(run_dir) -> dict:
    """A run's host as tools/host_memory.sh sampled it (labs.course.host_samples), against its round's `free -g`."""
    return host_samples.read(run_dir, free_txt=run_dir.parent / "host_memory.txt")


def host_lines(found: dict) -> list[str]:
    """The host of each run sampled each second (tools/host_memory.sh: labs' from round 37 on, stock's in round 42):
    the training rank's peak private and shared memory, the host's least available memory, against labs.memory's
    host figure for the run."""
    out = []
    for n, f in found["rounds"].items():
        for r in f["stock"] + f["labs"] + f["others"]:
            folder = H100 / f"round{n}" / r["run"]
            if not (folder / "host_samples.txt").exists():
                continue
            host = sampled_host(folder)
            out.append(f"round {n} {r['run']}'s host, sampled each second: the training rank at most "
                       f"{host['rank_at_tightest_gib']:.1f} GiB (private plus shared, at the tightest second), the "
                       f"host's least available {host['least_available_gib']:.1f} of {host['total_gib']:.0f} GiB; "
                       f"labs.memory's host figure {memory.from_run(folder).host_per_node_bytes / 2**30:.1f} GiB")
    return out

"""What chapter 8 reads off its route runs: who filled each "auto" and with what, the learning rate each step used
and which steps compute on the initial weights, how far runs that round differently may differ, what a ZeRO-3
checkpoint holds and whether its weights reproduce the run, and the rules of accelerate and bf16 that the exercises
ask about.

    route_checks.auto_rows([("zero3.json", {"labs": run.ds_config, "HF Trainer": trainer.ds_config})])
    route_checks.replay_loss(trainer.path / "trainer" / "checkpoint-4", trainer.spec, step=5, rank=0)
"""
from __future__ import annotations

import ast
import contextlib
import io
import math
from pathlib import Path

import torch

from labs import config as config_lib
from labs import cpu_matmul, data, models
from labs.course.tutorial_snippets import quiet_deepspeed


def auto_rows(pairs) -> list[dict]:
    """pairs: [(DeepSpeed file, labs' resolved config, route name, the route's resolved config)]. One row per key the
    file leaves "auto": the value labs filled it with, the value the route's filler did, and who that was."""
    rows = []
    for file, labs_config, route, route_config in pairs:
        for key in (k for k, v in _flatten(config_lib.load(file)).items() if v == "auto"):
            rows.append(dict(file=Path(str(file)).name, key=key, labs=_flatten(labs_config).get(key),
                             route=_flatten(route_config).get(key), filled_by=route))
    return rows


def accelerate_scheduler_steps(total_num_steps: int, num_processes: int, split_batches=False) -> int:
    """The total_num_steps DeepSpeed's scheduler gets from accelerate's DummyScheduler(total_num_steps=...):
    accelerate divides it by the number of processes (rounding up) unless batches are split (accelerator.py,
    _prepare_deepspeed), because it takes the count for batches of the unsharded loader."""
    return total_num_steps if split_batches else math.ceil(total_num_steps / num_processes)


def dummy_scheduler_steps(steps: int, num_processes: int, split_batches=False) -> int:
    """What to hand DummyScheduler(total_num_steps=...) so that DeepSpeed's scheduler gets `steps`: the inverse of
    accelerate_scheduler_steps (the chapter's accelerate route does this)."""
    return steps if split_batches else steps * num_processes


def scheduled_rates(resolved: dict, steps: int) -> list[float]:
    """The learning rate each of the first `steps` optimizer steps updates with, under the scheduler a resolved
    DeepSpeed config names (DeepSpeed's own class, built as the engine builds it). The engine reads the rate for a
    step before it steps the scheduler; WarmupCosineLR starts at iteration -1, where its rate is 0 whatever the
    config says, so the first step never changes the weights."""
    with quiet_deepspeed():     # it warns that the rate is read before the first step: that read is the point
        from deepspeed.runtime import lr_schedules

        schedule = resolved["scheduler"]
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=resolved["optimizer"]["params"]["lr"])
        scheduler = getattr(lr_schedules, schedule["type"])(optimizer, **schedule["params"])
        rates = []
        for _ in range(steps):
            rates.append(optimizer.param_groups[0]["lr"])
            scheduler.step()
    return rates


def steps_on_initial_weights(rates: list[float]) -> int:
    """How many leading steps compute their loss on the initial weights: a step's loss comes before its own update,
    so step k sees changed weights only once one of steps 1..k-1 updated with a rate above 0."""
    count = 1
    while count < len(rates) and rates[count - 1] == 0:
        count += 1
    return count


def rounding_tolerances(rates: list[float], rounding_gap: float, factor=10) -> list[float]:
    """Per step, how far two runs of the same arithmetic, rounded to bf16 in different places, may differ: nothing
    while both compute on the initial weights (the same bf16 weights, the same forward), then `factor` (an order of
    magnitude) times `rounding_gap`, the largest gap that a known rounding-only difference opened over the same
    steps (chapter 8: labs' own ZeRO-2 against ZeRO-3)."""
    initial = steps_on_initial_weights(rates)
    return [0.0 if step <= initial else factor * rounding_gap for step in range(1, len(rates) + 1)]


def bf16_rounding(value: float) -> float:
    """The largest error of rounding `value` to bf16: half the spacing of bf16 numbers near it (8 stored
    fraction bits: spacing 2^(exponent - 7))."""
    return torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(abs(value))) / 2


def checkpoint_files(folder) -> list[str]:
    """The files of a checkpoint folder, relative to it, sorted."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def saved_module(checkpoint, rank=0) -> dict:
    """What a ZeRO checkpoint's module state holds for one rank (global_step*/zero_pp_rank_R_mp_rank_00_model_states.pt):
    its tensors and their elements. Under ZeRO-3 they are the empty placeholders the partitioned parameters leave."""
    path = next(Path(checkpoint).glob(f"global_step*/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    module = torch.load(path, map_location="cpu", weights_only=False)["module"]
    return dict(tensors=len(module), elements=sum(t.numel() for t in module.values()), names=sorted(module))


def recovered_weights(checkpoint) -> dict:
    """The fp32 master weights of a ZeRO checkpoint, stitched back from every rank's partition by DeepSpeed's own
    zero_to_fp32 (no process group needed)."""
    with quiet_deepspeed(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))    # (its progress lines are dropped)


def replay_loss(checkpoint, spec: dict, step: int, rank: int, weights: dict | None = None,
                zero3_linear=False) -> float:
    """The loss of `rank`'s micro-batch at `step` (1-based), computed in this process from the weights a ZeRO
    checkpoint saved after step - 1, cast to the run's precision (what the engine computed with). Equal to the
    run's own loss when the checkpoint holds exactly the weights the run went on with, and the forward does the
    same arithmetic: `zero3_linear` computes Linear layers as ZeRO-3 does (DeepSpeed's own function: a matmul,
    then the bias added), not PyTorch's fused linear; in bf16 the two round differently once biases are non-zero."""
    weights = recovered_weights(checkpoint) if weights is None else weights
    with _zero3_linear(zero3_linear):
        return _replay(weights, spec, step, rank)


@contextlib.contextmanager
def _zero3_linear(active: bool):
    """Inside: torch.nn.functional.linear is DeepSpeed's ZeRO-3 linear (what zero.Init installs for a run)."""
    if not active:
        yield
        return
    with quiet_deepspeed():
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    original = torch.nn.functional.linear
    torch.nn.functional.linear = lambda x, weight, bias=None: LinearFunctionForZeroStage3.apply(x, weight, bias)
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def _replay(weights, spec, step, rank) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # as each rank ran (its launcher set OMP_NUM_THREADS=1)
    try:
        return _forward(weights, spec, step, rank)
    finally:
        torch.set_num_threads(threads)


def _forward(weights, spec, step, rank) -> float:
    dtype = models.DTYPES[spec["precision"]]
    model = models.build(spec["preset"], dtype=dtype, device=torch.device("cpu"), seed=spec["seed"])
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    rows = data.pack(data.corpus_tokens(spec["data"]), spec["seq_len"])
    batches = data.rank_batches(rows, spec["hyper"]["micro_batch"], rank, spec["nproc"], spec["seed"])
    for _ in range(step):
        batch = next(batches)
    with torch.no_grad(), cpu_matmul.as_a_rank(torch.device("cpu")):     # the products the rank computed
        return model(input_ids=batch, labels=batch).loss.item()


def safetensors_summary(path) -> dict:
    """Tensors, elements and dtypes in a safetensors file (what `save_model` wrote)."""
    from safetensors import safe_open

    elements, dtypes, names = 0, set(), []
    with safe_open(str(path), framework="pt") as file:
        for name in file.keys():
            tensor = file.get_tensor(name)
            elements, names = elements + tensor.numel(), names + [name]
            dtypes.add(str(tensor.dtype))
    return dict(tensors=len(names), elements=elements, dtypes=sorted(dtypes), names=sorted(names))


def log_lines(run_path, fragment: str) -> list[str]:
    """The lines of a route's launch.log (every rank's output) that contain `fragment`."""
    text = (Path(run_path) / "launch.log").read_text(errors="replace")
    return [line for line in text.splitlines() if fragment in line]


def trainer_logged_rates(run_path) -> list[float]:
    """The learning_rate of each line the Trainer logged ({'loss': ..., 'learning_rate': ...}), in order; a resumed
    Trainer's lines follow the first one's."""
    return [float(ast.literal_eval(line.strip())["learning_rate"]) for line in log_lines(run_path, "{'loss'")]


def _flatten(node, prefix="") -> dict:
    if isinstance(node, dict) and node:
        return {key: value for k, v in node.items() for key, value in _flatten(v, f"{prefix}{k}.").items()}
    return {prefix[:-1]: node}

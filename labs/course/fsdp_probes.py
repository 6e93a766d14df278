"""Small facts about the two engines' optimizers, each measured in a fresh process (a process group of one rank,
or a clean OpenMP start), so the notebook's own process stays free of them:

    fsdp_probes.optimizers()           # FSDP2: what an optimizer built before fully_shard holds and what its step
                                       # changes; DeepSpeed bf16: Adam's step count right after deepspeed.initialize
    fsdp_probes.host_adam_seconds()    # one AdamW step over 20 M fp32 parameters on the host: DeepSpeed's CPU Adam
                                       # against torch's AdamW (fused, and foreach), as offloaded training runs it
    fsdp_probes.bf16_grid()            # the two engines' mixed-precision recipe in one process, fp32 master
                                       # weights starting off or on the bf16 grid, at a small and a large lr

    python -m labs.course.fsdp_probes optimizers | host-adam NUMEL STEPS | bf16-grid   # the child processes

Every child runs on the CPU with the GPUs hidden (their numbers are the same on a GPU host).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from labs import cpu_matmul, data, models
from labs.env import CPU_ONLY, repaired_environment, skip_shm_comm_op


def optimizers() -> dict:
    """In one process group of one rank (gloo): {"order": FSDP2's optimizer-before-sharding trap, "deepspeed_steps":
    per ZeRO stage, the optimizer wrapper DeepSpeed's bf16 engine builds and Adam's step count before training}."""
    return _child(["optimizers"])


def host_adam_seconds(numel: int = 20_000_000, steps: int = 3) -> dict:
    """Median seconds of one AdamW step over `numel` fp32 parameters on the host, for each implementation, with
    OMP_NUM_THREADS set as labs sets it for an offloaded run on this machine."""
    return _child(["host-adam", str(numel), str(steps)])


def bf16_grid(lrs=(1e-5, 5e-3), steps: int = 6) -> dict:
    """The tiny model trained for `steps` steps at each constant lr, one process, the rows the chapter's 2-rank
    runs see, with bf16 compute and fp32 master weights updated by AdamW (betas, eps and clipping of the chapter's
    files). Two recipes differ only in where the fp32 master starts: "off grid" holds the fp32 weights as built
    (FSDP2: its parameters are the fp32 master, cast to bf16 per layer), "on grid" holds those weights rounded to
    bf16 (DeepSpeed: it builds the model in bf16 and copies it into its fp32 master). Per lr and recipe: the loss
    of each step, how far it fell below the loss of the untrained weights on the same batch, and the share of bf16
    weights that differ from the initial ones."""
    return _child(["bf16-grid", ",".join(map(str, lrs)), str(steps)])


def _child(arguments: list[str]) -> dict:
    # CPU only, on a GPU host too: the probes are about the libraries' logic, not a device.
    env = dict(repaired_environment(1, cpu_offload=True)[0], PYTHONWARNINGS="ignore", **CPU_ONLY)
    result = subprocess.run([sys.executable, "-m", "labs.course.fsdp_probes", *arguments], env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"fsdp_probes {arguments[0]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- the children
def _optimizers() -> dict:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")   # what DeepSpeed reads from a launcher
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            return dict(order=_optimizer_order(), deepspeed_steps=_deepspeed_steps())
        finally:
            dist.destroy_process_group()


def _optimizer_order() -> dict:
    """A two-layer model and an optimizer, then fully_shard: how many of the optimizer's tensors are still the
    model's parameters, whether a step of it changes the model, and whether a step of one built after sharding does."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    originals = list(model.parameters())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    sharded = list(model.parameters())
    held = [p for group in early.param_groups for p in group["params"]]

    def step(optimizer) -> float:
        """Largest change of any model weight made by one forward, backward and `optimizer.step()`."""
        before = [p.full_tensor().clone() for p in model.parameters()]
        model(torch.ones(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        return max(float((p.full_tensor() - b).abs().max()) for p, b in zip(model.parameters(), before))

    early_change = step(early)
    late = torch.optim.AdamW(model.parameters(), lr=0.1)
    return dict(parameters=len(sharded), optimizer_tensors=len(held),
                still_model_parameters=sum(any(p is q for q in sharded) for p in held),
                replaced=sum(not any(p is q for q in originals) for p in sharded),
                parameter_type=type(sharded[0]).__name__, early_grads=sum(p.grad is not None for p in held),
                early_step_change=early_change, late_step_change=step(late))


def _deepspeed_steps() -> dict:
    """deepspeed.initialize with bf16 and torch's AdamW at each ZeRO stage: the optimizer wrapper it builds and the
    step count Adam's state already holds before any training step (0 for a fresh optimizer)."""
    import deepspeed
    import torch

    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    found = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)).to(torch.bfloat16)
        config = {"train_batch_size": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "steps_per_print": 10 ** 9}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        steps = [float(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state]
        found[stage] = dict(wrapper=type(engine.optimizer).__name__, adam_steps=max(steps, default=0.0))
    return found


def _host_adam(numel: int, steps: int) -> dict:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def median_step(make) -> float:
        param = torch.nn.Parameter(torch.zeros(numel))
        param.grad = torch.full((numel,), 1e-3)
        optimizer = make([param])
        optimizer.step()                        # the first step allocates the states and touches their pages
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    return dict(numel=numel, threads=torch.get_num_threads(),
                deepspeed_cpu_adam=median_step(lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3)),
                torch_adamw_fused=median_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
                torch_adamw_foreach=median_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
                # what labs.fsdp builds on a machine without a GPU (fused=False, foreach left to torch, which
                # picks neither for CPU tensors): the single-tensor loop
                torch_adamw_single=median_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=False, foreach=False)))


def _bf16_grid(lrs: list[float], steps: int) -> dict:
    import torch

    cpu = torch.device("cpu")
    cpu_matmul.enter_if_needed(cpu)     # a child process: bf16 products at fp32 speed on a CPU without bf16 arithmetic
    batches = list(_take(data.rank_batches(data.pack(data.corpus_tokens(), 64), 4, 0, 1, seed=0), steps))
    built = {name: p.detach().clone() for name, p in
             models.build("tiny", dtype=torch.float32, device=cpu, seed=0).named_parameters()}
    model = models.CausalLM(models.build("tiny", dtype=torch.bfloat16, device=cpu, seed=0))
    params = dict(model.hf.named_parameters())          # the tied head shares the embedding: one entry
    initial = {name: p.detach().to(torch.bfloat16) for name, p in built.items()}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(initial[name])
        untrained = [float(model(batch)) for batch in batches]
    found = dict(untrained=untrained, runs={})
    for lr in lrs:
        for recipe in ("off grid", "on grid"):
            master = {name: (w.clone() if recipe == "off grid" else w.to(torch.bfloat16).float()).requires_grad_()
                      for name, w in built.items()}
            optimizer = torch.optim.AdamW(master.values(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
            losses, changed = [], []
            for batch in batches:
                with torch.no_grad():
                    for name, p in params.items():      # bf16 compute weights: the master rounded to nearest
                        p.copy_(master[name])
                changed.append(sum(int((p != initial[n]).sum()) for n, p in params.items()) /
                               sum(p.numel() for p in params.values()))
                loss = model(batch)
                loss.backward()
                for name, p in params.items():
                    master[name].grad, p.grad = p.grad.float(), None
                torch.nn.utils.clip_grad_norm_(master.values(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss))
            found["runs"][f"{lr:g} {recipe}"] = dict(lr=lr, recipe=recipe, losses=losses, changed=changed,
                                                     fell=[u - x for u, x in zip(untrained, losses)])
    return found


def _take(iterator, n: int):
    for _ in range(n):
        yield next(iterator)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if sys.argv[1:2] == ["optimizers"]:
        print(json.dumps(_optimizers()))
    elif sys.argv[1:2] == ["host-adam"] and len(sys.argv) == 4:
        print(json.dumps(_host_adam(int(sys.argv[2]), int(sys.argv[3]))))
    elif sys.argv[1:2] == ["bf16-grid"] and len(sys.argv) == 4:
        print(json.dumps(_bf16_grid([float(x) for x in sys.argv[2].split(",")], int(sys.argv[3]))))
    else:
        sys.exit("usage: python -m labs.course.fsdp_probes optimizers | host-adam NUMEL STEPS | bf16-grid LRS STEPS")

"""The training script of chapter 8's routes, started on every rank by a stock launcher:

    deepspeed --num_gpus 2 --no_local_rank --module labs.course.route_rank RUN_DIR     (route "trainer")
    torchrun --nproc_per_node 2 -m labs.course.route_rank RUN_DIR                        (route "trainer")
    accelerate launch --config_file accelerate_configs/X.yaml -m labs.course.route_rank RUN_DIR   ("accelerate")

It trains what `labs train` trains (the model of `labs.models.build`, the batches of `labs.data.rank_batches`, the
optimizer, schedule and clipping labs resolved, all written by `labs.course.routes` into RUN_DIR/route.json), but
through the stock APIs: `transformers.Trainer` with `TrainingArguments(deepspeed=...)`, or a plain loop around
accelerate's `Accelerator`. Each rank writes RUN_DIR/rank<r>.json: its loss, lr and gradient norm per step, the
DeepSpeed config as the engine got it, and the parameter elements it holds."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from labs import cpu_matmul, data, env, models
from labs.course import route_checks
from labs.course.route_batches import LabsOrder, TokenRows

CPU = not torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- Trainer
def trainer_main(run_dir: Path, spec: dict) -> dict:
    """transformers.Trainer + DeepSpeed; with spec["checkpoint_step"], also a checkpoint there and a second Trainer
    that resumes from it (in this same job) and saves its model at the end."""
    args = _training_args(spec, run_dir / "trainer", spec["ds_config"])
    if CPU:
        # The Trainer's use_cpu path starts torch.distributed (gloo) but not DeepSpeed's comm layer, so zero.Init
        # would count one rank and refuse the batch sizes. Wrapping the running group fixes that.
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    record = _train(spec, args)
    resume = spec.get("checkpoint_step")
    if resume:
        checkpoint = run_dir / "trainer" / f"checkpoint-{resume}"
        resumed_args = _training_args(spec, run_dir / "resumed", spec["resume_ds_config"])
        record["resumed"] = _train(spec, resumed_args, resume_from=checkpoint, save_to=run_dir / "resumed" / "final")
    return record


def _training_args(spec, output_dir, ds_config):
    """Every value HF fills a DeepSpeed "auto" from, set to what labs resolved for the same run."""
    from transformers import TrainingArguments

    hyper = spec["hyper"]
    return TrainingArguments(
        output_dir=str(output_dir), deepspeed=ds_config, max_steps=spec["steps"], seed=spec["seed"],
        per_device_train_batch_size=hyper["micro_batch"], gradient_accumulation_steps=hyper["grad_accum"],
        learning_rate=hyper["lr"], adam_beta1=hyper["betas"][0], adam_beta2=hyper["betas"][1],
        adam_epsilon=hyper["eps"], weight_decay=hyper["weight_decay"], max_grad_norm=hyper["clip"],
        warmup_steps=hyper["warmup_steps"], bf16=spec["precision"] == "bf16", use_cpu=CPU,
        ddp_backend="gloo" if CPU else None, logging_steps=1, report_to="none", disable_tqdm=True,
        save_strategy="no", dataloader_drop_last=True)


def _train(spec, args, resume_from=None, save_to=None) -> dict:
    from transformers import Trainer, TrainerCallback

    losses, lrs = [], []

    class RecordingTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return LabsOrder(len(self.train_dataset), args.per_device_train_batch_size, args.world_size, spec["seed"])

        def training_step(self, *a, **k):
            # The rate this step's update uses, read before it (as labs train records it): the Trainer logs the rate
            # after DeepSpeed's engine has stepped its scheduler, i.e. the next step's.
            lrs.append(self.optimizer.param_groups[0]["lr"])
            loss = super().training_step(*a, **k)   # this rank's loss of the micro-batch, as the Trainer computed it
            losses.append(loss.item())
            return loss

    class SaveAt(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step == spec.get("checkpoint_step"):
                control.should_save = True

    zero3 = args.hf_deepspeed_config.is_zero3()
    # Under ZeRO-3 the TrainingArguments' DeepSpeed config (created first, as HF requires) puts the model in
    # zero.Init; labs.models.build does that through the same HF integration, with the same seed.
    model = models.build(spec["preset"], dtype=models.DTYPES[spec["precision"]], device=_device(), seed=spec["seed"],
                         zero3_config=args.hf_deepspeed_config.config if zero3 else None)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=TokenRows(_rows(spec)),
                               callbacks=[SaveAt()] if resume_from is None and spec.get("checkpoint_step") else None)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    seconds = time.perf_counter() - start
    if save_to is not None:
        trainer.save_model(str(save_to))
    # A resumed Trainer's history starts with the checkpoint's own entries: keep this run's steps.
    logs = [entry for entry in trainer.state.log_history if "loss" in entry][-len(losses):]
    return dict(losses=losses, lrs=lrs, grad_norms=[e.get("grad_norm") for e in logs],
                train_seconds=seconds, ds_config=_plain(trainer.accelerator.deepspeed_config),
                **_held(trainer.model_wrapped))


# ---------------------------------------------------------------------------------------------- accelerate
def accelerate_main(run_dir: Path, spec: dict) -> dict:
    """A plain training loop around accelerate's Accelerator; DeepSpeed or FSDP comes from `accelerate launch`."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    if CPU:
        # accelerate picks its backend from the accelerator it finds; on a CPU it finds none and each process would
        # train alone. A PartialState made first with gloo is the one every later Accelerator() shares. (For FSDP it
        # must also say cpu=True, or it makes no process group: DeepSpeed's branch makes one itself.)
        PartialState(cpu=os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true", backend="gloo")
    accelerator = Accelerator()
    switched = _fsdp_on_cpu(accelerator)
    hyper = spec["hyper"]
    loader = torch.utils.data.DataLoader(TokenRows(rows := _rows(spec)), batch_size=hyper["micro_batch"],
                                         sampler=LabsOrder(rows.shape[0], hyper["micro_batch"],
                                                           accelerator.num_processes, spec["seed"]), drop_last=True)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        model, optimizer, loader, scheduler = _prepare_deepspeed(accelerator, spec, loader)
    elif accelerator.distributed_type == DistributedType.FSDP:
        model, optimizer, loader, scheduler = _prepare_fsdp(accelerator, spec, loader)
    else:
        raise RuntimeError(f"accelerate started {accelerator.distributed_type}, not DEEPSPEED or FSDP: check the "
                           "YAML's distributed_type")
    record = dict(losses=[], lrs=[], grad_norms=[], fsdp_switched_on_cpu=switched)
    if fsdp := accelerator.distributed_type == DistributedType.FSDP:
        before_cast = _loss_before_output_cast(model)
        record.update(returned_losses=[], fsdp_units=_fsdp_units(model))
    batches = iter(loader)
    start = time.perf_counter()
    for step in range(spec["steps"]):
        batch = next(batches, None)
        if batch is None:                       # a new epoch: reshuffled with seed + epoch, as labs does
            loader.set_epoch(getattr(loader, "iteration", 0) + 1)
            batch = next(batches := iter(loader))
        record["lrs"].append(optimizer.param_groups[0]["lr"])     # the rate this step's update uses
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)              # DeepSpeed: engine.backward and engine.step (the optimizer steps here)
        if scheduler is not None:               # FSDP: clip, step, schedule (DeepSpeed did all three inside)
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), hyper["clip"]))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            grad_norm = model.get_global_grad_norm()
        record["losses"].append(before_cast.pop() if fsdp else loss.item())
        if fsdp:
            record["returned_losses"].append(loss.item())     # what the model returned: cast to bf16 by FSDP
        record["grad_norms"].append(None if grad_norm is None else float(grad_norm))
    record.update(train_seconds=time.perf_counter() - start, loss_dtype=str(loss.dtype),
                  distributed_type=str(accelerator.distributed_type.value), **_held(model))
    if not fsdp:
        record["ds_config"] = _plain(accelerator.deepspeed_config)
    else:
        plugin = accelerator.state.fsdp_plugin
        record["fsdp"] = {"version": plugin.fsdp_version, "reshard_after_forward": plugin.reshard_after_forward,
                          "mixed_precision_policy": str(plugin.mixed_precision_policy)}
    return record


def _fsdp_on_cpu(accelerator) -> bool:
    """accelerate 1.15 turns FSDP on only where it finds GPUs (or XPUs, NPUs, ...): on a CPU an FSDP config gives a
    plain gloo job. Here the state is switched to FSDP after the fact, with the plugin built from the same FSDP_*
    variables `accelerate launch` set from the YAML, so the rest of accelerate's FSDP path runs as on GPUs."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not CPU or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or \
            accelerator.distributed_type == DistributedType.FSDP:
        return False
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    # Every later AcceleratorState() (the optimizer wrapper makes one) copies the type back from PartialState's
    # shared state: set it there too, as AcceleratorState's own init does.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
    return True


def _loss_before_output_cast(model) -> list:
    """A list that receives the model's loss at every forward as the model computed it (fp32: HF's loss upcasts the
    logits), before FSDP's mixed-precision policy casts the outputs to its output_dtype (bf16 here). The hook runs
    ahead of FSDP's own post-forward hook (prepend=True), which does the cast."""
    losses = []

    model.register_forward_hook(lambda _module, _inputs, output: losses.append(output.loss.item()), prepend=True)
    return losses


def _fsdp_units(model) -> list[str]:
    """The modules fully_shard wrapped (each one all-gathers its parameters as one unit); "" is the root model."""
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def _prepare_deepspeed(accelerator, spec, loader):
    """DeepSpeed through accelerate: the optimizer and scheduler come from the config file, so the code hands over
    placeholders (DummyOptim, DummyScheduler) whose values fill the file's "auto" entries."""
    from accelerate.utils import DummyOptim, DummyScheduler

    config, hyper = accelerator.state.deepspeed_plugin.deepspeed_config, spec["hyper"]
    dtype = torch.bfloat16 if str(config.get("bf16", {}).get("enabled")).lower() == "true" else torch.float32
    model = models.build(spec["preset"], dtype=dtype, device=_device(), seed=spec["seed"])
    if "optimizer" in config:
        optimizer = DummyOptim(model.parameters(), lr=hyper["lr"], weight_decay=hyper["weight_decay"])
    else:   # a config without an optimizer (e.g. from `--use_deepspeed --zero_stage 2`): the code brings one
        optimizer = torch.optim.AdamW(model.parameters(), lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                                      weight_decay=hyper["weight_decay"])
    scheduler = None
    if "scheduler" in config:
        # accelerate divides DummyScheduler's total_num_steps by the number of processes (it assumes the count of
        # batches of the unsharded loader): hand it steps x processes so DeepSpeed gets the run's steps.
        total = route_checks.dummy_scheduler_steps(spec["steps"], accelerator.num_processes)
        scheduler = DummyScheduler(optimizer, total_num_steps=total,
                                   warmup_num_steps=hyper["warmup_steps"])
        model, optimizer, loader, _ = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return model, optimizer, loader, None


def _prepare_fsdp(accelerator, spec, loader):
    """FSDP through accelerate: fp32 weights sharded by accelerate (mixed precision from the YAML), torch AdamW, and
    DeepSpeed's WarmupCosineLR class with labs' resolved values (as labs.fsdp uses it). The scheduler is stepped
    here once per step: a scheduler passed to accelerator.prepare is stepped once per process per step."""
    from deepspeed.runtime import lr_schedules

    hyper = spec["hyper"]
    model = models.build(spec["preset"], dtype=torch.float32, device=_device(), seed=spec["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                                  weight_decay=hyper["weight_decay"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedule = spec["scheduler"]
    scheduler = getattr(lr_schedules, schedule["type"])(optimizer, **schedule["params"])
    return model, optimizer, loader, scheduler


# ---------------------------------------------------------------------------------------------- shared
def _rows(spec) -> torch.Tensor:
    return data.pack(data.corpus_tokens(spec["data"]), spec["seq_len"])


def _device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if not CPU else torch.device("cpu")


def _held(model) -> dict:
    """Parameter elements this rank holds: ZeRO-3 keeps a partition (ds_tensor), FSDP2 a local shard of each
    DTensor, ZeRO-0/1/2 every parameter whole."""
    held = total = 0
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            held, total = held + param.ds_tensor.numel(), total + param.ds_numel
        elif hasattr(param, "to_local"):
            held, total = held + param.to_local().numel(), total + param.numel()
        else:
            held, total = held + param.numel(), total + param.numel()
    return dict(param_elements_held=held, param_elements=total)


def _plain(config: dict) -> dict:
    """The config as plain data. accelerate's steps_per_print, float("inf"), stays inf (json writes Infinity)."""
    return json.loads(json.dumps(config, default=str))


def main(run_dir: Path):
    spec = json.loads((run_dir / "route.json").read_text())
    env.skip_shm_comm_op()     # before the Trainer or accelerate starts DeepSpeed's comm layer: training never uses it
    cpu_matmul.enter_if_needed(_device())       # bf16 products at fp32 speed on an AVX2-only CPU (see there)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    record = trainer_main(run_dir, spec) if spec["route"] == "trainer" else accelerate_main(run_dir, spec)
    rank = int(os.environ["RANK"])
    # The ranks the training really spanned (the process group), not what the launcher started: on a CPU without the
    # gloo fix each accelerate process would report 1 here.
    record.update(rank=rank, world_size=dist.get_world_size() if dist.is_initialized() else 1,
                  launched=int(os.environ["WORLD_SIZE"]))
    (run_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run_dir = Path(sys.argv[-1])
    try:
        main(run_dir)
    except BaseException:
        (run_dir / f"rank{os.environ.get('RANK', '0')}.err").write_text(traceback.format_exc())
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # as labs.rank: skip the interpreter shutdown where a CPU backend's thread can abort the process

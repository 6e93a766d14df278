"""Minimal reproduction: DeepSpeed ZenFlow (ZeRO-2 + CPU optimizer offload) turns a model's weights NaN.

Only torch + deepspeed, one process, no labs. Run on a CPU machine:

    DS_ACCELERATOR=cpu python tools/repro_zenflow_nan.py [key=value ...]

What it shows (DeepSpeed 0.19.8): with update_interval "auto", deepspeed/runtime/zenflow/engine.py:48-50
(configure_zenflow) sets engine.update_interval = 0 and line 69 copies it into the engine's config,
`engine._config.gradient_accumulation_steps = engine.update_interval`; deepspeed/runtime/engine.py:3413
(backward) then computes `loss = loss / self.gradient_accumulation_steps()`, a division by 0: every gradient of the
first step is inf/NaN (seen at the first reduction hook), the selective GPU AdamW (ops/adam/zenflow_torch_adam.py,
group_step) writes NaN into the weights, and from step 2 on the loss is NaN. bf16 or fp32, clipping on or off,
overlap_step true or false, any topk_ratio: the same. full_warm_up_rounds=1 only moves it one step later (warm-up
steps are full updates). Any number for update_interval (e.g. update_interval=4, as DeepSpeedExamples'
training/DeepSpeed-ZenFlow/finetuning/zf_config.json) trains.

key=value pairs override the zenflow block (e.g. full_warm_up_rounds=1 overlap_step=false), plus
bf16=false and clip=0 (gradient_clipping). It prints, per step, the loss and which parameters hold a NaN.
"""
import os
import sys

import torch
import deepspeed

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")


def parse(value):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value, value)


def main():
    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
    bf16 = parse(overrides.pop("bf16", "true"))
    clip = parse(overrides.pop("clip", "1.0"))
    steps = parse(overrides.pop("steps", "5"))
    zenflow = {"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto", "update_interval": "auto",
               "overlap_step": True, "full_warm_up_rounds": 0}
    zenflow.update({k: parse(v) for k, v in overrides.items()})
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu"},
                              "zenflow": zenflow},
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(4, 64, dtype=dtype)
    y = torch.randint(0, 8, (4,))
    print("config zenflow:", zenflow, "bf16:", bf16, "clip:", clip)
    # configure_zenflow (deepspeed/runtime/zenflow/engine.py) sets _config.gradient_accumulation_steps = update_interval,
    # which is 0 when update_interval is "auto"; engine.backward then divides the loss by it.
    print("engine.gradient_accumulation_steps():", engine.gradient_accumulation_steps())
    for step in range(1, steps + 1):
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        nan = [name for name, p in engine.module.named_parameters() if not torch.isfinite(p).all()]
        print(f"step {step}: loss {loss.item():.4f}  non-finite parameters after the step: {nan or 'none'}", flush=True)
    engine.destroy()


# ZenFlow's overlapped CPU step starts a process with multiprocessing's spawn: it re-imports this file.
if __name__ == "__main__":
    main()

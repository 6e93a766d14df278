"""Minimal reproduction: DeepSpeed 0.19.8's ZenFlow (ZeRO-2 + CPU offload) scrambles every 2-D weight at start-up.

Only torch + deepspeed (plus labs' fix with --fix), one process, on a CPU:

    DS_ACCELERATOR=cpu python tools/repro_zenflow_layout.py [--fix]

It builds a small MLP, records its weights and its output on a fixed input, then builds a DeepSpeed engine with
ZenFlow and prints (1) whether the engine's weights equal the model's and whether their bytes hold the transpose,
(2) whether the engine's forward equals the model's, (3) the first and mean-of-last-8 losses of 40 steps of ZenFlow
with update_interval 1 (a full CPU update every step, which should train exactly like plain offload) and of plain
ZeRO-2 offload on the same data. Without --fix: weights permuted, forward different, ZenFlow's loss far behind. With
--fix (labs.zenflow_layout): all equal. The cause is in labs/zenflow_layout.py's docstring.
"""
import os
import sys

import torch
import deepspeed

for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29547").items():
    os.environ.setdefault(key, value)


def engine_for(zenflow: bool):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if zenflow:
        zero["zenflow"] = {"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto",
                           "update_interval": 1, "overlap_step": False, "full_warm_up_rounds": 0}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    weights = {name: p.detach().bfloat16() for name, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, weights


def train(engine, steps=40):
    data = torch.Generator().manual_seed(1)
    xs, w = torch.randn(64, 64, generator=data), torch.randn(64, 8, generator=data)
    ys, losses = (xs @ w).argmax(1), []
    for step in range(steps):
        rows = slice(step * 4 % 64, step * 4 % 64 + 4)
        loss = torch.nn.functional.cross_entropy(engine(xs[rows].bfloat16()).float(), ys[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main():
    if "--fix" in sys.argv:
        from labs import zenflow_layout
        zenflow_layout.install()
    deepspeed.init_distributed(dist_backend="gloo")
    probe = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    results = {}
    for zenflow in (False, True):
        engine, weights = engine_for(zenflow)
        held = dict(engine.module.named_parameters())
        for name in ("0.weight", "2.weight"):
            mine, model = held[name].detach(), weights[name]
            print(f"{'zenflow' if zenflow else 'plain  '} {name}: equal to the model's {torch.equal(mine, model)}, "
                  f"bytes hold the transpose {torch.equal(mine.reshape(model.t().shape), model.t())}")
        with torch.no_grad():
            out = engine(probe).float()
        results[zenflow] = dict(out=out, losses=train(engine))
    print("forward equal:", torch.equal(results[False]["out"], results[True]["out"]))
    for zenflow, label in ((False, "plain offload"), (True, "ZenFlow, update_interval 1")):
        losses = results[zenflow]["losses"]
        print(f"{label:28s} loss at step 1 {losses[0]:.4f}, mean of the last 8 {sum(losses[-8:]) / 8:.4f}")


if __name__ == "__main__":
    main()

"""Tutorial "001", the DeepSpeed chapter of a Chinese tutorial series (ZeRO, ds_config.json, the HF Trainer and
accelerate, FSDP, several nodes): its checkable claims in our words, each graded against what a chapter computed
(section numbers are the tutorial's). Every number a verdict quotes is a `{field}` read from a chapter's stored
outputs (`labs.course.sources.Read`) or computed by a named labs function (`Computed`, which may also decide the
verdict); nothing here types a result."""
from __future__ import annotations

from labs.course.source_reads import (CH1, CH3, CH5, CH6, CH7, CH8, CH9, RUN_M, SCENARIOS, SNIPPETS, SUMS,
                                      offload_cost_run_m, run_a, sums_row, thirteen_b_without_zero)
from labs.course.sources import Claim, Computed, Read, See

TUTORIAL = "001"
STEP_COST = "What a step costs"        # chapter 3's recorded H200 offload step, read within the run

# Chapter 3's 70B full offload on a GPU host (PyTorch's pinning), host TiB and bytes per parameter
PINNED_70B = r"PyTorch's pinning \(a GPU host\):\s+host memory ([\d.]+) TiB \(([\d.]+) bytes per parameter\)"


CLAIMS = [
    Claim("001", "1", "Plain DDP cannot train a 13B model on 24 GB cards.", "true",
          "without ZeRO every card holds all model states, {bytes} bytes per parameter: {gb} GB before any "
          "activation.", "{gb} GB of model states per card",
          (Computed(thirteen_b_without_zero, ("gb", "bytes"), See(CH1, "Bytes per parameter, step by step")),)),
    Claim("001", "1", "ZeRO-1 saves 4x memory, ZeRO-2 8x, and ZeRO-3 in proportion to the number of GPUs.", "partly",
          "4x and 8x are the limits for very many GPUs, not what a few give: the model states shrink {z1_4}x (ZeRO-1) "
          "and {z2_4}x (ZeRO-2) on 4 GPUs, and {z1_1024}x and {z2_1024}x on 1024.",
          "{z1_4}x and {z2_4}x on 4 GPUs",
          (Read(CH1, SUMS, r"ZeRO-1: the DeepSpeed chapter promises 4x; on 4 GPUs it is (\S+)x, on 1024 GPUs (\S+)x",
                ("z1_4", "z1_1024")),
           Read(CH1, SUMS, r"ZeRO-2: the DeepSpeed chapter promises 8x; on 4 GPUs it is (\S+)x, on 1024 GPUs (\S+)x",
                ("z2_4", "z2_1024")))),
    Claim("001", "1", "A 7B model's states: 14 GB of fp16 weights, 14 GB of fp16 gradients, Adam states of ~28 GB "
          "(its header) or (4+4) x 7B = 56 GB (its own line): 84 GB per GPU under plain data parallelism.", "false",
          "mixed-precision Adam also keeps fp32 master weights: its states are {adam} GB, and the total {paper} GB "
          "(ZeRO paper), {ds} GB by DeepSpeed's estimator rules ({ds_by}, as chapter 1's table marks it), which also "
          "count an fp32 copy of the gradients.",
          "{adam} GB of optimizer states; {paper} GB in all (paper)",
          (sums_row("001", "Adam states (header / its own line)", "adam", "_"),
           sums_row("001", "no ZeRO, per GPU", "paper", "ds", "ds_by"))),
    Claim("001", "1", "On 4 GPUs a 7B model needs 42 GB per GPU under ZeRO-1, 28 GB (its figure) or 31.5 GB (its "
          "sum) under ZeRO-2, and 21 GB under ZeRO-3.", "false",
          "each is built on the undercounted 84 GB above and is too low: {z1} / {z2} / {z3} GB by the ZeRO paper, "
          "{z1_ds} / {z2_ds} / {z3_ds} GB by DeepSpeed's estimator rules ({z1_by} / {z2_by} / {z3_by}, as chapter "
          "1's table marks them).", "{z1} / {z2} / {z3} GB (paper)",
          (sums_row("001", "ZeRO-1 on 4 GPUs, per GPU", "z1", "z1_ds", "z1_by"),
           sums_row("001", "ZeRO-2 on 4 GPUs (diagram / text)", "z2", "z2_ds", "z2_by"),
           sums_row("001", "ZeRO-3 on 4 GPUs, per GPU", "z3", "z3_ds", "z3_by"))),
    Claim("001", "1", "With ZeRO-3 and optimizer offload on 4 GPUs, each GPU's share of the optimizer states in CPU "
          "memory is 14 GB.", "false",
          "the host side is {bytes} bytes per partitioned parameter (fp32 master, two moments, an fp32 gradient, the "
          "bf16 gradient partition), not Adam's two moments alone: {per_gpu} GB per GPU, {per_host} GB per 4-GPU "
          "host.", "{per_gpu} GB per GPU in host memory",
          (Read(CH3, "What the host holds", r"^zero3_offload_optimizer\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s*$",
                ("bytes",)),
           Read(CH1, SUMS, r"(\S+) GB of host memory per GPU, (\d+) GB per 4-GPU host", ("per_gpu", "per_host")))),
    Claim("001", "1", "Under offload, forward brings each layer's parameters from the CPU, backward sends them back, "
          "and the optimizer updates on the CPU before copying back.", "partly",
          "that is `offload_param` and `offload_optimizer` together; with the optimizer alone offloaded (the "
          "tutorial's first choice) the bf16 parameters stay on the GPU (one H200 peaked at {on_gpu} GiB in run b), "
          "and the CPU step takes {cpu_step} s of each {step} s step.",
          "{cpu_step} s of CPU optimizer step in {step} s",
          (Read(CH3, STEP_COST, r"peak GPU memory ([\d.]+) GiB measured", ("on_gpu",)),
           Read(CH3, STEP_COST, r"^step (\S+) s: forward \+ backward on the GPU \S+ s, CPU optimizer step (\S+) s",
                ("step", "cpu_step")))),
    Claim("001", "1", "Offload slows training by 30-50%.", "partly",
          "on one H200 with the Qwen2.5-3B shape and the same 32,768 tokens per optimizer step (chapter 9's run m), "
          "labs with the optimizer offloaded ran at {kept} of its speed without ({with_tps} against {without_tps} "
          "tokens/s per GPU; 8 x 1 sequences with offload, 4 x 2 without, where 8 x 1 does not fit): {lost} of the "
          "throughput lost, {range} read that way, and each step took {time}x as long. For the 7B on one H200 "
          "no run without offload was recorded, and the bound chapter 3's run (ZeRO-3, optimizer offloaded) gives is "
          "a larger cost: its step took {ratio} x its GPU part, and for offload to cost only 50% a GPU optimizer "
          "step over the whole model would have to take {needed} s, where two H200s stepped their halves in "
          "{half} s.",
          "{kept} of the speed without offload (3B, run m); 7B: step = {ratio} x its GPU part",
          (Computed(offload_cost_run_m, ("kept", "lost", "time", "with_tps", "without_tps", "range"),
                    See(CH9, RUN_M)),
           Read(CH3, STEP_COST, r"the step takes (\S+) x its GPU part", ("ratio",)),
           Read(CH3, STEP_COST,
                r"of the model\): (\S+) s;\s+for offload to cost only 50%.*? would have to take (\S+) s",
                ("half", "needed")))),
    Claim("001", "1", "Offload needs more CPU memory: 256 GB or more is recommended.", "partly",
          "enough for Qwen-7B: optimizer offload needs {host7} GiB on the node; not for the 70B model its next "
          "section offloads, which needs {host70} TiB with everything offloaded to the CPU.",
          "{host7} GiB (7B), {host70} TiB (70B)",
          (Read(CH3, SCENARIOS, r"^qwen-7b, 4 x RTX3090, ZeRO-3\s+optimizer\s+\S+\.json\s+\S+\s+\S+\s+(\S+)\s*$",
                ("host7",)),
           Read(CH3, SCENARIOS, PINNED_70B, ("host70", "per_param")))),
    Claim("001", "2.2", "With very little GPU memory (one RTX 3090 for a 70B model), ZeRO-3 Offload to the CPU is "
          "the way.", "false",
          "the GPU side would fit, the host side does not: a 70B model with everything offloaded needs {host70} TiB "
          "of host memory ({per_param} bytes per parameter); offload to NVMe is the way (chapter 3).",
          "{host70} TiB of host memory",
          (Read(CH3, SCENARIOS, PINNED_70B, ("host70", "per_param")), See(CH3, "NVMe offload (ZeRO-Infinity)"))),
    Claim("001", "2.1, 2.2", "Its ZeRO-2 and ZeRO-3 Offload files, with `//` comments, are ready to use.", "partly",
          "DeepSpeed's reader (hjson) accepts comments: the ZeRO-2 file {hjson}; Python's json, which the HF "
          "Trainer and accelerate use, stops at the first one with a {json}.", "hjson: {hjson}; json: {json}",
          (Read(CH8, SNIPPETS, r"ZeRO-2 \(2\.1\) read by json \(HF, accelerate\): FAILS: (\w+)", ("json",)),
           Read(CH8, SNIPPETS, r"ZeRO-2 \(2\.1\) read by hjson \(DeepSpeed\): (\w+)", ("hjson",)))),
    Claim("001", "3", "With the HF Trainer nothing in the code changes: pass `deepspeed=\"./ds_config_zero2.json\"` "
          "to `TrainingArguments`.", "false",
          "as written the call stops on the file's comment ({written}); without comments HF still refuses it, "
          "because the file says `{nocomment}` and the arguments do not; it passes with `fp16=True`, on a GPU only.",
          "as written: {written}",
          (Read(CH8, SNIPPETS, r"^as written: FAILS: (\w+)", ("written",)),
           Read(CH8, SNIPPETS, r"comments removed, the same arguments: FAILS: .*?ds (\S+) vs hf", ("nocomment",)))),
    Claim("001", "3", "`accelerate launch --use_deepspeed --zero_stage 2 train.py` runs DeepSpeed without changing "
          "the code.", "partly",
          "without a GPU it asks torchrun for zero processes and stops with a bare {error} (exit code {code}); on "
          "GPUs it starts one process per GPU, but with mixed precision '{precision}' (fp32), and only a script "
          "written for accelerate or the Trainer uses it.",
          "exit code {code} without a GPU; mixed precision '{precision}'",
          (Read(CH8, SNIPPETS, r"train\.py \(no GPU\): FAILS: exit code (\d+), last line: (\w+)", ("code", "error")),
           Read(CH8, SNIPPETS, r"mixed precision '(\w+)'; with PartialState", ("precision",)))),
    Claim("001", "6", "Set `train_batch_size` to \"auto\" in the JSON and let the HF arguments decide, to avoid "
          "conflicts.", "partly",
          "right for HF (its filler set it to {filled} on 2 ranks) and accelerate; DeepSpeed alone stops "
          "on \"auto\" with a {alone}, and every other key with a value must agree with the arguments too.",
          "filled: {filled}; DeepSpeed alone: {alone}",
          (Read(CH8, SNIPPETS, r"through HF's filler on 2 ranks: passes, train_batch_size = (\d+)", ("filled",)),
           Read(CH8, SNIPPETS, r"its autos, straight to DeepSpeed: FAILS: (\w+)", ("alone",)))),
    Claim("001", "4.1", "DeepSpeed's offload is more aggressive; FSDP's is weaker.", "partly",
          "true for choice: FSDP2 offloads all model states to the CPU or none, with no optimizer-only, partial or "
          "NVMe offload; not for host memory: FSDP2's offload needs {fsdp_host} GiB of host memory for Qwen2.5-7B "
          "against {zero_host} GiB for ZeRO-3's optimizer offload.", "{fsdp_host} against {zero_host} GiB on the host",
          (Read(CH7, "Two claims, graded", r"^FSDP2 CPUOffloadPolicy\s+([\d.]+)", ("fsdp_host",)),
           Read(CH7, "Two claims, graded", r"^ZeRO-3 offload optimizer\s+([\d.]+)", ("zero_host",)))),
    Claim("001", "4.2", "FSDP's FULL_SHARD is the same as ZeRO-3.", "true",
          "FULL_SHARD partitions parameters, gradients and optimizer states: each of 2 ranks held a {fsdp} share of "
          "the parameters, as under ZeRO-3 ({zero3}).", "{fsdp} against {zero3}",
          (Read(CH8, SNIPPETS, r"parameter share per rank (\S+), \S+ \(ZeRO-3: (\S+),", ("fsdp", "zero3")),)),
    Claim("001", "4.2", "FSDP through `accelerate config` needs no change to the code.", "partly",
          "only for a script already written for accelerate or the Trainer, and on a machine without a GPU "
          "accelerate ignores FSDP (the route's script had to switch it on itself: {switched}).",
          "switched on by the script: {switched}",
          (Read(CH8, SNIPPETS, r"had to switch FSDP on itself: (\w+)", ("switched",)),)),
    Claim("001", "5.1", "The hostfile mode is the simplest way across machines, and passwordless SSH from the first "
          "machine to the others is required.", "partly",
          "required by DeepSpeed's default (pdsh) launcher, which tests ssh before it starts; DeepSpeed 0.19 also "
          "runs without ssh when every host starts its own runner, which `labs` builds and tests on two emulated "
          "nodes.",
          "the second host's own command carries `{flags}`",
          (See(CH6, "8. The source tutorials' claims"),
           Read(CH6, "1. The launchers you already have", r"(--no_ssh --node_rank=\d+)", ("flags",)))),
    Claim("001", "5.2", "Its two-machine accelerate config (`distributed_type: DEEPSPEED`, `num_machines: 2`, "
          "`num_processes: 16`) trains across both machines.", "false",
          "accelerate hands the start to DeepSpeed's multi-node runner, which needs a hostfile the file does not name "
          "(found: {found}); each machine would train alone, with ZeRO stage {stage} and mixed precision "
          "'{precision}' by default.", "hostfile found: {found}",
          (Read(CH8, SNIPPETS, r"finds the hostfile 'None': (\w+)", ("found",)),
           Read(CH8, SNIPPETS, r"each process: ZeRO stage (\d), optimizer offload '\w+', mixed precision '(\w+)'",
                ("stage", "precision")))),
    Claim("001", "6", "ZeRO-2 is the best value today for multi-GPU fine-tuning.", "partly",
          "on 2 x H200 with the same levers ZeRO-2 beat ZeRO-3 ({z2_tps} against {z3_tps} tokens/s per GPU) at the "
          "same peak ({z2_peak} and {z3_peak} GiB); FSDP2 did better than both ({f_tps} tokens/s, {f_peak} GiB).",
          "{z2_tps} / {z3_tps} / {f_tps} tokens/s (ZeRO-2 / ZeRO-3 / FSDP2)",
          (run_a("labs-zero2", "z2"), run_a("labs-zero3", "z3"), run_a("labs-fsdp2", "f"))),
    Claim("001", "6", "ZeRO-3 is a must for full fine-tuning beyond 13B; if memory runs out, add "
          "`offload_optimizer: cpu`.", "not checkable here",
          "whether a model fits depends on the cards, their number and the batch; chapter 1's calculator answers it "
          "for a given setup.", "", (See(CH1, "The calculator"),)),
    Claim("001", "6", "With ZeRO-3, saving the model is slow because the parameters are gathered from every GPU.",
          "partly",
          "a DeepSpeed checkpoint writes each rank's partition without gathering; only the 16-bit model file gathers "
          "(`stage3_gather_16bit_weights_on_model_save`). What sets the time is the disk: a ZeRO-3 checkpoint of the "
          "Qwen2.5-3B shape ({gb} GB) took {save_s} s to write and flush to disk on one H200 host ({rate} GB/s), so "
          "a Qwen2.5-7B one takes about {s7} s there (projected from that rate, not measured).",
          "3B save: {save_s} s at {rate} GB/s; 7B projected: {s7} s",
          (See(CH5, "Part 3. Getting the model out"),
           Read(CH5, "Part 4. Saving and loading a large checkpoint (GPU)",
                r"checkpoint ([\d.]+) GB[^\n]*\n\s+save ([\d.]+) s \(([\d.]+) GB/s\)[\s\S]*?save about (\d+) s",
                ("gb", "save_s", "rate", "s7")))),
]

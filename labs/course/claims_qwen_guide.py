"""Tutorial "000", a Chinese guide to training Qwen-7B with DeepSpeed ZeRO-3: its checkable claims in our words,
each graded against what a chapter computed (section numbers are the guide's). Every number a verdict quotes is a
`{field}` read from a chapter's stored outputs (`labs.course.sources.Read`) or computed by a named labs function
(`Computed`, which may also decide the verdict); nothing here types a result."""
from __future__ import annotations

from labs.course.source_reads import (CH1, CH2, CH3, CH4, CH5, CH6, CH7, CH8, CH9, SCENARIOS, STAGES_RUN_A, SUMS,
                                      comm_row, guide_batch_keys, qwen7b_states, run_a, scenario_row, stage_row,
                                      stage_speed_order, sums_row, wall_clock_shares)
from labs.course.sources import Claim, Computed, Read, See

TUTORIAL = "000"
# mixed-precision (and fp32) Adam's model states per parameter, the ZeRO paper's count, as chapter 1 prints it
BYTES_PER_PARAM = Read(CH1, "Bytes per parameter, step by step", r"^fp32: paper accounting (\d+) bytes per parameter",
                       ("bytes",))
# chapter 2's ZeRO-2 with `use_multi_rank_bucket_allreduce: false`: each bucket's slices reduced to their owners
TO_OWNER = Read(CH2, "Who reduces to whom: `use_multi_rank_bucket_allreduce`", r"^reduce to owner\s.*\s(\S+)\s*$",
                ("owner",))
CLAIMS = [
    Claim("000", "1", "A 7B model in fp32 needs 26.1 GB of weights, 26.1 GB of gradients and 52.2 GB of Adam states: "
          "104.4 GB.", "partly",
          "the bytes are right ({bytes} per parameter), the unit is not: the tutorial's own code divides by 1024³, "
          "so its figure is in GiB; in GB the same bytes are {gb} GB.", "{gb} GB for 7e9 parameters",
          (sums_row("000", "fp32 params + grads + Adam, no ZeRO", "gb", "_"), BYTES_PER_PARAM)),
    Claim("000", "1", "Activations take 15-20 GB, depending on the batch size.", "not checkable here",
          "no batch size or sequence length is given, and activations grow with both; chapter 1 computes them for any "
          "setting, tensor by tensor.", "", (See(CH1, "Activations, tensor by tensor"),)),
    Claim("000", "1", "Plain data parallelism keeps a full copy of everything on every GPU, so adding GPUs does not "
          "lower the memory each one needs.", "true",
          "at stage 0 each of chapter 2's two ranks held all {params} MiB of the parameters and all {optim} MiB of "
          "Adam's states: the second rank saved no memory on either.",
          "{params} MiB of parameters on each rank: all of them",
          (stage_row(0, "params", "params"), stage_row(0, "optimizer", "optim"))),
    Claim("000", "2.1", "ZeRO-1 partitions the optimizer states, ZeRO-2 the gradients as well, ZeRO-3 the parameters "
          "as well; the memory saved grows from stage to stage.", "true",
          "measured per rank on 2 ranks: optimizer states {o0} MiB at stage 0, {o1} from stage 1; parameters {p0} MiB "
          "up to stage 2, {p3} at stage 3 (gradients: see the chapter, DeepSpeed keeps whole any parameter that "
          "straddles two partitions).", "optimizer {o0} → {o1} MiB; parameters {p0} → {p3} MiB",
          (stage_row(0, "optimizer", "o0"), stage_row(1, "optimizer", "o1"), stage_row(0, "params", "p0"),
           stage_row(3, "params", "p3"))),
    Claim("000", "2.1", "Communication: low for ZeRO-1, medium for ZeRO-2, high for ZeRO-3.", "partly",
          "ZeRO-1 and ZeRO-2 move the same volume (the paper: {paper1} and {paper2} Ψ; DeepSpeed measured {volume1} "
          "and {volume2}, more than the paper because by default it all-reduces each gradient bucket, "
          "`use_multi_rank_bucket_allreduce`, where reducing each slice to its owner would do: {owner} Ψ with the "
          "setting off); only ZeRO-3 adds traffic in the paper's count ({paper3} Ψ), and DeepSpeed measured "
          "{volume3} Ψ on a small model whose gathered parameters stay until backward.",
          "{volume1} / {volume2} / {volume3} Ψ per step measured (paper {paper1} / {paper2} / {paper3})",
          (comm_row(1), comm_row(2), comm_row(3), TO_OWNER)),
    Claim("000", "2.2", "ZeRO-3 gathers parameters before forward, scatters gradients to their owners after backward, "
          "updates each shard locally, then synchronizes the updated parameters globally.", "partly",
          "the first three steps are what ZeRO-3 does ({gathers3} all-gathers, a {scatter3} MB reduce-scatter per "
          "step); the last does not exist: each rank keeps its updated shard, with {allreduce3} MB all-reduced, and "
          "the next forward gathers it.", "{allreduce3} MB of all-reduce at ZeRO-3", (comm_row(3),)),
    Claim("000", "2.2", "ZeRO-3 turns the memory from O(N) into O(1/N), N the number of GPUs.", "partly",
          "what shrinks as 1/N is each GPU's share of the model states (parameters: {p0} MiB per rank at stage 0, "
          "{p3} at stage 3 on 2 ranks); what was O(N) is the total over all GPUs, and activations do not shrink.",
          "{p0} → {p3} MiB of parameters per rank on 2 ranks",
          (stage_row(0, "params", "p0"), stage_row(3, "params", "p3"))),
    Claim("000", "2.2", "Qwen-7B under ZeRO-3 on 4 GPUs stores about 42 GB per card instead of 120 GB.", "false",
          "ZeRO-3 partitions all {bytes} bytes per parameter: for Qwen-7B's {qwen_params} billion parameters that is "
          "{qwen_paper} GB per GPU in the ZeRO paper's count and {qwen_ds} GB by DeepSpeed's estimator ({paper} and "
          "{ds} GB for the 7e9 parameters the guide assumes in its section 1); 42 GB is the other tutorial's ZeRO-1 "
          "figure. Nor is 120 GB the guide's own unpartitioned total, which its code prints as {own} \"GB\" (in GiB, "
          "as the first claim above says): it is the ZeRO paper's example, a 7.5B model without ZeRO ({table} GB).",
          "{qwen_paper} GB (paper), {qwen_ds} GB (DeepSpeed's estimator) for Qwen-7B",
          (Computed(qwen7b_states, ("qwen_params", "qwen_paper", "qwen_ds"), See(CH1, SUMS)),
           sums_row("000", "ZeRO-3 on 4 GPUs, per GPU", "paper", "ds"), BYTES_PER_PARAM,
           Read(CH1, SUMS, r"^Qwen-7B base memory: (\S+?)GB", ("own",)),
           Read(CH1, "The paper's Table 1, and DeepSpeed's own accounting", r"^\s*1\s+(\S+)\s", ("table",)))),
    Claim("000", "3.1", "The minimum setup is 2 x A100 80 GB with ZeRO-3.", "partly",
          "2 x 80 GB does train it (capped at 80 GB on 2 H200s, stock ZeRO-3 with full checkpointing peaked at "
          "{peak} GiB), but it is no minimum: with the optimizer offloaded, labs.memory puts one 24 GB card at "
          "{one_gpu} GiB (fits a 24 GB card: {one_fits}), given {one_host} GiB of host memory.",
          "{peak} GiB measured under an 80 GB cap; {one_gpu} GiB predicted on 1 x 24 GB with offload",
          (Read(CH9, "The cards users have: an 80 GB budget", r"^stock-zero3-ckfull-mb1-ga8\s+\S+\s+\S+\s+\S+\s+(\S+)",
                ("peak",)), scenario_row("qwen-7b, 1 x RTX3090, ZeRO-3", "optimizer", "one"))),
    Claim("000", "3.1", "Consumer cards (4 x RTX 3090 24 GB) need CPU offload.", "true",
          "at micro-batch 1, sequence 2048 and full checkpointing, ZeRO-3 alone peaks at {none_gpu} GiB per GPU "
          "(fits a 24 GB card: {none_fits}); with the optimizer offloaded, {opt_gpu} GiB (fits: {opt_fits}).",
          "{none_gpu} GiB without offload, {opt_gpu} GiB with it",
          (scenario_row("qwen-7b, 4 x RTX3090, ZeRO-3", "none", "none"),
           scenario_row("qwen-7b, 4 x RTX3090, ZeRO-3", "optimizer", "opt"))),
    Claim("000", "3.1", "4 x A100 40 GB with ZeRO-3 is the recommended setup.", "not checkable here",
          "no chapter computes a 40 GB card; the nearest number is chapter 3's ZeRO-3 peak on 4 GPUs without offload.",
          "", (See(CH3, SCENARIOS),)),
    Claim("000", "3.2", "Its `ds_config.json` (`train_batch_size` 8 with `gradient_accumulation_steps` 4) serves the "
          "setups it recommends.", "partly",
          "on 2 GPUs (its minimum setup) the batch leaves a micro-batch of {two_micro} sequence per GPU and "
          "DeepSpeed's own config class says: {two}; on the 4 GPUs of its recommended and development setups it "
          "would leave {four_micro}, and DeepSpeed refuses it: {four}.",
          "micro-batch per GPU: {two_micro} on 2 GPUs, {four_micro} on 4",
          (Computed(guide_batch_keys, ("two", "four", "two_micro", "four_micro"), See(CH8, "Keys that must agree")),)),
    Claim("000", "3.3, 4.1", "With `config.gradient_checkpointing = True` set before `from_pretrained`, its training "
          "loop trains with activation checkpointing.", "false",
          "the key set before building does switch it on (a train-mode layer keeps {train} of its activations), but "
          "Hugging Face checkpoints only in training mode and the loop never calls `model_engine.train()`: in eval "
          "mode the layer keeps {eval}.", "{train} kept in train mode, {eval} in eval mode",
          (Read(CH5, "Hugging Face's switches", r"^config\.gradient_checkpointing = True, then build\s+train\s+\S+\s+"
                r"\S+\s+(\S+)", ("train",)),
           Read(CH5, "Hugging Face's switches", r"^config\.gradient_checkpointing = True, then build\s+eval\s+\S+\s+"
                r"\S+\s+(\S+)", ("eval",)))),
    Claim("000", "4.1", "Gradient checkpointing cuts activation memory by 30-50%.", "false",
          "it cuts far more: for Qwen-7B what forward keeps falls by {kept}, and the activation peak (the stock "
          "loss's backward) by {peak}.", "{kept} less kept, {peak} lower activation peak",
          (Read(CH5, "The seeds' claims, graded", r"none -> full checkpointing: (\S+) less", ("kept",)),
           Read(CH5, "The seeds' claims, graded", r"stock HF loss\): (\S+) less", ("peak",)))),
    Claim("000", "4.2", "fp16 with tensor cores uses about 50% less GPU memory.", "partly",
          "only the 2-byte tensors halve (activations: {acts}); the model states shrink by a fifth under ZeRO and not "
          "at all without it, so the predicted peak is about a third lower than fp32's, not half: {peak} on a setup "
          "where fp32 is predicted to fit by less than labs.memory's own error. Against bf16, fp16 saves nothing "
          "(measured peak allocated: {vs_bf16}).",
          "{peak} against fp32 (predicted); {vs_bf16} against bf16 (measured)",
          (Read(CH4, "6. The seed's claims, graded", r"predicted peak\s+8 layers checkpointed in both\s+(\d+% less)",
                ("peak",)),
           Read(CH4, "6. The seed's claims, graded", r"predicted activations\s+run e's\s+(\d+% less)", ("acts",)),
           Read(CH4, "6. The seed's claims, graded", r"measured peak allocated\s+run e\s+(the same|\d+% \w+)",
                ("vs_bf16",)))),
    Claim("000", "4.2", "fp16 with tensor cores trains 2-3x faster.", "not checkable here",
          "the claim compares with fp32 training, which was never measured on a GPU here; against bf16 fp16 runs at "
          "{vs_bf16} the speed on H200.", "{vs_bf16} (fp16 against bf16)",
          (Read(CH4, "6. The seed's claims, graded", r"measured tokens/s per GPU in run e: (\S+)", ("vs_bf16",)),)),
    Claim("000", "4.3", "`wall_clock_breakdown: true` shows where a step's time goes, for example forward 45%, "
          "backward 35%, optimization 10%, communication 8%, idle 2%.", "partly",
          "the switch exists, but DeepSpeed reports milliseconds per timer (forward, backward and its gradient "
          "reduction, optimizer step), with no idle line; and the example's shares are not what a measured step "
          "shows: ZeRO-3 on {gpus} x {gpu} (chapter 9's run a) spent {fwd} in forward, {bwd} in backward and {step} "
          "in the optimizer step, as shares of the three timers' sum.",
          "forward {fwd}, backward {bwd}, step {step} (measured)",
          (Computed(wall_clock_shares, ("fwd", "bwd", "step", "gpus", "gpu"), See(CH9, "What is measured, and how")),)),
    Claim("000", "5.1", "Against out-of-memory errors: offload to the CPU, or use a lighter optimizer such as "
          "Adafactor instead of Adam.", "true",
          "both lower memory: optimizer offload takes a 4 x 24 GB ZeRO-3 peak from {none_gpu} to {opt_gpu} GiB; "
          "Adafactor takes Qwen2.5-7B's model states from {adam} GB to {adafactor} GB, still more than a 24 GB card "
          "holds.",
          "{none_gpu} → {opt_gpu} GiB (offload); {adam} → {adafactor} GB (Adafactor)",
          (scenario_row("qwen-7b, 4 x RTX3090, ZeRO-3", "none", "none"),
           scenario_row("qwen-7b, 4 x RTX3090, ZeRO-3", "optimizer", "opt"),
           Read(CH1, "Bytes per parameter, step by step", r"^adamw\s+\S+\s+(\S+)", ("adam",)),
           Read(CH1, "Bytes per parameter, step by step", r"^adafactor\s+\S+\s+(\S+)", ("adafactor",)))),
    Claim("000", "5.2", "A hostfile `worker-1 slots=4` / `worker-2 slots=4` with `deepspeed --hostfile=hostfile "
          "--num_gpus 4` trains on both machines.", "true",
          "DeepSpeed's own runner functions turn it into {ranks} ranks, every listed slot of both hosts.",
          "{ranks} ranks",
          (Read(CH6, "8. The source tutorials' claims", r"-> (\d+) ranks", ("ranks",)),)),
    Claim("000", "5.3", "ZeRO-3 can hurt convergence: raise the batch size, lower the learning rate, warm up longer.",
          "false",
          "ZeRO-3 changes where the states live, not the update. In fp32 on 2 CPU ranks, chapter 2's ZeRO-3 losses "
          "stayed within 1e-5 of ZeRO-0's at every step ({same}); in bf16, chapter 7's check, whether a run's "
          "losses stay within bf16 rounding of ZeRO-3's, gave {fsdp} for FSDP2's FULL_SHARD and {zero2} for "
          "DeepSpeed's ZeRO-2. On H200 ZeRO-3's first loss differed ({z3_first} against ZeRO-1's {z1_first}: no cell "
          "compares the weights, so the cause is not shown), and measured from its own first loss it fell as far by step 7 as ZeRO-1 and "
          "ZeRO-2 ({z1_fall}, {z2_fall} and {z3_fall} of FSDP2's fall); what separates those curves from FSDP2's "
          "follows whether the master weights start on the bf16 grid at a learning rate below bf16's resolution "
          "(chapter 7's probe), not the ZeRO stage.",
          "ZeRO-3 within 1e-5 of ZeRO-0 (fp32): {same}; fall by step 7 against FSDP2's: {z1_fall} / {z2_fall} / "
          "{z3_fall} (ZeRO-1 / 2 / 3)",
          (Read(CH2, "Same math", r"^ZeRO-3 vs ZeRO-0: largest \|loss difference\| over \d+ steps <= 1e-5: (\w+)",
                ("same",)),
           Read(CH7, "Two claims, graded", r"^full shard / fsdp2\s.*?: (\w+)", ("fsdp",)),
           Read(CH7, "Two claims, graded", r"^shard grads \+ optimizer / deepspeed\s.*?: (\w+)", ("zero2",)),
           Read(CH7, "Two claims, graded", r"labs-zero1\s+first loss (\S+),", ("z1_first",)),
           Read(CH7, "Two claims, graded", r"labs-zero3\s+first loss (\S+),", ("z3_first",)),
           *(Read(CH7, "The loss gap on the GPU", rf"^labs-zero{stage}\s.*\s(\S+)\s*$", (f"z{stage}_fall",))
             for stage in (1, 2, 3)))),
    Claim("000", "6.1", "On 4 x RTX 3090, plain fp32 training does not fit, but fp16 with gradient checkpointing "
          "trains a 7B model at 22 GB per GPU (the row names no ZeRO stage, where the rows below it name ZeRO-3 "
          "Offload: the course reads it as without ZeRO).", "false",
          "the first half holds and the second cannot, read as without ZeRO: then every GPU holds all model states, "
          "{states} GiB for Qwen-7B's {params} billion parameters in either precision, before any activation (fits "
          "a 24 GB card: {fits}).",
          "{states} GiB of model states per GPU",
          (Read(CH5, "The seeds' claims, graded", r"x (\S+) B parameters = (\d+) GiB$", ("params", "states")),
           Read(CH5, "The seeds' claims, graded", r"fits a 24 GB RTX 3090: (\w+)", ("fits",)))),
    Claim("000", "6.1", "On 4 x RTX 3090, ZeRO-3 with offload trains at 18 GB per GPU and 120 s per iteration.",
          "partly",
          "it fits: labs.memory predicts {opt_gpu} GiB per GPU at micro-batch 1 and sequence 2048; the 18 GB and the "
          "speed depend on a batch the tutorial does not state, and no 3090 was measured.",
          "{opt_gpu} GiB per GPU (predicted, smallest batch)",
          (scenario_row("qwen-7b, 4 x RTX3090, ZeRO-3", "optimizer", "opt"),)),
    Claim("000", "6.2", "On 2 x A100 80 GB, ZeRO-1 uses 94 GB per GPU.", "false",
          "a card of 80 GB cannot report 94 GB, and the run cannot fit one: Qwen-7B's model states alone are {paper} "
          "GB (paper) or {ds} GB (DeepSpeed's rules, as labs extends them to ZeRO-1) per GPU under ZeRO-1 on 2 GPUs, "
          "and even one sequence of "
          "{tokens} tokens with every layer checkpointed peaks at {peak} GiB, against {usable} GiB usable on an "
          "A100-80GB.", "{peak} GiB peak against {usable} GiB usable",
          (Read(CH1, SUMS, r"ZeRO-1 on 2 GPUs: model states alone (\S+) GB \(paper\), (\S+) GB", ("paper", "ds")),
           Read(CH1, SUMS, r"peak at micro-batch 1 x (\d+) tokens, every layer checkpointed: (\S+) GiB at \S+, "
                r"against (\S+) GiB usable", ("tokens", "peak", "usable")))),
    Claim("000", "6.2", "From ZeRO-1 to ZeRO-3 the memory falls (94, 81, 68 GB) and the speed falls a little (980, "
          "950, 900 tokens/s).", "partly",
          "{held} of the four falls the table shows held on 2 x H200 with the same levers, counting two figures "
          "within {tie} of each other as a tie: speed {z1_tps}, {z2_tps} and {z3_tps} tokens/s per GPU ({speed}); "
          "peak memory {z1_peak}, {z2_peak} and {z3_peak} GiB ({memory}).",
          "speed: {speed}; peak memory: {memory}",
          (run_a("labs-zero1", "z1"), run_a("labs-zero2", "z2"), run_a("labs-zero3", "z3"),
           Computed(stage_speed_order, ("speed", "memory", "held", "tie"), See(CH9, STAGES_RUN_A)))),
    Claim("000", "6.2", "ZeRO-3 in fp16 needs 42 GB and trains at 1600 tokens/s, against 68 GB and 900 for ZeRO-3.",
          "not checkable here",
          "the baseline's precision is not stated (fp32 was never measured on a GPU here); against bf16, fp16 "
          "trained at {fp16_tps} against {bf16_tps} tokens/s with the same peak, {fp16_peak} GiB.",
          "{fp16_tps} against {bf16_tps} tokens/s (fp16 against bf16)",
          (Read(CH9, "fp16 versus bf16, and the rejected lever", r"^labs-zero3\s+bf16\s+(\S+)", ("bf16_tps",)),
           Read(CH9, "fp16 versus bf16, and the rejected lever", r"^labs-zero3-fp16\s+fp16\s+(\S+)\s+\S+\s+(\S+)",
                ("fp16_tps", "fp16_peak")))),
    Claim("000", "7", "ZeRO++ brings quantized communication, hierarchical parameter management (smarter CPU/GPU "
          "scheduling) and asynchronous updates.", "partly",
          "one of three holds: DeepSpeed's config lists quantized weights and gradients ({quantized}, {gradients}) "
          "and hpZ ({hpz}), a secondary parameter partition in GPU memory, not CPU/GPU scheduling; there is no "
          "asynchronous "
          "update.", "ZeRO++'s keys: {hpz}, {quantized}, {gradients}",
          (Read(CH6, "8. The source tutorials' claims", r"^(zero_hpz_partition_size)\s", ("hpz",)),
           Read(CH6, "8. The source tutorials' claims", r"^(zero_quantized_weights)\s", ("quantized",)),
           Read(CH6, "8. The source tutorials' claims", r"^(zero_quantized_gradients)\s", ("gradients",)))),
]

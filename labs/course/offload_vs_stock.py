"""Chapter 10's 7B row with labs' copy against stock's offload setups on the same card, at the same 32,768 tokens per
optimizer step: the rounds of stock_search.ROUNDS (results/gpu/one_card_7b_1xh100, one machine each; their list in
prose: offload_verdict.rounds_text), each with stock's setups and
labs' row on one host; labs.course.stock_search says which stock setups fit and reads the runs. With round 31's A/B
(labs.course.offload_copy_report), what chapter 10 shows; the target's verdict and the recipe are
labs.course.offload_verdict's.

    offload_vs_stock.stock_best()     # every run, each round's ratio, the deciding round, and labs' own 2 x 4 losses
    offload_vs_stock.loss_gaps()      # the loss gaps between pairs of runs that isolate one difference
    offload_vs_stock.table(), .losses(), .lines(), .plot()   # chapter 10's cells
"""
from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import torch

from labs import data
from labs.course import stock_search
from labs.course.offload_copy_report import copy_ab, default_run, run
from labs.course.one_card_runs import H100, H200, cpu_model, host_lines, out_of_memory_lines, round_parts
from labs.table import Table


def stock_best() -> dict:
    """Every round against stock (stock_search.ROUNDS): every run; labs' row as the latest round ran it and the rounds
    that ran that row (judged; earlier rounds ran an earlier row); the deciding round, the judged round where labs'
    slower run over stock's fastest is smallest; in it, labs' mean over the mean of stock's runs of its fastest setup
    (the same allocator setting too).
    Also labs' own 2 x 4 of round 26 (capped H200), whose losses stock's 2 x 4 follows."""
    found = stock_search.rounds()
    row = stock_search.latest_row(found)
    judged = [n for n in found if found[n]["row"] == row]
    deciding = min(judged, key=lambda n: found[n]["ratio"])
    here = found[deciding]
    best = here["best"]
    same_setup = [r for r in here["stock"] if (r["batch"], r["offloaded"], r["sub_group_size"], r["allocator"]) ==
                  (best["batch"], best["offloaded"], best["sub_group_size"], best["allocator"])]
    mean = lambda runs: sum(r["tokens_per_s"] for r in runs) / len(runs)
    return dict(rounds=found, row=row, judged=judged, deciding=deciding,
                stock=[r for f in found.values() for r in f["stock"]],
                labs=[r for f in found.values() for r in f["labs"]], best=best, labs_slower=here["labs_slower"],
                conservative=here["ratio"], of_means=mean(here["labs"]) / mean(same_setup),
                labs_2x4_losses=run(H200 / "z3off70_7b_2x4")["losses"])


def loss_gaps(found: dict | None = None, ab: dict | None = None) -> dict[str, float]:
    """Per-step loss gaps (the largest over the 6 steps): labs' 8 x 1 against stock's 4 x 2 and stock's 2 x 4 against
    labs' own 2 x 4 of round 26 (pairs whose losses agree although engines or copies differ), round 31's labs copy
    against its DeepSpeed copies (the copy alone), labs' overlapped copy against the same row waiting after each
    sub-group (the overlap alone, round 37), and labs' 8 x 1 against stock's best at the last step."""
    found = found or stock_best()
    labs_runs = found["labs"]
    stock_4x2 = [r for r in found["stock"] if r["batch"] == "4 x 2"]
    stock_2x4 = [r for r in found["stock"] if r["batch"] == "2 x 4"]
    gap = lambda a, b: max(abs(x - y) for x, y in zip(a, b, strict=True))
    copies = (ab or copy_ab())["runs"]
    return dict(labs_vs_stock_4x2=max(gap(a["losses"], b["losses"]) for a in labs_runs for b in stock_4x2),
                stock_vs_labs_2x4=max(gap(r["losses"], found["labs_2x4_losses"]) for r in stock_2x4),
                copy_alone=max(gap(copies["labs_copy"]["losses"], copies[n]["losses"])
                               for n in ("ds_copy", "ds_copy_again")),
                overlap_alone=max(gap(a["losses"], b["losses"]) for f in found["rounds"].values()
                                  for a in f["labs"] + f["others"] for b in f["others"]
                                  if (a["copy"], b["copy"]) == ("labs' overlapped", "labs'")
                                  and (a["offloaded_params"], a["checkpointed"]) ==
                                  (b["offloaded_params"], b["checkpointed"])),
                against_best_last=max(abs(r["losses"][-1] - found["best"]["losses"][-1]) for r in labs_runs))


def table(found: dict | None = None, ab: dict | None = None) -> Table:
    """Round 31's runs and those of the rounds against stock as chapter 10 shows them, round by round."""
    found, ab = found or stock_best(), ab or copy_ab()
    rows = [dict(r, round="31") for r in ab["runs"].values()] + [
        r for f in found["rounds"].values() for r in f["stock"] + f["labs"] + f["others"]]
    columns = ["round", "run", "side, copy", "batch", "params offloaded (ratio, sub_group_size)", "checkpointed",
               "tokens/s", "MFU (causal)", "GPU peak measured, predicted (GiB)", "fwd + bwd (s)", "optimizer step (s)"]
    return Table([{"round": r["round"], "run": r["run"], "side, copy": f"{r['side']}, {r['copy']}", "batch": r["batch"],
                   "params offloaded (ratio, sub_group_size)": (
                       f"{r['offloaded_params']:.1%} ({r['offloaded']:.0%}, "
                       f"{stock_search.sub_groups_text(r['sub_group_size'])})"),
                   "checkpointed": r["checkpointed"], "tokens/s": f"{r['tokens_per_s']:,.0f}",
                   "MFU (causal)": f"{r['mfu']:.1%} ({r['mfu_causal']:.1%})",
                   "GPU peak measured, predicted (GiB)": f"{r['gpu_gib']:.2f}, {r['predicted_gpu_gib']:.2f}",
                   "fwd + bwd (s)": f"{r['fwd_s'] + r['bwd_s']:.2f}",
                   "optimizer step (s)": f"{r['optimizer_step_s']:.2f}"} for r in rows], columns)


def losses(found: dict | None = None, ab: dict | None = None) -> Table:
    """The loss at every step of every run of rounds 31-38, and of labs' 2 x 4 of round 26 (capped H200)."""
    found, ab = found or stock_best(), ab or copy_ab()
    runs = sorted([(f"31 {r['run']}", r) for r in ab["runs"].values()] + [("33 default_copy", default_run())] +
                  [(f"{r['round']} {r['run']}", r) for f in found["rounds"].values()
                   for r in f["stock"] + f["labs"] + f["others"]],
                  key=lambda named: int(named[0].split()[0]))       # round by round, each in the order it ran
    rows = [dict({"run": name, "side, batch": f"{r['side']} {r['batch']}"},
                 **{f"step {i}": f"{x:.3f}" for i, x in enumerate(r["losses"], 1)}) for name, r in runs]
    rows.append(dict({"run": "26 z3off70_7b_2x4", "side, batch": "labs 2 x 4"},
                     **{f"step {i}": f"{x:.3f}" for i, x in enumerate(found["labs_2x4_losses"], 1)}))
    return Table(rows, ["run", "side, batch"] + [f"step {i}" for i in range(1, 7)])


def corpus_sequences(seq_len: int = 4096) -> int:
    """How many sequences of seq_len tokens the default corpus packs into (the runs' data)."""
    return data.pack(data.corpus_tokens(None), seq_len).shape[0]


def step_sequences(micro_batch: int, grad_accum: int, step: int, seq_len: int = 4096) -> list[int]:
    """Which sequences of the default corpus (the runs' data) an optimizer step trains on at a split, as labs.data deals
    them to one rank with seed 0: the split changes a step's sequences only where an epoch ends inside the step."""
    batches = data.rank_batches(torch.arange(corpus_sequences(seq_len)).view(-1, 1), micro_batch, 0, 1, 0)
    taken = list(itertools.islice(batches, grad_accum * step))[grad_accum * (step - 1):]
    return sorted(int(i) for batch in taken for i in batch.view(-1))


def lines(ab: dict | None = None, found: dict | None = None) -> list[str]:
    """What chapter 10 prints: round 31's A/B, the copy's parts and exercise 10.5's prediction, the rounds against
    stock (stock_search.lines), the losses, and round 33's default."""
    ab, found = ab or copy_ab(), found or stock_best()
    runs, scaled, per = ab["runs"], ab["scaled"], ab["per_1e9"]
    default = default_run()
    return [
        f"round 31 (one H100 host, CPU model {ab['cpu_model']}), labs' 7B row three times in a row: " + "; ".join(
            f"{r['copy']} copy {r['tokens_per_s']:,.0f} tokens/s, optimizer step {r['optimizer_step_s']:.2f} s"
            for r in runs.values()) + f": labs' copy {min(ab['speedups']):.2f}-{max(ab['speedups']):.2f}x, its "
        f"optimizer step {min(ab['step_saved_s']):.2f}-{max(ab['step_saved_s']):.2f} s shorter (exercise 10.5's "
        f"reasoning from round 29's parts: {ab['predicted_saving_s']:.2f} s)",
        f"the copy's parts there, scaled to the {ab['offloaded_params'] / 1e9:.2f} B offloaded parameters: "
        f"DeepSpeed's cast copy from the pageable masters {scaled['copy_to_gpu_bf16_pageable']:.2f} s (from a "
        f"page-locked master {scaled['copy_to_gpu_bf16']:.2f} s), of which the cast on the host alone "
        f"{scaled['cast_on_host']:.2f} s; fp32 uncast from pageable "
        f"{scaled['copy_to_gpu_fp32_pageable']:.2f} s ({ab['pageable_gb_s']:.1f} GB/s), from page-locked "
        f"{scaled['copy_to_gpu_fp32_registered']:.2f} s ({ab['locked_gb_s']:.1f} GB/s) after page-locking once "
        f"({scaled['register']:.2f} s); CPU Adam {scaled['cpu_adam']:.2f} s",
        f"DeepSpeed's cast copy as two halves, per 10^9 parameters: the cast on the host {per['cast_on_host']:.3f} s, "
        f"then its bf16 result, a pageable temporary, crossing at the pageable rate "
        f"{per['copy_to_gpu_fp32_pageable'] / 2:.3f} s: {ab['cast_then_cross_s']:.3f} s, against "
        f"{per['copy_to_gpu_bf16_pageable']:.3f} s timed whole from a pageable master and "
        f"{per['copy_to_gpu_bf16']:.3f} s "
        "from a page-locked one",
        *stock_search.lines(found["rounds"]), *estimates_checked(found["rounds"]),
        f"deciding: round {found['deciding']}, labs over stock {found['conservative']:.3f}x"
        + (" (one run each)" if len(found["rounds"][found["deciding"]]["labs"]) == 1 ==
           len(found["rounds"][found["deciding"]]["stock"]) else
           f" (labs' slower run over stock's fastest; mean against mean {found['of_means']:.2f}x)"),
        "largest loss gap over the 6 steps: labs' copy against DeepSpeed's (round 31) {copy_alone:.3f}; labs' "
        "overlapped copy against the same row waiting after each sub-group (rounds 37-39) {overlap_alone:.3f}; "
        "labs 8 x 1 against stock 4 x 2 {labs_vs_stock_4x2:.3f}; stock 2 x 4 against labs' own 2 x 4 (round 26) "
        "{stock_vs_labs_2x4:.3f} nats".format(**loss_gaps(found, ab)),
        f"step 4's sequences (labs.data, the default corpus: {corpus_sequences()} sequences of 4,096 tokens): "
        + "; ".join(
            f"{m} x {g}: {step_sequences(m, g, 4)}" for m, g in ((8, 1), (4, 2), (2, 4), (1, 8))),
        *host_lines(found), *out_of_memory_lines(), parts_line(),
        f"round 33 (a third machine, CPU model {default['cpu_model']}), the committed default with "
        f"LABS_OFFLOAD_COPY {default['variable'] or 'unset'}: recorded copy '{default['recorded_copy']}', "
        f"{default['tokens_per_s']:,.0f} tokens/s, optimizer step {default['optimizer_step_s']:.2f} s"]


def estimates_checked(rounds: dict) -> list[str]:
    """Each stock estimate (stock_search.unrun) that a later round replaced with a run: the estimate made from the
    rounds before it against the run."""
    out, names = [], list(rounds)
    for i, n in enumerate(names[1:], 1):
        before = {m: rounds[m] for m in names[:i]}
        if not all(stock_search.ran_at(cell, before) for cell in stock_search.grid() if cell["fits"]):
            continue      # a cell no round had run yet has no run to estimate from
        now = {(u["batch"], u["checkpointed"]) for u in stock_search.unrun({m: rounds[m] for m in names[:i + 1]})}
        for u in stock_search.unrun(before):
            ran = stock_search.ran_at(u, {n: rounds[n]})
            if (u["batch"], u["checkpointed"]) not in now and ran:
                out.append(f"estimate replaced by round {n}'s run: {u['batch']}, checkpointing {u['checkpointed']} at "
                           f"{u['offloaded_params']:.1%} offloaded, estimated {u['estimated_tokens_per_s']:,.0f} "
                           f"tokens/s (from {u['estimated_from']}), ran {ran[0]['tokens_per_s']:,.0f} "
                           f"({ran[0]['tokens_per_s'] / u['estimated_tokens_per_s'] - 1:+.1%})"
                           + (f" with {ran[0]['allocator']}" if ran[0]["allocator"] else ""))
    return out


def parts_line() -> str:
    """The optimizer step's parts per 10^9 parameters (tools/offload_step_parts.py) on five hosts: rounds 31, 38, 41
    and 42 (one CPU model), round 39 (another). The host moves CPU Adam's own step and DeepSpeed's cast copy, which
    labs' copy replaces, not the copy from page-locked memory."""
    parts = {n: round_parts(n) for n in ("31", "38", "39", "41", "42")}
    return "the step's parts per 10^9 parameters, " + "; ".join(
        f"round {n} (CPU model {cpu_model(H100 / f'round{n}' / 'cpu.txt')}): CPU Adam {p['cpu_adam_s']:.3f} s, "
        f"unscaling the gradients {p['grad_mul_s']:.3f} s, fp32 from page-locked to the GPU "
        f"{p['copy_to_gpu_fp32_registered_s']:.3f} s, DeepSpeed's cast copy from a pageable master (stock's) "
        f"{p['copy_to_gpu_bf16_pageable_s']:.3f} s" for n, p in parts.items())


def plot(ab: dict | None = None, found: dict | None = None, ax=None):
    """Tokens/s of every run: round 31's labs row with DeepSpeed's copy and with labs' on one host, then each round
    against stock (one machine each): stock's setups (the share of parameters offloaded, checkpointing) and labs' row
    with its copy, with a dashed line at 1.5x the round's fastest stock run."""
    ab, found = ab or copy_ab(), found or stock_best()
    # one line per bar, turned upright below: side, split, share offloaded, layers checkpointed (and labs' copy)
    groups = [("round 31", [(f"labs 8x1, {r['copy']} copy", r["tokens_per_s"], "C9" if r["copy"] == "labs'"
                             else "C7") for r in ab["runs"].values()], None)]
    for n, f in found["rounds"].items():
        groups.append((f"round {n}", [(f"stock {r['batch'].replace(' x ', 'x')}, {r['offloaded_params']:.0%}, "
                                       f"ck {r['checkpointed']}" + (", exp. segments" if r["allocator"] else ""),
                                       r["tokens_per_s"], "C1") for r in f["stock"]] +
                       [(f"labs 8x1, {r['offloaded_params']:.0%}, ck {r['checkpointed']}"
                         + (", overlapped" if r["copy"] == "labs' overlapped" else ""), r["tokens_per_s"],
                         "C0" if r["copy"] == "labs' overlapped" else "C9") for r in f["labs"] + f["others"]],
                       1.5 * f["best"]["tokens_per_s"]))
    ax = ax or plt.subplots(figsize=(19, 5))[1]
    top = max(value for _, bars, _ in groups for _, value, _ in bars) * 1.2
    i = 0
    for name, bars, target_line in groups:
        ax.text(i + (len(bars) - 1) / 2, top, name, ha="center", fontsize=9)
        if target_line:     # 1.5x stock's fastest run of the round: the target labs' runs are judged against
            ax.hlines(target_line, i - 0.45, i + len(bars) - 0.55, colors="black", linestyles="dashed", linewidth=0.8)
        for label, value, color in bars:
            ax.bar(i, value, color=color, width=0.7)
            ax.text(i, value + 60, f"{value:,.0f}", ha="center", fontsize=6.5, rotation=90, va="bottom")
            i += 1
        if name != groups[-1][0]:
            ax.axvline(i - 0.5, color="black", linewidth=0.8)
    ax.set_xlim(-0.6, i - 0.4)
    ax.set_ylim(0, top * 1.08)
    ax.set_xticks(range(i), [label for _, bars, _ in groups for label, _, _ in bars], fontsize=7, rotation=90)
    ax.set_ylabel("tokens/s (one H100)")
    ax.set_title("Qwen2.5-7B on one H100, optimizer offloaded, 32,768 tokens per optimizer step (grey: DeepSpeed's "
                 "copy in labs' row; cyan: labs' copy waiting after each sub-group; blue: labs' copy overlapped; "
                 "orange: stock; dashed: 1.5x stock's fastest)", fontsize=8)
    return ax

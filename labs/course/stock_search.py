"""Stock's offload setups for Qwen2.5-7B on one real H100 at chapter 10's 32,768 tokens per optimizer step: every
micro-batch x accumulation split, with and without HF's full checkpointing, and DeepSpeed's two memory levers, the
offloaded share (`offload_optimizer.ratio`, in hundredths) and `sub_group_size`. DeepSpeed offloads whole sub-groups, so
what the CPU works on is the share of the parameters actually offloaded (one_card_runs.offloaded_params), and that is
what the search minimises. labs.memory says which setups fit; the runs (results/gpu/one_card_7b_1xh100) say how fast:

- round 32 (a fresh machine): each split at the smallest setting in tenths predicted to fit, at DeepSpeed's default
  1e9-parameter sub-groups; labs' row twice;
- round 34 (another): 2 x 4 at 65% with 5e8 sub-groups twice, 2 x 4 at 70% and 1 x 8 without checkpointing at 80%;
  labs' row twice;
- round 35 (another): 2 x 4 at 61% with 8e8 sub-groups twice, labs' row between;
- round 36 (another): 2 x 4 at 61% with 2e8 sub-groups, the least stock can offload and fit at its fastest split
  (grid(), once labs.memory counted sub-groups as DeepSpeed does), then labs' row;
- rounds 37 and 38 (two more): labs' 62.2% row (the share stock's best offloads, 27 layers checkpointed, the
  copies overlapped), stock's round-36 setup, and that row waiting after each sub-group's copy (another labs run);
- round 39 (another): the 62.2% row and stock's round-36 setup alternating twice, the row waiting, and labs' 71.4% row
  (25 layers checkpointed) with the overlapped copy twice: faster on that host, so labs' row from then on;
- round 40 (another): that row, then stock's round-36 setup, one run each (the repeats did not fit the device time);
- round 41 (another): the two alternating twice, then the 62.2% row; round 42 (another): the same, then the three
  cells no round had run at their fewest offloaded (4 x 2 out of memory there until expandable segments).

Every ratio divides a labs run by a stock run of the same round: hosts differ (labs' earlier row ran 5,939-6,516
tokens/s across rounds 31-36, printed by lines()).

    stock_search.grid()      # per split and checkpointing: the least offloaded that fits, and the setting for it
    stock_search.rounds()    # each round's runs, stock's fastest and labs' slower, and their ratio
    stock_search.unrun()     # cells not run at their least offloaded, with an estimate each (not a run)
    stock_search.table(), .lines()   # chapter 10's cells
"""
from __future__ import annotations

import functools

from labs import config as config_lib
from labs import memory
from labs.course.offload_copy_report import run
from labs.course.one_card_runs import H100, cpu_model, offloaded_params
from labs.table import Table

STOCK_CONFIG = "bench/stock_zero3_offload.json"
ROUNDS = {   # round: (stock runs, labs' row, other labs runs), each in the order they ran
    "32": (("stock70_mb2", "stock60_mb1", "stock70_mb2_again", "stock80_mb4"), ("labs_copy", "labs_copy_again"), ()),
    "34": (("stock65_sg5", "stock70_mb2", "stock80_mb1_nock", "stock65_sg5_again"), ("labs_copy", "labs_copy_again"),
           ()),
    "35": (("stock61_sg8", "stock61_sg8_again"), ("labs_copy",), ()),
    "36": (("stock61_sg2",), ("labs_copy",), ()),
    # labs' row searched like stock's: 62.2% offloaded, 27 layers checkpointed, the copies overlapped; beside it the
    # same row waiting after each sub-group's copy (LABS_OFFLOAD_COPY=gpu-wait)
    "37": (("stock61_sg2",), ("labs61",), ("labs61_wait",)),
    "38": (("stock61_sg2",), ("labs61",), ("labs61_wait",)),
    # a blind repeat, L S L S, put the 62.2% row at 1.51x and 1.49x; labs' 71.4% row with the overlapped copy, run in
    # the same round, was faster on this host, so it is labs' row from round 39 on (chosen on round 39's runs)
    "39": (("stock61_sg2", "stock61_sg2_again"), ("labs_copy", "labs_copy_again"),
           ("labs61", "labs61_again", "labs61_wait")),
    "40": (("stock61_sg2",), ("labs_copy",), ()),     # that row on another machine, chosen before it ran; one run each
    # the repeats round 40 could not run, on a third machine: L S L S, then the 62.2% row once (not bracketed)
    "41": (("stock61_sg2", "stock61_sg2_again"), ("labs_copy", "labs_copy_again"), ("labs61",)),
    # round 41's jobs on a fourth machine, then the three cells above that had only estimates (unrun), 4 x 2 with
    # expandable segments after it ran out of memory without, and stock's best with them
    "42": (("stock61_sg2", "stock61_sg2_again", "stock45_mb1", "stock74_mb1_nock", "stock74_mb4_exp",
            "stock61_sg2_exp"), ("labs_copy", "labs_copy_again"), ("labs61",)),
}
SPLITS = ((1, 8), (2, 4), (4, 2), (8, 1))
CHECKPOINTING = ("full", "none")
SUB_GROUPS = (2e8, 3e8, 5e8, 8e8, 1e9)          # DeepSpeed's default is 1e9


def sub_groups_text(size: float) -> str:
    """A sub-group size as DeepSpeed's docs write it: 5e8, 1e9."""
    return f"{size:.0e}".replace("e+0", "e")


def stock_config(share: float, sub_group: float) -> dict:
    """bench/stock_zero3_offload.json (stock ZeRO-3 offload, no labs settings) with the share and sub-group size set."""
    ds_config = config_lib.load(STOCK_CONFIG)
    ds_config["zero_optimization"]["offload_optimizer"]["ratio"] = share
    ds_config["zero_optimization"]["sub_group_size"] = int(sub_group)
    return ds_config


def predict(micro_batch: int, grad_accum: int, checkpointing: str, share: float, sub_group: float):
    """labs.memory's prediction for a stock setup of the 7B at 4,096 tokens per sequence (HF loss and kernels)."""
    return memory.estimate("qwen2.5-7b", ds_config=stock_config(share, sub_group), micro_batch=micro_batch,
                           grad_accum=grad_accum, loss="hf", kernels="stock", activation_checkpointing=checkpointing,
                           seq_len=4096)


def host_gib() -> float:
    """The rounds' host memory, `free -g`'s total (125 GiB on every machine of rounds 32-41). The search checks a
    setup's predicted host memory against all of it, which favours stock (chapter 10's recipe asks a tenth more)."""
    totals = {int(next(line for line in (H100 / f"round{n}" / "host_memory.txt").read_text().splitlines()
                       if line.startswith("Mem:")).split()[1]) for n in ROUNDS}
    assert len(totals) == 1, totals
    return float(totals.pop())


def zero2_offload_host_gib() -> dict[str, float]:
    """Stock's other offload, ZeRO-2 with the whole optimizer on the CPU (bench/stock_zero2_offload.json; it takes no
    `ratio`): the host memory labs.memory predicts for the 7B at each split with full checkpointing, the least of it,
    against the rounds' host. It needs the fp32 master, both moments and the fp32 gradients of all 7.6 B parameters
    on the host, so no split fits a 125 GiB host: the search is ZeRO-3's."""
    ds_config = config_lib.load("bench/stock_zero2_offload.json")
    need = {f"{m} x {g}": memory.estimate("qwen2.5-7b", ds_config=ds_config, micro_batch=m, grad_accum=g, loss="hf",
                                          kernels="stock", activation_checkpointing="full",
                                          seq_len=4096).host_per_node_bytes / 2**30 for m, g in SPLITS}
    assert min(need.values()) > host_gib(), "a ZeRO-2 offload split fits the host: the search must include it"
    return dict(least=min(need.values()), host=host_gib(), per_split=need)


@functools.lru_cache(maxsize=None)
def grid() -> tuple[dict, ...]:
    """Per split and checkpointing, the setting (share in hundredths, sub-group size from SUB_GROUPS) that offloads
    the fewest parameters while labs.memory predicts it to fit the usable H100 and the host: the least CPU work (more
    offloaded only adds CPU Adam and copies). Cells where nothing fits carry their smallest GPU peak instead (the
    host is never the limit there)."""
    usable, host = memory.usable_bytes("H100") / 2**30, host_gib()
    cells = []
    for (micro_batch, grad_accum), checkpointing in ((s, c) for s in SPLITS for c in CHECKPOINTING):
        fits = []
        for sub_group in SUB_GROUPS:
            for share in (i / 100 for i in range(101)):
                p = predict(micro_batch, grad_accum, checkpointing, share, sub_group)
                gpu, host_need = p.total_per_gpu_bytes / 2**30, p.host_per_node_bytes / 2**30
                if p.fits("H100") and host_need <= host:
                    fits.append(dict(offloaded=share, sub_group_size=sub_group, gpu_gib=gpu, host_gib=host_need,
                                     offloaded_params=offloaded_params(share, sub_group)))
                    break
        cell = dict(batch=f"{micro_batch} x {grad_accum}", checkpointed=checkpointing, usable_gib=usable,
                    host_limit_gib=host)
        if fits:      # the least offloaded; among equal, the sub-group size nearest DeepSpeed's default
            cell.update(min(fits, key=lambda f: (round(f["offloaded_params"], 4), -f["sub_group_size"])), fits=True)
        else:
            peaks = [predict(micro_batch, grad_accum, checkpointing, 1.0, g).total_per_gpu_bytes for g in SUB_GROUPS]
            cell.update(fits=False, smallest_gpu_gib=min(peaks) / 2**30)
        cells.append(cell)
    return tuple(cells)


def rounds() -> dict[str, dict]:
    """Each round's runs (labs.course.offload_copy_report.run, with the sub-group size), stock's fastest, labs'
    slower run of its row, labs' slower over stock's fastest (the like-for-like ratio, one host, the same tokens per
    step), and which row labs ran (row_of)."""
    found = {}
    for n, (stock_names, labs_names, other_names) in ROUNDS.items():
        folder = H100 / f"round{n}"
        stock, labs_runs, others = ([_run(folder / name, n) for name in names]
                                    for names in (stock_names, labs_names, other_names))
        assert len({r["tokens_per_step"] for r in stock + labs_runs + others}) == 1, "like for like: tokens per step"
        assert len({row_of(r) for r in labs_runs}) == 1, f"round {n}: one row of labs"
        best = max(stock, key=lambda r: r["tokens_per_s"])
        slower = min(labs_runs, key=lambda r: r["tokens_per_s"])
        found[n] = dict(stock=stock, labs=labs_runs, others=others, best=best, labs_slower=slower, row=row_of(slower),
                        cpu_model=cpu_model(folder / "cpu.txt"), ratio=slower["tokens_per_s"] / best["tokens_per_s"])
    return found


def runs_by_row(found: dict) -> dict[str, list[dict]]:
    """Every labs run of every round, labs' row's and those beside it, by its row (row_of), rows in the order they
    first ran and each row's runs round by round."""
    rows = {}
    for f in found.values():
        for r in f["labs"] + f["others"]:
            rows.setdefault(row_of(r), []).append(r)
    return rows


def row_ratios(found: dict) -> dict[str, list[tuple[str, float, int]]]:
    """Per row of labs, every round that ran it (runs_by_row): (round, its slower run over the round's fastest stock
    run, how many runs)."""
    ratios = {}
    for row, runs in runs_by_row(found).items():
        for n in dict.fromkeys(r["round"] for r in runs):
            speeds = [r["tokens_per_s"] for r in runs if r["round"] == n]
            ratios.setdefault(row, []).append((n, min(speeds) / found[n]["best"]["tokens_per_s"], len(speeds)))
    return ratios


def latest_row(found: dict) -> str:
    """labs' row as the latest round ran it: the row the target judges."""
    return found[max(found, key=int)]["row"]


def row_of(run_found: dict) -> str:
    """Which row of labs a run is: its share of parameters offloaded, layers checkpointed and copy."""
    return (f"{run_found['offloaded_params']:.1%} offloaded, {run_found['checkpointed']} layers checkpointed, "
            f"{run_found['copy']} copy")


def _run(run_dir, round_name: str) -> dict:
    """offload_copy_report.run with the round it belongs to."""
    return dict(run(run_dir), round=round_name)


def ran_at(cell: dict, found: dict) -> list[dict]:
    """The stock runs of every round in a grid cell (its split and checkpointing)."""
    return [r for f in found.values() for r in f["stock"]
            if (r["batch"], r["checkpointed"]) == (cell["batch"], cell["checkpointed"])]


def unrun(found: dict | None = None) -> list[dict]:
    """Cells where no round ran as few parameters offloaded as the least that fits (within half a percent), each with
    an estimate (an inference, not a run) from the cell's run with the fewest offloaded: its optimizer step scaled by
    the parameters offloaded (CPU Adam and the copies scale with them), the rest kept. The ratio is labs' slower run of
    that run's round over the estimate."""
    found = found or rounds()
    rows = []
    for cell in grid():
        runs = ran_at(cell, found)
        if not cell["fits"] or any(r["offloaded_params"] <= cell["offloaded_params"] + 0.005 for r in runs):
            continue
        assert runs, f"no run at {cell['batch']}, checkpointing {cell['checkpointed']}"
        nearest = min(runs, key=lambda r: (r["offloaded_params"], -r["tokens_per_s"]))
        step_s = (nearest["tokens_per_step"] / nearest["tokens_per_s"] - nearest["optimizer_step_s"]
                  * (1 - cell["offloaded_params"] / nearest["offloaded_params"]))
        estimate = nearest["tokens_per_step"] / step_s
        rows.append(dict(cell, round=nearest["round"], estimated_from=f"{nearest['round']} {nearest['run']}",
                         estimated_tokens_per_s=estimate,
                         labs_over_estimate=found[nearest["round"]]["labs_slower"]["tokens_per_s"] / estimate))
    return rows


def table(found: dict | None = None) -> Table:
    """The grid as chapter 10 shows it: per split and checkpointing, the setting that offloads the fewest parameters
    and fits (or the smallest peak where none does), the stock runs there round by round, and the estimate where the
    least was not run."""
    found = found or rounds()
    estimates = {(u["batch"], u["checkpointed"]): u for u in unrun(found)}
    rows = []
    for cell in grid():
        estimate = estimates.get((cell["batch"], cell["checkpointed"]))
        ran = "; ".join(f"{r['round']}: {r['offloaded_params']:.1%} {r['tokens_per_s']:,.0f}"
                        + (f" ({r['allocator']})" if r["allocator"] else "") for r in ran_at(cell, found))
        rows.append({"batch": cell["batch"], "checkpointed": cell["checkpointed"],
                     "fewest params offloaded that fit (ratio, sub_group_size)": (
                         f"{cell['offloaded_params']:.1%} ({cell['offloaded']:.0%}, "
                         f"{sub_groups_text(cell['sub_group_size'])})" if cell["fits"] else "none"),
                     "predicted GPU, host (GiB)": (f"{cell['gpu_gib']:.1f}, {cell['host_gib']:.1f}" if cell["fits"]
                                                   else f"GPU {cell['smallest_gpu_gib']:.1f} at 100% "
                                                        f"(over {cell['usable_gib']:.1f})"),
                     "stock runs (round: params offloaded, tokens/s)": ran or "-",
                     "estimate there (not a run): tokens/s, labs' slower run of that round over it": (
                         f"{estimate['estimated_tokens_per_s']:,.0f} (from {estimate['estimated_from']}), "
                         f"{estimate['labs_over_estimate']:.2f}x" if estimate else "-")})
    # the estimate column only while a cell has one (round 42 ran the last three)
    return Table(rows, [c for c in rows[0] if estimates or not c.startswith("estimate there")])


def lines(found: dict | None = None) -> list[str]:
    """The fit limits; each round's ratio on its host; labs' row across machines; the one ratio across machines,
    which is not like for like; and where labs.memory's GPU peak missed a run by more than 0.1 GiB."""
    found = found or rounds()
    cell = grid()[0]
    zero2 = zero2_offload_host_gib()
    out = [f"fits: labs.memory's GPU peak at most {cell['usable_gib']:.1f} GiB (an H100's usable memory) and its host "
           f"memory at most {cell['host_limit_gib']:.0f} GiB (the rounds' hosts); stock's ZeRO-2 offload needs at "
           f"least {zero2['least']:.1f} GiB of host (all 7.6 B parameters' optimizer state on the CPU): it fits no "
           "split, so the search is ZeRO-3's"]
    out += [f"round {n} (CPU model {f['cpu_model']}): stock's fastest {f['best']['tokens_per_s']:,.0f} tokens/s "
            f"({f['best']['run']}: {f['best']['batch']}, {f['best']['offloaded_params']:.1%} of the parameters "
            f"offloaded, checkpointing {f['best']['checkpointed']}); labs' row ({f['row']}) "
            + " and ".join(f"{r['tokens_per_s']:,.0f}" for r in f["labs"]) + f" (optimizer step "
            + " and ".join(f"{r['optimizer_step_s']:.2f}" for r in f["labs"]) + " s): labs' "
            + ("slower run" if len(f["labs"]) > 1 else "run") + f" over stock's "
            + ("fastest" if len(f["stock"]) > 1 else "run") + f" {f['ratio']:.2f}x" + "".join(
                f"; {r['run']} ({row_of(r)}) {r['tokens_per_s']:,.0f} (optimizer step {r['optimizer_step_s']:.2f} s, "
                f"{r['tokens_per_s'] / f['best']['tokens_per_s']:.2f}x)" for r in f["others"])
            for n, f in found.items()]
    by_row = runs_by_row(found)
    for row in dict.fromkeys(f["row"] for f in found.values()):       # the rows that were labs' row of a round
        runs = by_row[row]
        steps, speeds = [r["optimizer_step_s"] for r in runs], [r["tokens_per_s"] for r in runs]
        names = list(dict.fromkeys(r["round"] for r in runs))
        out.append(f"labs' row {row}, in round{'s' if len(names) > 1 else ''} {', '.join(names)} (one machine"
                   f"{' each' if len(names) > 1 else ''}): "
                   f"{_span(speeds, ',.0f')} tokens/s, optimizer step {_span(steps, '.2f')} s")
    latest = latest_row(found)
    labs_runs = [r for f in found.values() if f["row"] == latest for r in f["labs"]]
    stock = max((r for f in found.values() for r in f["stock"]), key=lambda r: r["tokens_per_s"])
    labs_slowest = min(labs_runs, key=lambda r: r["tokens_per_s"])
    out.append(f"across machines, not like for like: labs' row as it stands, its slowest run "
               f"({labs_slowest['tokens_per_s']:,.0f}, "
               f"round {labs_slowest['round']}) over stock's fastest of all ({stock['tokens_per_s']:,.0f}, round "
               f"{stock['round']}): {labs_slowest['tokens_per_s'] / stock['tokens_per_s']:.2f}x")
    missed = [r for f in found.values() for r in f["stock"] + f["labs"] + f["others"]
              if abs(r["gpu_gib"] - r["predicted_gpu_gib"]) > 0.1]
    out.append("labs.memory's GPU peak against the measured one: " + ("; ".join(
        f"{r['run']} (round {r['round']}) predicted {r['predicted_gpu_gib']:.2f}, measured {r['gpu_gib']:.2f}"
        for r in missed) if missed else "within 0.1 GiB in every run"))
    return out


def _span(values: list[float], fmt: str) -> str:
    """One value, or the range of several, each in `fmt`."""
    return format(values[0], fmt) if len(values) == 1 else f"{format(min(values), fmt)}-{format(max(values), fmt)}"

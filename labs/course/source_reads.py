"""Where the "from the sources" page gets its numbers: the chapters, their graded sections, readers for the
tables several claims quote (chapter 1's seed sums, chapter 2's bytes and collectives, chapter 3's scenarios,
chapter 9's runs a and m), each a `labs.course.sources.Read` (a pattern over one section's stored outputs), and the
checks no chapter prints, run when the page is built (two of them decide a verdict from a chapter's numbers)."""
from __future__ import annotations

from labs import memory, models
from labs.bench import results
from labs.course import tutorial_snippets
from labs.course.sources import Read, read

CH1, CH2, CH3, CH4, CH5 = ("01_memory_math", "02_zero_stages", "03_offload", "04_mixed_precision",
                           "05_checkpointing")
CH6, CH7, CH8, CH9 = "06_multi_node", "07_fsdp", "08_trainer_and_accelerate", "09_qwen7b_on_gpu"
SUMS = "The tutorials' 7B sums, recomputed"       # chapter 1's table of both tutorials' 7B sums
SUMS_TUTORIAL = {"000": "Qwen-7B guide", "001": "DeepSpeed chapter"}   # how that table names them
SCENARIOS = "The seed tutorials' scenarios, recomputed"   # chapter 3's 24 GB scenarios
SNIPPETS = "The source tutorials' snippets, graded"
STAGES_RUN_A = "ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2 with the same levers (run a)"
RUN_M = "Offload at the same batch (run m: 1 x H200, Qwen2.5-3B shape)"


def sums_row(tutorial: str, label: str, paper: str, rules: str, by: str = "_by") -> Read:
    """One row of chapter 1's table of the tutorials' sums: the paper's GB, DeepSpeed's rules' GB ("-" where none)
    and whose rules those are (`rules_by`: DeepSpeed's own estimator, or labs' extension of its rules to a stage
    DeepSpeed has no estimator for)."""
    return Read(CH1, SUMS, rf"^{SUMS_TUTORIAL[tutorial]}\s+{_literal(label)}\s.*?\s(\d+\.\d)\s+(\S+)\s+"
                r"(DeepSpeed|labs' extension|-)\s*$", (paper, rules, by))


def stage_row(stage: int, category: str, *names: str) -> Read:
    """Chapter 2's measured bytes of one category on rank 0 at one stage (measured MiB)."""
    return Read(CH2, "What each rank holds", rf"^\s*{stage}\s+0\s+{category}\s+(\S+)", names)


def comm_row(stage: int) -> Read:
    """Chapter 2's collectives at one stage: all-reduce MB, reduce-scatter MB, all-gather calls, volume/Psi, paper."""
    return Read(CH2, "What each rank sends",
                rf"^\s*{stage}\s+\d+\s+(\S+)\s+(\S+)\s+(\d+)\s+\S+\s+(\S+)\s+(\d+)\s*$",
                tuple(f"{n}{stage}" for n in ("allreduce", "scatter", "gathers", "volume", "paper")))


def scenario_row(setup: str, offload: str, prefix: str) -> Read:
    """Chapter 3's labs.memory scenario: GPU peak GiB, fits, host GiB per node."""
    row = rf"^{_literal(setup)}\s+{_literal(offload)}\s+\S+\.json\s+(\S+)\s+(True|False)\s+(\S+)\s*$"
    return Read(CH3, SCENARIOS, row,
                (f"{prefix}_gpu", f"{prefix}_fits", f"{prefix}_host"))


def run_a(case: str, prefix: str) -> Read:
    """Chapter 9's run a on 2 x H200, one case: tokens/s per GPU and peak GiB."""
    return Read(CH9, STAGES_RUN_A, rf"^{case}\s+\S+\s+\d\s+(\S+)\s+\S+\s+(\S+)", (f"{prefix}_tps", f"{prefix}_peak"))


def _literal(text: str) -> str:
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


# ---------------------------------------------------------------------------------------------- computed on the page
GB = 1e9


def guide_batch_keys() -> dict:
    """The Qwen-7B guide's batch keys (train_batch_size 8, gradient_accumulation_steps 4) through DeepSpeed's own
    config class, on the 2 GPUs of its minimum setup and the 4 of its recommended one."""
    keys = {"train_batch_size": 8, "gradient_accumulation_steps": 4}
    share = {gpus: keys["train_batch_size"] / (keys["gradient_accumulation_steps"] * gpus) for gpus in (2, 4)}
    verdicts = {gpus: tutorial_snippets.deepspeed_error(keys, world_size=gpus) or "accepted" for gpus in (2, 4)}
    return {"two": verdicts[2], "four": verdicts[4], "two_micro": f"{share[2]:g}", "four_micro": f"{share[4]:g}"}


def thirteen_b_without_zero() -> dict:
    """Model states per GPU of a 13B model under plain data parallelism (no ZeRO), the ZeRO paper's count."""
    estimate = memory.estimate(params=13e9, stage=0, gpus_per_node=1)
    return {"gb": f"{estimate.paper_model_states_per_gpu_bytes / GB:.0f}",
            "bytes": f"{estimate.paper_model_states_per_gpu_bytes / estimate.params:.0f}"}


def wall_clock_shares(run: str = "a_zero3_2xh200", case: str = "labs-zero3") -> dict:
    """DeepSpeed's wall_clock_breakdown timers (forward, backward, optimizer step, in ms) of one recorded GPU case
    (results/gpu/, chapter 9's run a by default), each as a share of their sum."""
    row = results.find(results.rows(results.load_all()), run, case)
    timers = {name: row[f"{name}_ms"] for name in ("fwd", "bwd", "step")}
    total = sum(timers.values())
    return {name: f"{ms / total:.0%}" for name, ms in timers.items()} | {"gpus": row["gpus"], "gpu": row["gpu"]}


def qwen7b_states(stage: int = 3, gpus: int = 4) -> dict:
    """Qwen-7B's own parameter count (the `qwen-7b` preset, not the tutorials' round 7e9) and its model states per
    GPU at one ZeRO stage: the ZeRO paper's count and DeepSpeed's estimator rules, in GB."""
    estimate = memory.estimate("qwen-7b", stage=stage, gpus_per_node=gpus)
    return {"qwen_params": f"{models.param_counts(models.shape('qwen-7b'))['total'] / 1e9:.2f}",
            "qwen_paper": f"{estimate.paper_model_states_per_gpu_bytes / GB:.1f}",
            "qwen_ds": f"{estimate.model_states_per_gpu_bytes / GB:.1f}"}


# ---------------------------------------------------------------------------------------------- verdicts decided here
TIE = 0.02      # two figures of one invocation within 2% of each other count as a tie (run a has no repeat)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _change(before: float, after: float, falls: str) -> str:
    """`after` against `before` as a signed share, and what it is: a tie within TIE, else `falls` or "a rise"."""
    change = after / before - 1
    return f"{change:+.1%}, {'a tie' if abs(change) <= TIE else falls if change < 0 else 'a rise'}"


def stage_speed_order() -> dict:
    """The Qwen-7B guide's table (000, 6.2) has memory and speed fall from ZeRO-1 to ZeRO-2 and again to ZeRO-3.
    Chapter 9's run a, as the chapter printed it (2 x H200, the same levers, one invocation), decides each of those
    four falls, counting two figures within TIE of each other as a tie. Verdict: "true" if all four hold, "false"
    if none does, "partly" otherwise."""
    got = {}
    for stage in (1, 2, 3):
        got |= read(run_a(f"labs-zero{stage}", f"z{stage}"))
    steps = {}
    for kind, key in (("speed", "tps"), ("memory", "peak")):
        z1, z2, z3 = (_number(got[f"z{stage}_{key}"]) for stage in (1, 2, 3))
        steps[kind] = (_change(z1, z2, "a fall"), _change(z2, z3, "a fall"))
    held = sum(step.endswith(", a fall") for pair in steps.values() for step in pair)
    return {**{kind: f"ZeRO-1 to ZeRO-2 {first}; ZeRO-2 to ZeRO-3 {second}" for kind, (first, second) in steps.items()},
            "held": str(held), "tie": f"{TIE:.0%}",
            "verdict": "true" if held == 4 else "false" if held == 0 else "partly"}


CLAIMED_COST = (30, 50)     # the DeepSpeed chapter's "offload slows training by 30-50%", in % of throughput lost


def offload_cost_run_m() -> dict:
    """What optimizer offload cost in chapter 9's run m (1 x H200, Qwen2.5-3B shape, 32,768 tokens per optimizer
    step): labs with offload against labs without, the pair `labs.course.gpu_report.offload_targets` prints there,
    as throughput lost (from the two tokens/s the chapter prints, not its rounded share) and as step time. Verdict
    on "offload slows training by 30-50%": "partly" when the throughput lost lies in that range, or at its edge (the
    speed kept within TIE of the speed the range's bound would keep: one run, no repeat), since the claim then holds
    read as throughput, not as time; "false" beyond."""
    got = read(Read(CH9, RUN_M, r"offload hides the CPU step: .*?: (\d+)% \((\S+) vs (\S+)\)",
                    ("kept", "with_case", "without_case")))
    speed = {case: read(Read(CH9, RUN_M, rf"^{_literal(got[case])}\s+\S+\s+(\S+)", ("tps",)))["tps"]
             for case in ("with_case", "without_case")}
    kept = _number(speed["with_case"]) / _number(speed["without_case"])
    lost = 100 * (1 - kept)
    within = CLAIMED_COST[0] <= lost <= CLAIMED_COST[1]
    edge = not within and any(abs(kept / (1 - bound / 100) - 1) <= TIE for bound in CLAIMED_COST)
    where = "inside" if within else f"at the edge (within this page's {TIE:.0%} tie) of" if edge else "outside"
    return {"kept": f"{100 * kept:.1f}%", "lost": f"{lost:.1f}%",
            "range": f"{where} the claimed {CLAIMED_COST[0]}-{CLAIMED_COST[1]}%",
            "time": f"{1 / kept:.2f}",
            "with_tps": speed["with_case"], "without_tps": speed["without_case"],
            "verdict": "partly" if within or edge else "false"}

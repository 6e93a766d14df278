"""Where the "from the sources" page gets its numbers: the chapters, their graded sections, readers for the
tables several claims quote (chapter 1's seed sums, chapter 2's bytes and collectives, chapter 3's scenarios,
chapter 9's run a), each a `labs.course.sources.Read` (a pattern over one section's stored outputs), and the two
checks no chapter prints, run when the page is built."""
from __future__ import annotations

from labs import memory
from labs.bench import results
from labs.course import tutorial_snippets
from labs.course.sources import Read

CH1, CH2, CH3, CH4, CH5 = ("01_memory_math", "02_zero_stages", "03_offload", "04_mixed_precision",
                           "05_checkpointing")
CH6, CH7, CH8, CH9 = "06_multi_node", "07_fsdp", "08_trainer_and_accelerate", "09_qwen7b_on_gpu"
SUMS = "The tutorials' 7B sums, recomputed"       # chapter 1's table of both tutorials' 7B sums
SUMS_TUTORIAL = {"000": "Qwen-7B guide", "001": "DeepSpeed chapter"}   # how that table names them
SCENARIOS = "The seed tutorials' scenarios, recomputed"   # chapter 3's 24 GB scenarios
SNIPPETS = "The source tutorials' snippets, graded"
STAGES_RUN_A = "ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2 with the same levers (run a)"


def sums_row(tutorial: str, label: str, paper: str, rules: str) -> Read:
    """One row of chapter 1's table of the tutorials' sums: the paper's GB and DeepSpeed's rules' GB ("-" where
    none), the two columns before the last (whose rules those are)."""
    return Read(CH1, SUMS, rf"^{SUMS_TUTORIAL[tutorial]}\s+{_literal(label)}\s.*?\s(\d+\.\d)\s+(\S+)\s+"
                r"(?:DeepSpeed|labs' extension|-)\s*$", (paper, rules))


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

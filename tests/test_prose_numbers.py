"""Numbers in a chapter's prose are ones its cells print (the rule: every figure a notebook shows is computed in it or
read from a committed result file). Each measured-looking number in a markdown cell, one with a unit or a suffix
(1.23x, 56.3%, 5 GiB, 2.3 s, 450 GB/s, 0.41 nats ...) or grouped with commas (24,012), must appear with the same
digits in that notebook's stored code-cell outputs or in a code cell's source. A prose 87% is not met by a printed
86.9% or 87.0%: reword the prose to the printed form or print the form the prose uses. Both ends of a range
(1.22x-1.27x, 2.7-4.4%) are checked. A number of one or two digits (5 GiB, 87%, 1.3x) must be printed with its unit,
since a bare 5 or 87 is found almost anywhere; a longer one may stand alone, as in a table whose header names the
unit. Not seen: a ratio written with a space ("3.9 x"), which reads like a product ("8 x 4,096"). Numbers that are legitimately typed (hardware, a question's premise, a figure
quoted from a source tutorial being graded) are listed in ALLOWED with the reason. The book's hand-written pages and
README.md have no cells: a number there must be one some chapter prints or computes (README_ALLOWED lists the README's
exceptions). Reads JSON only."""
import functools
import html
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = r"x(?!\w)|×|%|\s?(?:GiB|GB/s|GB|MiB|MB|KiB|TiB|TB|ms|tokens/s|nats|s)(?![\w/])"
# a number, its unit, and optionally a second number with its unit after a dash: 1.22x-1.27x, 2.7-4.4%
QUANTITY = re.compile(rf"(?<![\w.,])(?P<a>{NUMBER})(?P<ua>{UNIT})?"
                      rf"(?:\s?[-–]\s?(?P<b>{NUMBER})(?P<ub>{UNIT}))?(?![\d])")

QWEN_GUIDE = "quoted from the Qwen-7B guide, a claim the chapter grades"
DS_CHAPTER = "quoted from the DeepSpeed chapter, a claim the chapter grades"
SEEDS_30_50 = 'the seed tutorials\' "30-50%", quoted to be graded'
# (notebook stem, number and unit as the prose writes them, spaces dropped) -> why no cell needs to print it
ALLOWED = {
    ("01_memory_math", "50%"): QWEN_GUIDE + ' ("by about 50%"; chapter 4 measures it)',
    ("01_memory_math", "42GB"): QWEN_GUIDE + " (ZeRO-3 on 4 GPUs) and from the DeepSpeed chapter (ZeRO-1)",
    ("01_memory_math", "94GB"): QWEN_GUIDE + " (its ZeRO-1 table row)",
    ("01_memory_math", "28GB"): DS_CHAPTER + " (Adam states; its ZeRO-2 diagram)",
    ("01_memory_math", "56GB"): DS_CHAPTER + ' ("(4+4) x 7B = 56GB")',
    ("01_memory_math", "84GB"): DS_CHAPTER + ' ("14 + 14 + 56 = 84GB")',
    ("01_memory_math", "14GB"): DS_CHAPTER + " (optimizer states in CPU memory)",
    ("03_offload", "30%"): SEEDS_30_50 + " (offload's slowdown)",
    ("05_checkpointing", "30%"): SEEDS_30_50 + " (activation memory saved by checkpointing)",
    ("05_checkpointing", "1,000"): "an exercise's premise (a 1,000-step run)",
    ("06_multi_node", "30s"): "a setting: the hang probe's timeout, timeout_s=30 in the cell",
    ("06_multi_node", "25GB/s"): "a setting: the slow network the sweep assumes, inter_gbps=25 in the cell",
    ("07_fsdp", "80GB"): "hardware: the card most readers have (A100 / H100 80 GB), which the H200 peaks exceed",
    ("06_multi_node", "4x"): "the ZeRO++ paper's headline (3M to 0.75M), quoted; the next cell prints the model's 3.94-4.74",
    ("09_qwen7b_on_gpu", "1,979"): "hardware: the H200's dense fp8 peak in TFLOP/s, from NVIDIA's data sheet",
    ("09_qwen7b_on_gpu", "24GB"): "hardware: a consumer card's memory, the premise of a question no run measured",
    ("09_qwen7b_on_gpu", "24GiB"): "the cap that unmeasured consumer-card question would use, a premise",
    ("10_zenflow", "252GiB"): "hardware: the 2-GPU machine's host memory, recorded in results/README.md",
    ("10_zenflow", "256MiB"): "a setting: labs.zenflow_host's staging block at its default",
    ("10_zenflow", "1GiB"): "a threshold: zenflow_report.host_low counts the GPU let go under 1024 MiB in use",
    ("10_zenflow", "1%"): "a bound on the measured / labs.memory ratios the cell prints (1.006 and 1.005)",
}


def _unit(text):
    return None if text is None else text.strip().replace("×", "x")


def prose_numbers(markdown: str) -> list[tuple[str, str | None, int]]:
    """The measured-looking numbers in `markdown`, each as (digits as written, unit or None for a comma-grouped
    number without one, where it starts)."""
    found = []
    for m in QUANTITY.finditer(markdown):
        a, ua, b, ub = m.group("a"), _unit(m.group("ua")), m.group("b"), _unit(m.group("ub"))
        if b is not None:
            found += [(a, ua or ub, m.start("a")), (b, ub, m.start("b"))]
        elif ua is not None or "," in a:
            found.append((a, ua, m.start("a")))
    return found


def _outputs_and_sources(notebook: dict) -> tuple[str, str]:
    outputs, sources = [], []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        sources.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                outputs.append("".join(output["text"]))
            data = output.get("data", {})
            for kind in ("text/plain", "text/markdown"):
                if kind in data:
                    outputs.append("".join(data[kind]))
            if "text/html" in data:
                outputs.append(html.unescape(re.sub(r"<[^>]+>", " ", "".join(data["text/html"]))))
    return " ".join(" ".join(outputs).split()), " ".join(" ".join(sources).split())


def shown(number: str, unit: str | None, text: str) -> bool:
    """Whether `text` holds `number` with the same digits (not 86.9 for 87, nor 87.0). A number of one or two digits
    (5, 87, 1.3, 0.2) must carry its unit there too, since a bare 87 matches almost anything; a longer one may stand
    alone, as in a table whose header names the unit. A comma-grouped number may be printed without its commas
    (65504 for 65,504) or, in a source, with underscores (65_536)."""
    forms = {number, number.replace(",", ""), number.replace(",", "_")}
    digits = "(?:" + "|".join(map(re.escape, sorted(forms))) + ")"
    pattern = rf"(?<![\w.,]){digits}(?!\d|[.,_]\d)"          # not the 100 of H100
    if sum(c.isdigit() for c in number) < 3:
        pattern += r"\s?" + ("(?:x|×)" if unit == "x" else re.escape(unit)) + r"(?![\w/])"
    return re.search(pattern, text) is not None


def unshown(notebook: dict) -> list[tuple[str, str, str]]:
    """(cell id, number and unit, the prose around it) for each prose number the notebook's cells do not show."""
    outputs, sources = _outputs_and_sources(notebook)
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        for number, unit, at in prose_numbers(text):
            if not (shown(number, unit, outputs) or shown(number, unit, sources)):
                context = " ".join(text[max(0, at - 60):at + 40].split())
                missing.append((cell["id"], number + (unit or ""), context))
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_prose_numbers_are_printed_by_a_cell(path):
    missing = [m for m in unshown(json.loads(path.read_text())) if (path.stem, m[1]) not in ALLOWED]
    assert not missing, "prose numbers no cell prints (print them, reword the prose, or allow them with a reason):\n" \
        + "\n".join(f"  cell {cell}: {number}  ... {context} ..." for cell, number, context in missing)


BOOK_PAGES = sorted((ROOT / "book").glob("*.md"))
README = ROOT / "README.md"
# (README, number and unit as the README writes them, spaces dropped) -> why no chapter needs to print it
README_ALLOWED = {
    ("README", "151,643"): "a constant of Qwen's tokenizer: <|endoftext|> is numbered right after the 151,643 "
                           "BPE ranks (labs/data.py; tests/test_data.py holds it)",
    ("README", "30s"): "a setting: labs.peers.HEARTBEAT_TIMEOUT_S = 30.0, how long a node's counter may stand still",
    ("README", "24.8%"): "read from a committed result file: run n's labs mfu_causal (0.248) in results/gpu/"
                         "2026-12-01_n_offload_stock_best_3b_1xh200.json, which tests/test_bench.py checks the table "
                         "against; chapter 9 prints only its full-attention MFU",
    ("README", "0.71nats"): "round 23's sequential ZenFlow gap, which chapter 10 prints as +0.710; tests/test_bench.py "
                            "pins the README's two-place form, computed by labs.course.zenflow_verdict from results/",
}


@functools.cache
def _chapters() -> tuple[str, str]:
    """All chapters' stored outputs, and all their code cells' sources, each as one text."""
    texts = [_outputs_and_sources(json.loads(p.read_text())) for p in NOTEBOOKS]
    return " ".join(o for o, _ in texts), " ".join(s for _, s in texts)


def unquoted(text: str) -> list[str]:
    """The numbers (digits and unit, spaces dropped) in a hand-written page that no chapter prints or computes."""
    outputs, sources = _chapters()
    return [number + (unit or "") for number, unit, _ in prose_numbers(text)
            if not (shown(number, unit, outputs) or shown(number, unit, sources))]


@pytest.mark.parametrize("path", BOOK_PAGES, ids=[p.stem for p in BOOK_PAGES])
def test_book_pages_quote_only_numbers_a_chapter_prints(path):
    """The book's hand-written pages (intro, cheat sheet, glossary ...) have no cells: a number there must be one
    some chapter prints or computes in a cell's source."""
    missing = unquoted(path.read_text())
    assert BOOK_PAGES and not missing, f"{path.name}: numbers no chapter prints: {missing}"


def test_readme_quotes_only_numbers_a_chapter_prints():
    """The README's figures (the results table, the ZenFlow rounds, make test's costs ...) are ones a chapter prints or
    computes in a cell's source, as for the book's pages; a setting, a constant the code states or a figure read from
    a committed result file is listed in README_ALLOWED with the reason."""
    missing = [number for number in unquoted(README.read_text()) if (README.stem, number) not in README_ALLOWED]
    assert not missing, "README.md: numbers no chapter prints (reword to the printed form, drop them, or allow " \
        f"them with a reason in README_ALLOWED): {missing}"


def test_every_allowed_number_is_still_needed():
    """An entry whose number left the prose, or that a cell now prints, goes."""
    needed = {(p.stem, m[1]) for p in NOTEBOOKS for m in unshown(json.loads(p.read_text()))}
    assert not set(ALLOWED) - needed, sorted(set(ALLOWED) - needed)
    assert all(reason.strip() for reason in ALLOWED.values())


def test_every_readme_allowed_number_is_still_needed():
    """A README_ALLOWED entry whose number left the README, or that a chapter now prints, goes."""
    needed = {(README.stem, number) for number in unquoted(README.read_text())}
    assert not set(README_ALLOWED) - needed, sorted(set(README_ALLOWED) - needed)
    assert all(reason.strip() for reason in README_ALLOWED.values())


def _notebook(prose: str, printed: str) -> dict:
    return {"cells": [{"cell_type": "markdown", "id": "m", "source": [prose]},
                      {"cell_type": "code", "id": "c", "source": ["print(...)"],
                       "outputs": [{"output_type": "stream", "name": "stdout", "text": [printed]}]}]}


@pytest.mark.parametrize("prose, printed, missing", [
    ("at 87% of no offload", "ratio 87%", []),
    ("at 87% of no offload", "ratio 86.9%", ["87%"]),
    ("at 87% of no offload", "ratio 87.0%", ["87%"]),
    ("labs is 1.22x-1.27x stock's", "1.22x in run m, 1.27x in run n", []),
    ("labs is 1.22x-1.27x stock's", "1.22x in run m", ["1.27x"]),
    ("2.7-4.4% ahead", "2.7% and 4.4%", []),
    ("2.7-4.4% ahead", "1.027x and 1.044x", ["2.7%", "4.4%"]),
    ("with 5 GiB to spare", "step 5 of 20", ["5GiB"]),
    ("with 5.1 GiB to spare", "least available: 5.1 GiB of 125", []),
    ("nothing above 65,504", "fp16 max 65504", []),
    ("24,012 tokens/s", "24,013 tokens/s", ["24,012tokens/s"]),
    ("56.3% MFU", "mfu 56.3", []),
])
def test_the_check_reads_numbers_as_written(prose, printed, missing):
    assert [number for _, number, _ in unshown(_notebook(prose, printed))] == missing

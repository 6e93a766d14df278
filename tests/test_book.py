"""The book's own code: the diagrams (labs.course.diagrams), the cheat sheet's key list (labs.course.cheatsheet)
and the book build's extension (book/_ext/zero_book.py). The build itself runs in `make book`."""
import json
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from labs.course import cheatsheet, diagrams  # noqa: E402
from labs.memory.accounting import paper_model_states_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
sys.path.insert(0, str(BOOK / "_ext"))
import zero_book  # noqa: E402


# ---- diagrams ----

@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_param_add_up_to_the_paper(stage, ranks):
    held = diagrams.bytes_per_param(stage, ranks)
    assert sum(held.values()) == pytest.approx(paper_model_states_bytes(1, stage, ranks))


def test_each_stage_partitions_one_more_category():
    n = 4
    partitioned = [{c for c, b in diagrams.bytes_per_param(s, n).items() if b < diagrams.bytes_per_param(0, n)[c]}
                   for s in range(4)]
    assert partitioned == [set(), {"optimizer states"}, {"optimizer states", "gradients"}, set(diagrams.CATEGORIES)]


def _solid_area(ax):
    return sum(p.get_width() * p.get_height() for p in ax.patches if p.get_facecolor()[3] > 0)


def test_zero_stages_picture_areas_are_the_bytes():
    ranks = 4
    fig = diagrams.zero_stages(ranks=ranks)
    axes = fig.axes
    assert len(axes) == 4 * ranks
    for stage in range(4):
        for rank in range(ranks):
            assert _solid_area(axes[stage * ranks + rank]) == pytest.approx(
                paper_model_states_bytes(1, stage, ranks))
    matplotlib.pyplot.close(fig)


def test_stage_table_rows():
    text = str(diagrams.stage_table(ranks=4))
    assert "ZeRO-3" in text and "5.5" in text      # ZeRO-2 on 4 ranks: 2 + (2 + 12) / 4


@pytest.mark.parametrize("prefetch", [False, True])
def test_zero3_schedule_respects_dependencies(prefetch):
    layers = 3
    events = diagrams.zero3_schedule(layers, prefetch=prefetch)
    for lane in ("communication", "compute"):
        spans = sorted((e.start, e.end) for e in events if e.lane == lane)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(spans, spans[1:])), lane
    gathers = [e for e in events if e.kind == "all-gather"]
    computes = [e for e in events if e.kind in ("forward", "backward")]
    scatters = [e for e in events if e.kind == "reduce-scatter"]
    assert len(gathers) == len(computes) == 2 * layers and len(scatters) == layers
    for gather, compute in zip(sorted(gathers, key=lambda e: e.start), computes):
        assert gather.layer == compute.layer and gather.end <= compute.start
    for scatter in scatters:
        backward = next(e for e in computes if e.kind == "backward" and e.layer == scatter.layer)
        assert scatter.start >= backward.end
    step = events[-1]
    assert step.kind == "optimizer step" and step.start == max(e.end for e in events[:-1])


def test_prefetch_overlaps_and_shortens_the_step():
    plain, overlapped = (diagrams.zero3_schedule(4, prefetch=p) for p in (False, True))
    assert max(e.end for e in overlapped) < max(e.end for e in plain)
    forward = [e for e in overlapped if e.kind == "forward"]
    second_gather = [e for e in overlapped if e.kind == "all-gather"][1]
    assert second_gather.start < forward[0].end          # layer 1's gather runs while layer 0 computes


def test_zero3_timeline_draws_both_schedules():
    fig = diagrams.zero3_timeline(layers=2)
    assert len(fig.axes) == 2
    matplotlib.pyplot.close(fig)


# ---- cheat sheet ----

def test_key_paths_and_config_keys():
    assert cheatsheet.key_paths({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == ["a", "a.b", "a.c", "a.c.d", "e"]
    keys = cheatsheet.config_keys()
    assert "zero3.json" in keys["zero_optimization.stage"]
    assert "bench/labs_zero3_fp16.json" in keys["fp16.loss_scale_window"]


def test_code_keys_finds_both_spellings():
    code = 'Z = "zero_optimization."\nv = {Z + "overlap_comm": False, "zero_optimization.offload_param.device": 1}'
    assert cheatsheet.code_keys(code) == {"zero_optimization.overlap_comm", "zero_optimization.offload_param.device"}


def test_every_course_key_is_on_the_cheat_sheet():
    page = (BOOK / "cheatsheet.md").read_text()
    keys = cheatsheet.course_keys()
    assert len(keys) > 50
    assert cheatsheet.missing_from(page, keys) == []
    assert cheatsheet.missing_from("`stage`", ["stage", "zero_optimization.stage"]) == ["zero_optimization.stage"]


# ---- the book build's extension ----

def test_clean_outputs_drops_build_noise_and_notes_widgets():
    outputs = [
        {"output_type": "stream", "name": "stdout",
         "text": "[2026-11-30 23:37:50,534] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator\n"
                 "done in 15 s\n"},
        {"output_type": "stream", "name": "stdout",
         "text": ["DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n"]},
        {"output_type": "display_data", "metadata": {},
         "data": {zero_book.WIDGET: {"model_id": "x"}, "text/plain": "VBox()"}},
    ]
    cleaned = zero_book.clean_outputs(outputs)
    assert cleaned[0]["text"] == "done in 15 s\n"
    assert len(cleaned) == 3 and zero_book.WIDGET in cleaned[1]["data"]
    assert "live Jupyter kernel" in cleaned[2]["data"]["text/html"]


def test_labs_uses_resolves_names_to_their_definitions():
    uses = zero_book.labs_uses(["from labs import memory, RUNS\nfrom labs.course import stages\n",
                                "%matplotlib inline\nest = memory.estimate('tiny', stage=3)\nstages.run_stages(RUNS)"])
    lines = (ROOT / "labs/course/stages.py").read_text().splitlines()
    assert lines[uses["labs.course.stages"]["run_stages"] - 1].startswith("def run_stages(")
    assert "estimate" in uses["labs.memory.estimate"]             # re-exported by labs.memory, defined there
    assert "RUNS" in uses["labs"]


def test_toc_lists_every_chapter_and_every_page_exists():
    order = zero_book.toc_order(BOOK / "_toc.yml")
    assert order[0] == "intro"
    for doc in order:
        assert any((BOOK / f"{doc}{suffix}").exists() for suffix in (".md", ".ipynb")), doc
    chapters = {f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert chapters <= set(order), sorted(chapters - set(order))


def test_rewritten_chapter_ends_with_labs_links_and_the_next_page():
    text = (ROOT / "notebooks/00_quickstart.ipynb").read_text()
    nb = json.loads(zero_book.rewrite_notebook(text, depth=1, next_doc="notebooks/01_memory_math"))
    footer = nb["cells"][-1]["source"]
    assert footer.startswith("## labs code used in this chapter")
    assert '<a href="../_labs_source/labs/launch.py.html#L-' in footer
    assert footer.endswith("**Next:** {doc}`/notebooks/01_memory_math`")

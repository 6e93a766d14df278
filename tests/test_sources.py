"""The book's "from the sources" page (book/from_the_sources.md): every claim of the two source tutorials has a
verdict, every number it quotes is read from a chapter's stored outputs, and every link lands on a heading."""
import json
import re
import string
from pathlib import Path

import pytest
from myst_parser.mdit_to_docutils.base import default_slugify

from labs.course import claims_deepspeed_chapter, claims_qwen_guide, sources
from labs.course.sources import Claim, Computed, Read, See

ROOT = Path(__file__).resolve().parent.parent
MODULES = (claims_qwen_guide, claims_deepspeed_chapter)
CLAIMS = [c for m in MODULES for c in m.CLAIMS]
IDS = [f"{c.tutorial}:{c.said[:40]}" for c in CLAIMS]
LINK = re.compile(r"\]\(notebooks/(\w+)\.ipynb#([\w-]+)\)")


def test_each_module_holds_one_tutorial():
    assert [m.TUTORIAL for m in MODULES] == list(sources.TUTORIALS)
    for module in MODULES:
        assert {c.tutorial for c in module.CLAIMS} == {module.TUTORIAL}


@pytest.mark.parametrize("claim", CLAIMS, ids=IDS)
def test_every_claim_has_a_verdict_a_reason_and_a_section(claim):
    assert claim.verdict in sources.VERDICTS
    assert claim.why.strip() and claim.said.strip()
    assert claim.sources, "every claim links the section that decides it (or where to check it)"


@pytest.mark.parametrize("claim", CLAIMS, ids=IDS)
def test_every_number_is_read_from_a_chapter(claim):
    """Templates use only the fields the claim reads (no typed number slips in as a field), and each read matches
    a stored output now: a chapter that stops printing a number fails here, not silently on the page."""
    fields = {name for text in (claim.why, claim.number) for _, name, _, _ in string.Formatter().parse(text)
              if name}
    read = {n for s in claim.sources if isinstance(s, (Read, Computed)) for n in s.names}
    assert fields <= read, f"fields neither read from a chapter nor computed: {fields - read}"
    values = sources.values(claim)
    assert all(values[f].strip() for f in fields)
    if claim.verdict != "not checkable here":
        assert claim.number, "a graded claim quotes the number that decides it"


def _headings(chapter: str) -> dict[str, int]:
    """Every markdown heading of a chapter -> its level, straight from the notebook file."""
    found = {}
    for cell in json.loads((ROOT / "notebooks" / f"{chapter}.ipynb").read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                match = re.match(r"^(#+)\s+(.*)$", line)
                if match:
                    found[match.group(2).strip()] = len(match.group(1))
    return found


@pytest.mark.parametrize("claim", CLAIMS, ids=IDS)
def test_every_link_lands_on_a_heading_with_an_anchor(claim):
    rendered = "; ".join(sources.link(s) for s in claim.sources)
    links = LINK.findall(rendered)
    assert len(links) == len(claim.sources)
    for source, (chapter, anchor) in zip(claim.sources, links):
        source = source.see if isinstance(source, Computed) else source
        headings = _headings(chapter)
        assert source.heading in headings, f"{chapter} has no heading {source.heading!r}"
        assert headings[source.heading] <= sources.ANCHOR_LEVELS, "MyST gives deeper headings no anchor"
        assert (ROOT / "book" / "notebooks" / f"{chapter}.ipynb").is_file()
        slugs = [default_slugify(sources.heading_text(h)) for h in headings]
        assert anchor in slugs or re.sub(r"-\d+$", "", anchor) in slugs, f"{chapter}: no heading makes #{anchor}"


def test_computed_numbers_come_from_labs_functions():
    computed = [s for c in CLAIMS for s in c.sources if isinstance(s, Computed)]
    assert computed, "the page computes the claims no chapter prints"
    for source in computed:
        assert source.function.__module__.startswith("labs."), source.function
        assert set(source.names) <= set(source.function())


def test_a_missing_number_is_an_error_naming_the_section():
    missing = Read("01_memory_math", "The seeds' 7B sums, recomputed", r"no such output (\d+)", ("x",))
    with pytest.raises(LookupError, match="The seeds' 7B sums"):
        sources.read(missing)
    with pytest.raises(LookupError, match="no heading"):
        sources.link(See("01_memory_math", "No such heading"))


def test_a_graded_claim_without_a_section_or_an_unknown_verdict_is_refused():
    with pytest.raises(ValueError, match="needs the section"):
        Claim("000", "1", "something", "true", "because")
    with pytest.raises(ValueError, match="verdict"):
        Claim("000", "1", "something", "mostly", "because", sources=(See("01_memory_math", "Summary"),))


def test_anchor_follows_myst_for_headings_with_code_and_apostrophes():
    assert sources.anchor("The seeds' 7B sums, recomputed") == "the-seeds-7b-sums-recomputed"
    assert sources.anchor("### `reduce_bucket_size`".lstrip("# ")) == "reduce_bucket_size"


def test_the_page_renders_every_claim_and_is_in_the_toc():
    page = (ROOT / "book" / "from_the_sources.md").read_text()
    assert all(f"{m.__name__.rsplit('.', 1)[1]}.CLAIMS" in page for m in MODULES)
    assert "- file: from_the_sources" in (ROOT / "book" / "_toc.yml").read_text()
    for module in MODULES:
        text = sources.markdown(module.CLAIMS)
        assert text.count("**Verdict: ") == len(module.CLAIMS)
        assert "{" not in text.replace("{doc}", ""), "a template field was left unfilled"


def test_verdict_counts_add_up():
    table = str(sources.verdict_counts({m.TUTORIAL: m.CLAIMS for m in MODULES}))
    for module in MODULES:
        line = next(line for line in table.splitlines() if line.startswith(module.TUTORIAL))
        numbers = [int(n) for n in line.split()[-5:]]
        assert sum(numbers[:-1]) == numbers[-1] == len(module.CLAIMS)


def _decides_false() -> dict:
    return {"verdict": "false", "x": "1"}


def test_a_verdict_decided_in_code_must_match_the_typed_one():
    """A Computed source that returns a "verdict" decides it: the page stops on a claim that types another."""
    decided = Computed(_decides_false, ("x",), See("01_memory_math", "Summary"))
    assert sources.values(Claim("000", "1", "something", "false", "because {x}", "{x}", (decided,))) == {"x": "1"}
    with pytest.raises(ValueError, match="decides 'false'"):
        sources.values(Claim("000", "1", "something", "partly", "because {x}", "{x}", (decided,)))


def test_stage_order_counts_a_tie_within_the_stated_tolerance():
    from labs.course import source_reads
    assert source_reads._change(100, 100 * (1 - source_reads.TIE / 2), "a fall").endswith(", a tie")
    assert source_reads._change(100, 90, "a fall") == "-10.0%, a fall"
    assert source_reads._change(100, 110, "a fall") == "+10.0%, a rise"
    # what chapter 9's run a decides: ZeRO-1 and ZeRO-2 tie in speed and memory, ZeRO-3 is 9.8% slower and holds
    # 0.1% less (a tie): one fall of four held, so "partly"
    order = source_reads.stage_speed_order()
    assert order == {"speed": "ZeRO-1 to ZeRO-2 +0.0%, a tie; ZeRO-2 to ZeRO-3 -9.8%, a fall",
                     "memory": "ZeRO-1 to ZeRO-2 +0.0%, a tie; ZeRO-2 to ZeRO-3 -0.1%, a tie",
                     "held": "1", "tie": "2%", "verdict": "partly"}
    # the same shares, to the printed rounding, and the same words from run a's recorded result file
    from labs.bench import results
    run_a = {case: results.find(results.rows(results.load_all()), "a_zero3_2xh200", f"labs-zero{case}")
             for case in (1, 2, 3)}
    for kind, key in (("speed", "tokens_per_s_per_gpu"), ("memory", "peak_gib")):
        decided = re.findall(r"([+-]\d+\.\d)%, (a \w+)", order[kind])
        for (share, word), (a, b) in zip(decided, ((1, 2), (2, 3)), strict=True):
            recorded = source_reads._change(run_a[a][key], run_a[b][key], "a fall")
            assert abs(float(share) - 100 * (run_a[b][key] / run_a[a][key] - 1)) <= 0.1 and recorded.endswith(word)

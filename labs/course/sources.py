"""The book's "from the sources" page: every checkable claim of the two tutorials the course takes its topics from,
graded, each with the number that decides it and the chapter section whose cell computes that number.

A claim's numbers come from one of two places, never from typed text:
- `Read`: a number a chapter's committed outputs print, found by a pattern in the outputs of the cells under one
  section heading (so the link to that section is where the reader sees the number computed);
- `Computed`: a function of `labs.course.source_checks`, run when the book is built.
A claim the course cannot grade yet says what would decide it (`Pending`).

    from labs.course import sources, qwen_guide_claims
    sources.rows(qwen_guide_claims.CLAIMS)        # one dict per claim: claim, verdict, number, where
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from myst_parser.mdit_to_docutils.base import default_slugify

from labs import ROOT
from labs.table import Table

NOTEBOOKS = ROOT / "notebooks"
PAGE_DIR = "notebooks"            # the chapters as the book's page (book/from_the_sources.md) reaches them
VERDICTS = ("true", "partly", "false", "not checkable here", "not yet graded")
TUTORIALS = {"000": "the Qwen-7B guide", "001": "the DeepSpeed chapter"}
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR_LEVELS = 3                 # myst_heading_anchors in book/_config.yml


# ---------------------------------------------------------------------------------------------- where numbers come from
@dataclass(frozen=True)
class Read:
    """Numbers a chapter prints: the first match of `pattern` (a regex whose groups are the numbers, in order of
    `names`) in the outputs of the cells under `heading` of notebooks/`chapter`.ipynb."""
    chapter: str
    heading: str
    pattern: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Computed:
    """Numbers computed when the page is built: `function()` returns a dict; `names` are the keys used. `see` is an
    optional (chapter, heading) where a chapter treats the topic."""
    function: Callable[[], dict]
    names: tuple[str, ...]
    see: tuple[str, str] | None = None


@dataclass(frozen=True)
class Pending:
    """A claim a chapter will grade that is not on main yet (`where`), or that nothing grades yet."""
    where: str


@dataclass(frozen=True)
class Claim:
    """One claim: the tutorial ("000" or "001"), its section, the claim in English (`said`), the verdict, a reason
    and the deciding number as templates over the values of `sources` (str.format fields)."""
    tutorial: str
    section: str
    said: str
    verdict: str
    why: str
    number: str = ""
    sources: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}: one of {VERDICTS}")


# ---------------------------------------------------------------------------------------------- the chapters' outputs
def heading_text(markdown: str) -> str:
    """A heading's text as MyST reads it for its anchor: inline code and emphasis markers dropped."""
    return re.sub(r"`|\*\*|(?<!\w)_|_(?!\w)", "", markdown).strip()


def anchor(heading: str) -> str:
    """The anchor MyST gives a heading (myst_heading_anchors: GitHub-style slugs)."""
    return default_slugify(heading_text(heading))


@lru_cache(maxsize=None)
def sections(chapter: str) -> dict[str, dict]:
    """{heading: {"level", "anchor", "outputs"}} for every heading of a chapter; "outputs" is the text every cell under
    the heading printed (until the next heading of the same or a higher level), one output per list entry."""
    cells = json.loads((NOTEBOOKS / f"{chapter}.ipynb").read_text())["cells"]
    found, open_, slugs = {}, [], set()
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                match = HEADING.match(line)
                if match:
                    level, text = len(match.group(1)), match.group(2)
                    open_ = [h for h in open_ if found[h]["level"] < level]
                    slug = anchor(text)
                    while slug in slugs:       # MyST numbers repeated slugs
                        slug = f"{anchor(text)}-{sum(s.startswith(anchor(text)) for s in slugs)}"
                    slugs.add(slug)
                    found[text] = {"level": level, "anchor": slug, "outputs": []}
                    open_.append(text)
        for heading in open_:
            found[heading]["outputs"] += [_text(out) for out in cell.get("outputs", [])]
    return found


def _text(output: dict) -> str:
    if "text" in output:
        return "".join(output["text"])
    return "".join(output.get("data", {}).get("text/plain", ""))


def read(source: Read) -> dict[str, str]:
    """The numbers `source` names, as the chapter printed them. Raises LookupError naming what is missing."""
    found = sections(source.chapter)
    if source.heading not in found:
        raise LookupError(f"{source.chapter}: no heading {source.heading!r}")
    pattern = re.compile(source.pattern, re.MULTILINE)
    for text in found[source.heading]["outputs"]:
        match = pattern.search(text)
        if match:
            return dict(zip(source.names, match.groups()))
    raise LookupError(f"{source.chapter}, section {source.heading!r}: no output matches {source.pattern!r}")


def values(claim: Claim) -> dict:
    """Every value the claim's templates use, read or computed now."""
    got = {}
    for source in claim.sources:
        if isinstance(source, Read):
            got.update(read(source))
        elif isinstance(source, Computed):
            result = source.function()
            got.update({name: result[name] for name in source.names})
    return got


# ---------------------------------------------------------------------------------------------- the page's rows
def chapter_link(chapter: str, heading: str) -> str:
    """A MyST link from the page to a chapter's section, labelled with the chapter number and the heading."""
    section = sections(chapter)[heading]
    return f"[ch. {int(chapter[:2])}, {heading_text(heading)}]({PAGE_DIR}/{chapter}.ipynb#{section['anchor']})"


def links(claim: Claim) -> list[str]:
    """Where the numbers are computed: the chapter sections read, the page itself, chapter 6 when pending."""
    where = []
    for source in claim.sources:
        if isinstance(source, Read):
            where.append(chapter_link(source.chapter, source.heading))
        elif isinstance(source, Computed):
            where.append(f"this page: `{source.function.__name__}`" + (
                f" (see {chapter_link(*source.see)})" if source.see else ""))
        elif isinstance(source, Pending):
            where.append(source.where)
    return list(dict.fromkeys(where))


def rows(claims: list[Claim]) -> list[dict]:
    """One row per claim, its templates filled with the values read or computed now."""
    out = []
    for number, claim in enumerate(claims, 1):
        got = values(claim)
        out.append({"id": f"{claim.tutorial}.{number}", "section": claim.section, "claim": claim.said,
                    "verdict": claim.verdict, "why": claim.why.format(**got), "number": claim.number.format(**got) or "-",
                    "where": "; ".join(links(claim))})
    return out


def table(claims: list[Claim]) -> Table:
    return Table(rows(claims), [("", "id", ""), ("section", "section", ""), ("the tutorial says", "claim", ""),
                                ("verdict", lambda r: f"**{r['verdict']}**: {r['why']}", ""),
                                ("the number that decides it", "number", ""), ("computed in", "where", "")])


def verdict_counts(groups: dict[str, list[Claim]]) -> Table:
    """How many claims of each tutorial got each verdict."""
    counts = [{"tutorial": f"{t} ({TUTORIALS[t]})", **{v: sum(c.verdict == v for c in claims) for v in VERDICTS},
               "claims": len(claims)} for t, claims in groups.items()]
    return Table(counts)

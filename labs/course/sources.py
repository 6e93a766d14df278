"""The book's "from the sources" page: the checkable claims of the two tutorials the course takes its topics from
(those a chapter computes or measures something for, not every sentence), graded, each with the number that decides
it and a link to the chapter section whose cell computes that number.

The numbers are never typed here. A claim names where they are printed (`Read`): a regex whose groups are the
numbers, matched against the stored outputs of the cells under one section heading of a chapter. The link goes to
that heading, so a reader who follows it lands on the cell that computed the number. `See` links a section
without reading a number from it (for claims that no number decides, or that nothing here can check). The few
claims no chapter computes are decided by a labs function run when the page is built (`Computed`); a function that
also returns a "verdict" decides the claim's verdict, and the page stops if the one typed in the claim differs.

    from labs.course import sources, source_claims
    sources.rows(source_claims.CLAIMS["000"])     # one dict per claim: id, claim, verdict, why, number, where
    sources.markdown(source_claims.CLAIMS["000"]) # the same as MyST, for the page
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
VERDICTS = ("true", "partly", "false", "not checkable here")
TUTORIALS = {"000": "the Qwen-7B guide", "001": "the DeepSpeed chapter"}
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR_LEVELS = 3                 # myst_heading_anchors in book/_config.yml: deeper headings get no anchor


@dataclass(frozen=True)
class See:
    """A chapter section that treats the claim: notebooks/`chapter`.ipynb, under `heading` (as written there)."""
    chapter: str
    heading: str


@dataclass(frozen=True)
class Read(See):
    """Numbers a chapter prints: the first match of `pattern` (groups named in `names`, in order) in the outputs of
    the cells under the section."""
    pattern: str = ""
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Computed:
    """Numbers no chapter prints, computed by a labs function when the page is built: `function()` returns a dict
    of strings, `names` are the keys used; `see` is the chapter section that treats the topic. A function that
    returns a "verdict" too decides the claim's: `values` refuses a claim whose typed verdict differs."""
    function: Callable[[], dict]
    names: tuple[str, ...]
    see: See


@dataclass(frozen=True)
class Claim:
    """One claim: the tutorial ("000" or "001"), its section, the claim in our English (`said`), the verdict, and
    the reason and the deciding number as templates over the values the `sources` read (str.format fields)."""
    tutorial: str
    section: str
    said: str
    verdict: str
    why: str
    number: str = ""
    sources: tuple[See, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}: one of {VERDICTS}")
        if self.verdict != "not checkable here" and not self.sources:
            raise ValueError(f"{self.said!r}: a graded claim needs the section that decides it")


# ---------------------------------------------------------------------------------------------- the chapters' outputs
def heading_text(markdown: str) -> str:
    """A heading's text as MyST reads it for its anchor: inline code and emphasis markers dropped."""
    return re.sub(r"`|\*\*|(?<!\w)_|_(?!\w)", "", markdown).strip()


def anchor(heading: str) -> str:
    """The anchor MyST gives a heading (myst_heading_anchors: GitHub-style slugs)."""
    return default_slugify(heading_text(heading))


@lru_cache(maxsize=None)
def sections(chapter: str) -> dict[str, dict]:
    """{heading: {"level", "anchor", "outputs"}} for every heading of a chapter; "outputs" is the text of every
    output of the cells under the heading (until the next heading of the same or a higher level)."""
    cells = json.loads((NOTEBOOKS / f"{chapter}.ipynb").read_text())["cells"]
    found, open_, slugs = {}, [], []
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                match = HEADING.match(line)
                if match:
                    level, text = len(match.group(1)), match.group(2)
                    open_ = [h for h in open_ if found[h]["level"] < level]
                    slug = anchor(text)
                    repeats = slugs.count(slug)       # MyST numbers a repeated slug: slug-1, slug-2, ...
                    slugs.append(slug)
                    found[text] = {"level": level, "anchor": f"{slug}-{repeats}" if repeats else slug, "outputs": []}
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


def values(claim: Claim) -> dict[str, str]:
    """Every value the claim's templates use, read now from the chapters' stored outputs."""
    got = {}
    for source in claim.sources:
        if isinstance(source, Read):
            got.update(read(source))
        elif isinstance(source, Computed):
            result = source.function()
            if "verdict" in result and result["verdict"] != claim.verdict:
                raise ValueError(f"{claim.said!r}: the verdict is {claim.verdict!r}, but "
                                 f"{source.function.__name__} decides {result['verdict']!r}")
            got.update({name: str(result[name]) for name in source.names})
    return got


# ---------------------------------------------------------------------------------------------- the page's rows
def link(source: See | Computed) -> str:
    """A MyST link from the page to a chapter's section, labelled with the chapter number and the heading (for a
    computed number: the function's name, then the section that treats the topic)."""
    if isinstance(source, Computed):
        return f"this page, by `{source.function.__module__}.{source.function.__name__}` (see {link(source.see)})"
    section = sections(source.chapter).get(source.heading)
    if section is None or section["level"] > ANCHOR_LEVELS:
        raise LookupError(f"{source.chapter}: no heading {source.heading!r} of level <= {ANCHOR_LEVELS}")
    return (f"[ch. {int(source.chapter[:2])}, {heading_text(source.heading)}]"
            f"({PAGE_DIR}/{source.chapter}.ipynb#{section['anchor']})")


def rows(claims: list[Claim]) -> list[dict]:
    """One row per claim, its templates filled with the values read now."""
    out = []
    for number, claim in enumerate(claims, 1):
        got = values(claim)
        out.append({"id": f"{claim.tutorial}.{number}", "section": claim.section, "claim": claim.said,
                    "verdict": claim.verdict, "why": claim.why.format(**got),
                    "number": claim.number.format(**got) or "-",
                    "where": "; ".join(dict.fromkeys(link(s) for s in claim.sources)) or "-"})
    return out


def markdown(claims: list[Claim]) -> str:
    """The claims as MyST: one short block per claim (a table of such long cells would not read)."""
    blocks = []
    for claim, row in zip(claims, rows(claims)):
        computed = any(isinstance(s, (Read, Computed)) for s in claim.sources)
        number = row["number"] if row["number"] != "-" else "none computed here"
        blocks.append(f"**{row['id']}** ({row['section']}). *The tutorial says:* {row['claim']}\n\n"
                      f"- **Verdict: {row['verdict']}.** {row['why'][:1].upper()}{row['why'][1:]}\n"
                      f"- **The number that decides it:** {number}\n"
                      f"- **{'Computed in' if computed else 'Where to check'}:** {row['where']}\n")
    return "\n".join(blocks)


def verdict_counts(groups: dict[str, list]) -> Table:
    """How many claims of each tutorial got each verdict."""
    counts = [{"tutorial": f"{t} ({TUTORIALS[t]})", **{v: sum(c.verdict == v for c in claims) for v in VERDICTS},
               "claims": len(claims)} for t, claims in groups.items()]
    return Table(counts)

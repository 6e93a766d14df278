"""The one table formatter: rows of dicts shown as an HTML table in a notebook (and in the book) and as aligned
text in a terminal or a log.

    Table(rows, ["stage", ("peak GiB", lambda r: r["peak_bytes"] / 2**30, ".1f"), ("ratio", "ratio", ".3f")])

A column is a key of the rows, or (header, key or function of the row, format spec). Cells are formatted once,
so the HTML and the text show the same digits (and a notebook checked by nbval pins exactly those).
"""
from __future__ import annotations

import html
import re


class Table:
    def __init__(self, rows: list[dict], columns=None, formats: dict | None = None):
        columns = columns or (list(rows[0]) if rows else [])
        formats = formats or {}
        self.headers, self.cells = [], [[] for _ in rows]
        for column in columns:
            header, key, spec = column if isinstance(column, tuple) else (column, column, formats.get(column, ""))
            self.headers.append(header)
            for cells, row in zip(self.cells, rows):
                value = key(row) if callable(key) else row[key]
                cells.append(spec.format(value) if "{" in spec else format(value, spec))
        self.numeric = [all(_numeric(cells[i]) for cells in self.cells) and bool(self.cells)
                        for i in range(len(self.headers))]

    def __str__(self) -> str:
        widths = [max([len(h)] + [len(c[i]) for c in self.cells]) for i, h in enumerate(self.headers)]

        def line(values):
            return "  ".join(v.rjust(w) if num else v.ljust(w)
                             for v, w, num in zip(values, widths, self.numeric)).rstrip()

        return "\n".join([line(self.headers), line(["-" * w for w in widths])] + [line(c) for c in self.cells])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def cell(tag, value, num):
            style = ' style="text-align: right"' if num else ' style="text-align: left"'
            return f"<{tag}{style}>{html.escape(value)}</{tag}>"

        head = "".join(cell("th", h, n) for h, n in zip(self.headers, self.numeric))
        body = "".join("<tr>" + "".join(cell("td", v, n) for v, n in zip(c, self.numeric)) + "</tr>"
                       for c in self.cells)
        return f'<table class="dataframe labs-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _numeric(text: str) -> bool:
    """A number as the formats write it (1,234  -0.5  12.5%  1.63x  1e-05), or a dash for 'none'."""
    return text.strip() == "-" or _NUMBER.fullmatch(text.strip()) is not None


_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?\s*(?:%|x)?")

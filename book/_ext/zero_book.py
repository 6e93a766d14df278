"""The book's own Sphinx extension: what the book build does to the chapters' stored notebooks before myst-nb
renders them, without touching the notebook files.

On every chapter (a document under notebooks/) at `source-read`:
- build noise is dropped from stdout (DeepSpeed's logger lines, its op-builder messages); stderr is removed by
  `nb_output_stderr: remove` in _config.yml, and streams are merged by `nb_merge_streams: true`;
- every ipywidgets output gets a note after it: the widget needs a live kernel, the static page shows its twin;
- a last cell is appended: "labs code used in this chapter" (each labs name the code cells call, linked to its
  line in a highlighted copy of the source), and the next page in the table of contents.
At `build-finished`, every labs/**/*.py is written as highlighted HTML under _labs_source/ for those links.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import yaml
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

ROOT = Path(__file__).resolve().parents[2]
LABS = ROOT / "labs"
SOURCE_DIR = "_labs_source"           # under the HTML output folder
NOISE = [re.compile(p) for p in (
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING)\] ",   # DeepSpeed's logger
    r"^DeepSpeed \S+ built successfully$",                                  # its op builder
    r"^(Using|Emitting ninja|Building extension|Loading extension|ninja: |Time to load) ",
)]
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("This output is an interactive widget: it needs a live Jupyter kernel (run the chapter with "
               "<code>make lab</code>) and cannot respond on this static page. The book shows its static twin "
               "instead: a plain call (for the memory calculator, <code>labs.course.widgets.memory_bar()</code>) "
               "that draws the same chart for the default settings.")


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


def clean_outputs(outputs: list[dict]) -> list[dict]:
    """Outputs without build noise: noisy lines leave stdout, and a stream left empty goes."""
    kept = []
    for out in outputs:
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            text = "".join(out["text"]) if isinstance(out["text"], list) else out["text"]
            lines = text.splitlines(keepends=True)
            clean = "".join(line for line in lines if not is_noise(line.rstrip("\r\n")))
            if lines and not clean.strip() and text.strip():
                continue
            out = dict(out, text=clean)
        kept.append(out)
        if WIDGET in out.get("data", {}):
            kept.append({"output_type": "display_data", "metadata": {},
                         "data": {"text/html": '<div class="admonition note widget-static-note">'
                                               f'<p class="admonition-title">Interactive only</p><p>{WIDGET_NOTE}</p></div>',
                                  "text/plain": re.sub("</?code>", "", WIDGET_NOTE)}})
    return kept


# ---- which labs names a chapter's code calls, and where each is defined ----

def module_file(module: str) -> Path | None:
    """labs.course.stages -> labs/course/stages.py (a package: its __init__.py); None if not a labs module."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _tree(module: str) -> ast.Module:
    return ast.parse(module_file(module).read_text())


def resolve(module: str, name: str, depth: int = 0) -> tuple[str, str, int] | tuple[str, None, None] | None:
    """Where `module.name` is defined: ("module", "name", line) for a function, class or constant; ("module",
    None, None) when `module.name` is itself a module; None when unknown. Follows `from X import name`."""
    if depth > 5 or module_file(module) is None:
        return None
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return module, name, node.lineno
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return module, name, node.lineno
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labs"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if module_file(f"{node.module}.{alias.name}"):
                        return f"{node.module}.{alias.name}", None, None
                    return resolve(node.module, alias.name, depth + 1)
    if module_file(f"{module}.{name}"):
        return f"{module}.{name}", None, None
    return None


def _code(source: str) -> ast.Module | None:
    """A code cell as Python: IPython magics and shell escapes blanked; None if it still does not parse."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def labs_uses(sources: list[str]) -> dict[str, dict[str, int]]:
    """{labs module: {name: line}} for every labs function, class or constant the code cells call or read
    (imported directly, or as `module.name` on an imported labs module). Modules used whole map to {}."""
    bound: dict[str, str] = {}            # local name -> labs module it names
    uses: dict[str, dict[str, int]] = {}

    def note(module, name):
        found = resolve(module, name)
        if found is None:
            return None
        where, what, line = found
        uses.setdefault(where, {})
        if what is not None:
            uses[where][what] = line
        return where if what is None else None

    trees = [t for t in map(_code, sources) if t is not None]
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("labs") and module_file(alias.name) and alias.asname:
                        bound[alias.asname] = alias.name
                        uses.setdefault(alias.name, {})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labs"):
                for alias in node.names:
                    sub = note(node.module, alias.name)
                    if sub:
                        bound[alias.asname or alias.name] = sub
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                sub = note(bound[node.value.id], node.attr)
                if sub:
                    uses.setdefault(sub, {})
    # A package imported whole whose names all live in its submodules says nothing: leave it out.
    return {m: names for m, names in sorted(uses.items()) if names or module_file(m).name != "__init__.py"}


def source_href(module: str, depth: int, line: int | None = None) -> str:
    path = module_file(module).relative_to(ROOT).as_posix()
    return "../" * depth + f"{SOURCE_DIR}/{path}.html" + (f"#L-{line}" if line else "")


def uses_markdown(uses: dict[str, dict[str, int]], depth: int) -> str:
    """The "labs code used in this chapter" list: one line per file, each name linked to its definition."""
    lines = []
    for module, names in uses.items():
        path = module_file(module).relative_to(ROOT).as_posix()
        head = f'<a href="{source_href(module, depth)}">`{path}`</a>'
        links = ", ".join(f'<a href="{source_href(module, depth, line)}">`{name}`</a>'
                          for name, line in sorted(names.items(), key=lambda item: item[1]))
        lines.append(f"- {head}" + (f": {links}" if links else ""))
    return "\n".join(lines)


def toc_order(toc_file: Path) -> list[str]:
    """The documents of _toc.yml in reading order (root first)."""
    toc = yaml.safe_load(toc_file.read_text())
    order = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                order.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    walk(toc.get("chapters"))
    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    return order


def footer_cell(uses: dict, depth: int, next_doc: str | None) -> dict:
    text = ["## labs code used in this chapter", "",
            "The code cells above call these parts of the `labs` package (added by the book build: each name "
            "links to its definition in a highlighted copy of the source; the files are in the repository).", "",
            uses_markdown(uses, depth) or "- none"]
    if next_doc:
        text += ["", f"**Next:** {{doc}}`/{next_doc}`"]
    return {"cell_type": "markdown", "metadata": {}, "source": "\n".join(text)}


def rewrite_notebook(text: str, depth: int, next_doc: str | None) -> str:
    nb = json.loads(text)
    sources = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = clean_outputs(cell.get("outputs", []))
            sources.append("".join(cell["source"]))
    footer = footer_cell(labs_uses(sources), depth, next_doc)
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
        footer["id"] = "labs-code-used-in-this-chapter"      # cell ids exist from nbformat 4.5 on
    nb["cells"].append(footer)
    return json.dumps(nb)


# ---- Sphinx hooks ----

def _source_read(app, docname, source):
    if not docname.startswith("notebooks/") or not app.env.doc2path(docname).endswith(".ipynb"):
        return
    order = toc_order(Path(app.srcdir) / "_toc.yml")
    position = order.index(docname) if docname in order else None
    next_doc = order[position + 1] if position is not None and position + 1 < len(order) else None
    source[0] = rewrite_notebook(source[0], docname.count("/"), next_doc)


def _write_sources(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    formatter = HtmlFormatter(linenos="inline", lineanchors="L", anchorlinenos=True, full=True)
    for path in sorted(LABS.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        formatter.title = relative
        target = Path(app.outdir) / SOURCE_DIR / f"{relative}.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(highlight(path.read_text(), PythonLexer(), formatter))


def setup(app):
    app.connect("source-read", _source_read)
    app.connect("build-finished", _write_sources)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""The built book (book/_build/html) in headless Chromium, served on 127.0.0.1: every page opens with no console
error and nothing fetched from off the site, every chapter shows each of its notebook's figures as a loaded image,
every link within the site reaches a page and anchor that exist, and no text is cut off at a 1,400 px wide
viewport (the rule is in page_checks.js). Screenshots of the intro and chapter 1 are kept in
book/_build/screenshots/. Runs after `make book` (`make browser`)."""
import functools
import http.server
import json
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from browser_setup import browser, skip_or_fail  # noqa: F401 (browser: the fixture)

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "book" / "_build" / "html"
SCREENSHOTS = ROOT / "book" / "_build" / "screenshots"
# What a reader sees in the 1,400 x 900 window (a full-page capture redraws the sticky sidebars wrongly): the
# intro, and chapter 1 at its top and at its first figure.
SCREENSHOT_PAGES = {"intro.html": ["intro.png"], "notebooks/01_memory_math.html": ["01_memory_math.png",
                                                                                    "01_memory_math_figure.png"]}
PAGE_CHECKS = (Path(__file__).parent / "page_checks.js").read_text()
# Measure once the web fonts are in and two frames have been drawn: boxes measured earlier can still change size.
SETTLED = "document.fonts.ready.then(() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))))"


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        # Browsers ask every host for /favicon.ico unasked; the book has none and links none.
        if self.path == "/favicon.ico":
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site():
    if not (HTML / "intro.html").exists():
        skip_or_fail(f"the book is not built: {HTML.relative_to(ROOT)}/intro.html is missing (run `make book`)")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(HTML)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


def book_pages() -> list[str]:
    """Every HTML page of the build, as paths relative to its root (index.html only redirects: tested apart)."""
    return sorted(p.relative_to(HTML).as_posix() for p in HTML.rglob("*.html")
                  if not p.relative_to(HTML).parts[0].startswith("_") and p.name != "index.html")


@pytest.fixture(scope="module")
def visits(browser, site):
    """{page: what page_checks.js read, plus 'errors' (console errors, page errors, failed or off-site requests)}."""
    page = browser.new_page()
    current = {"name": None}
    errors: dict[str, list[str]] = {}

    def note(text):
        errors.setdefault(current["name"], []).append(text)

    def route(request_route):
        url = request_route.request.url
        if url.startswith(site):
            request_route.continue_()
        else:   # same answer with or without internet: nothing off the site is loaded
            note(f"fetches {url} from off the site (blocked: an offline reader does not get it)")
            request_route.abort()

    page.route("**/*", route)
    page.on("console", lambda message: message.type == "error" and note(
        f"console error: {message.text} (at {message.location.get('url', '?')}:{message.location.get('lineNumber')})"))
    page.on("pageerror", lambda error: note(f"uncaught script error: {error}"))
    page.on("response", lambda response: response.status >= 400 and note(
        f"HTTP {response.status} for {response.url}"))
    page.on("requestfailed", lambda request: request.url.startswith(site) and note(
        f"request failed: {request.url} ({request.failure})"))
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    results = {}
    for name in book_pages():
        current["name"] = name
        page.goto(site + name, wait_until="load")
        page.evaluate(SETTLED)
        results[name] = page.evaluate(PAGE_CHECKS)
        for shot in SCREENSHOT_PAGES.get(name, []):
            if shot.endswith("_figure.png"):
                page.locator(".cell_output img").first.scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / shot)
    page.close()
    for name, result in results.items():
        result["errors"] = errors.get(name, [])
    return results


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n  " + "\n  ".join(problems)


def test_every_chapter_is_a_page(visits):
    chapters = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    toc = (ROOT / "book" / "_toc.yml").read_text()
    listed = {c for c in chapters if f"notebooks/{c}" in toc}
    assert listed and {f"notebooks/{c}.html" for c in listed} <= set(visits), sorted(listed)
    assert "intro.html" in visits


def test_no_console_errors_and_nothing_off_site(visits):
    problems = [f"{page}: {error}" for page, result in visits.items() for error in result["errors"]]
    assert not problems, _report(problems)


def _image_outputs(notebook: Path) -> int:
    """How many figures a chapter's stored outputs hold (cells the book removes do not count)."""
    shown = [cell for cell in json.loads(notebook.read_text())["cells"]
             if not {"remove-output", "remove-cell"} & set(cell.get("metadata", {}).get("tags", []))]
    return sum(1 for cell in shown for output in cell.get("outputs", [])
               if any(key.startswith("image/") for key in output.get("data", {})))


def test_every_figure_is_a_loaded_image(visits):
    problems = []
    for page, result in visits.items():
        for image in result["images"]:
            if not (image["complete"] and image["natural_width"] > 0):
                problems.append(f"{page}: image {image['src'][:100]} did not load (naturalWidth 0)")
            elif not image["shown"]:
                problems.append(f"{page}: image {image['src'][:100]} loaded but has no size on the page")
        notebook = ROOT / "book" / Path(page).with_suffix(".ipynb")
        if notebook.exists():
            expected = _image_outputs(notebook)
            shown = sum(1 for image in result["images"] if image["in_output"])
            if shown != expected:
                problems.append(f"{page}: {shown} images in cell outputs, but {notebook.name} stores {expected}")
    assert not problems, _report(problems)


def test_internal_links_reach_a_page_and_anchor(visits, site):
    ids = {page: set(result["ids"]) for page, result in visits.items()}
    problems = []
    for page, result in visits.items():
        for link in result["links"]:
            if not link["href"].startswith(site):
                continue                                  # off-site links are not followed (no internet in CI)
            parts = urlsplit(link["href"])
            target = unquote(parts.path)[len(urlsplit(site).path):] or "index.html"
            if target.endswith("/"):
                target += "index.html"
            label = f"{page}: link {link['raw']!r} ({link['text']!r})"
            if not (HTML / target).is_file():
                problems.append(f"{label} points to {target}, which is not in the build")
            elif parts.fragment and target in ids and unquote(parts.fragment) not in ids[target]:
                problems.append(f"{label}: {target} has no element with id {unquote(parts.fragment)!r}")
    assert not problems, _report(problems)


def test_no_text_cut_off_or_spilling(visits):
    problems = []
    for page, result in visits.items():
        width = result["page_width"]
        if width["scroll"] > width["client"] + 1:
            problems.append(f"{page}: the page is {width['scroll']} px wide in a {width['client']} px window")
        problems += [f"{page}: {o['element']} {o['how']}: content {o['scroll_width']} x {o['scroll_height']} px "
                     f"in a {o['client_width']} x {o['client_height']} px box (overflow {o['overflow']})"
                     for o in result["overflows"]]
    assert not problems, _report(problems)


def test_index_redirects_to_the_intro(browser, site):
    page = browser.new_page()
    page.goto(site + "index.html")
    page.wait_for_url(site + "intro.html", timeout=10_000)
    page.close()


def test_screenshots_kept(visits):
    for path in [SCREENSHOTS / shot for shots in SCREENSHOT_PAGES.values() for shot in shots]:
        assert path.exists() and path.stat().st_size > 10_000, f"{path} missing or empty"


def test_overflow_rule_catches_real_cut_off(browser):
    """page_checks.js against a page built to fail it: clipped and spilling text are caught, a scrolling block
    and wrapping text are not (a check that cannot fail proves nothing)."""
    page = browser.new_page()
    long = "x" * 400
    page.set_content(f"""<article style="width: 600px">
      <pre id="clipped" style="overflow: hidden">{long}</pre>
      <div id="spilling"><code style="white-space: pre">{long}</code></div>
      <pre id="scrolls" style="overflow-x: auto">{long}</pre>
      <pre id="no-bar" style="overflow-x: auto; scrollbar-width: none">{long}</pre>
      <p id="wraps">{"word " * 200}</p>
      <div id="cut-below" style="height: 20px; overflow: hidden"><p>one</p><p>two</p><p>three</p></div>
      <div id="nested" style="overflow: hidden"><div><pre id="inner" style="overflow: visible">{long}</pre></div></div>
    </article>""")
    found = {o["element"].split()[0].split(".")[0]: o["how"] for o in page.evaluate(PAGE_CHECKS)["overflows"]}
    page.close()
    assert found == {"pre#clipped": "cut off on the right", "div#spilling": "spills out of its box",
                     "pre#no-bar": "scrolls, but shows no scrollbar",
                     "div#cut-below": "cut off at the bottom", "pre#inner": "spills out of its box"}, found

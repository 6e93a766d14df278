"""Chapter 1's memory calculator, live: JupyterLab on 127.0.0.1 with a token, the chapter opened in headless
Chromium, only the cells the calculator needs run (the imports, then `widgets.calculator()`; the chapter's
training launches are not), one control changed, and the chart must redraw. Then every process the test started
(the server, its kernel) must be gone.

JupyterLab serves a copy of the notebook at the same path (notebooks/01_memory_math.ipynb) in a temporary folder:
it writes checkpoints beside the notebooks it opens, and the checkout must stay as it was (tests/conftest.py)."""
import json
import shutil
import time
from pathlib import Path

from browser_setup import browser  # noqa: F401 (the fixture)
from lab_server import Lab, tagged_processes

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "notebooks/01_memory_math.ipynb"
# the chapter's import line of labs.course (the one that brings `widgets`), read from the notebook: the line changes
# as the chapter does, the test's question does not
IMPORT_CELL = next(line.strip() for cell in json.loads((ROOT / NOTEBOOK).read_text())["cells"]
                   for line in cell["source"] if line.startswith("from labs.course import") and "widgets" in line)
CALCULATOR_CELL = "calc = widgets.calculator()"
TIMEOUT_MS = 120_000     # a cold JupyterLab on two busy cores takes tens of seconds to build its page


def _wait_for_idle_kernel(lab: Lab, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(k["execution_state"] == "idle" and k["connections"] for k in lab.api("GET", "/api/kernels")):
            return
        time.sleep(0.3)
    raise AssertionError(f"no idle kernel after {timeout} s: {lab.api('GET', '/api/kernels')}\n{lab.log_tail()}")


def _cell(page, text):
    cells = page.locator(".jp-Notebook .jp-Cell").filter(has=page.locator(".jp-InputArea-editor", has_text=text))
    assert cells.count() == 1, f"{cells.count()} cells of {NOTEBOOK} contain {text!r}, expected one"
    return cells


def _run(page, text):
    """Select the cell that contains `text` and run it as a reader does (Shift+Enter); wait for its prompt's
    execution count."""
    cell = _cell(page, text)
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function("prompt => /\\[\\d+\\]/.test(prompt.innerText)",
                           arg=cell.locator(".jp-InputPrompt").element_handle(), timeout=TIMEOUT_MS)
    return cell


def _drive(page, lab: Lab):
    page.goto(lab.url(f"lab/tree/{NOTEBOOK}"))
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden)", timeout=TIMEOUT_MS)
    _wait_for_idle_kernel(lab)
    page.wait_for_timeout(1500)       # JupyterLab updates the stored kernelspec once the session is up
    tab = page.locator(".lm-TabBar-tab", has_text=Path(NOTEBOOK).name)
    assert "jp-mod-dirty" not in (tab.get_attribute("class") or ""), \
        f"JupyterLab marks {NOTEBOOK} modified as soon as it opens (stored kernelspec or nbformat differs?)"

    _run(page, IMPORT_CELL)
    calculator = _run(page, CALCULATOR_CELL)
    chart = calculator.locator(".widget-output img")
    try:
        chart.wait_for(timeout=TIMEOUT_MS)
    except Exception as error:
        raise AssertionError(f"the calculator drew no chart; its output:\n{calculator.inner_text()[-3000:]}") from error
    before = chart.get_attribute("src")

    stage = calculator.locator(".widget-dropdown", has=page.locator("label", has_text="ZeRO stage")).locator("select")
    assert stage.input_value() == "3", f"the calculator starts at ZeRO stage {stage.input_value()}, expected 3"
    stage.select_option(label="1")
    page.wait_for_function(
        "([cell, old]) => { const img = cell.querySelector('.widget-output img'); return img && img.src !== old; }",
        arg=[calculator.element_handle(), before], timeout=TIMEOUT_MS)
    after = chart.get_attribute("src")
    assert after.startswith("data:image/png") and after != before


def test_calculator_redraws_when_a_control_changes(browser, tmp_path):
    served = tmp_path / "course"
    (served / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / NOTEBOOK, served / NOTEBOOK)
    lab = Lab(served, tmp_path / "jupyter")
    started = []
    try:
        lab.start()
        page = browser.new_page()
        try:
            _drive(page, lab)
            started = tagged_processes(lab.mark)
        finally:
            page.close()
    finally:
        left = lab.stop()
    assert len(started) >= 2, f"expected the server and a kernel among the test's processes, saw {started}"
    assert not left, f"still running after JupyterLab's shutdown (killed now): {left}\n{lab.log_tail()}"

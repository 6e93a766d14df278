"""The browser the browser tests use (the `browser` fixture; test modules import it), and when they may skip.

Debian's chromium (/usr/bin/chromium; LABS_CHROMIUM names another) driven by Playwright, never a browser that
Playwright downloads. Where there is none, the tests skip and say why; CI (.ci/run) sets LABS_BROWSER_TESTS=required,
which turns every such skip into a failure. A module, not tests/browser/conftest.py: a second conftest would shadow
tests/conftest.py, which other test modules import by name."""
import os
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("LABS_CHROMIUM", "/usr/bin/chromium"))
REQUIRED = os.environ.get("LABS_BROWSER_TESTS") == "required"
VIEWPORT = {"width": 1400, "height": 900}
# Chromium's own switches; Playwright adds its automation ones. Playwright's --hide-scrollbars is left out:
# the overflow check must see the scrollbars a reader sees.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing_browser() -> str | None:
    if not CHROMIUM.exists():
        return (f"no browser: {CHROMIUM} does not exist (Debian: `apt-get install -y chromium`; "
                f"LABS_CHROMIUM=/path names another Chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no browser driver: the `playwright` package is not installed (it is pinned in requirements.txt)"
    return None


def skip_or_fail(reason: str):
    """Skip for `reason`, except where CI requires these tests: then fail."""
    if REQUIRED:
        pytest.fail(f"{reason}; LABS_BROWSER_TESTS=required (CI) does not let the browser tests skip")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A fresh Chromium profile (its own --user-data-dir) at a 1,400 px wide viewport; yields the context."""
    if reason := missing_browser():
        skip_or_fail(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=ARGS, ignore_default_args=["--hide-scrollbars"], viewport=VIEWPORT)
        try:
            yield context
        finally:
            context.close()

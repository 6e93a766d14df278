"""Each page lists an inline script once.

Sphinx 7.4 keeps an inline script that an extension adds once the builder exists under two names (`None` and
`''`), so the page gets it twice: sphinx-thebe's `const THEBE_JS_URL = ...` is then declared twice and every page
logs "SyntaxError: Identifier 'THEBE_JS_URL' has already been declared" (tests/browser/test_book_in_browser.py sees it)."""


def _drop_repeats(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen, unique = set(), []
    for script in scripts:
        key = (script.filename or "", script.priority, tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique


def setup(app):
    app.connect("html-page-context", _drop_repeats, priority=900)   # after the extensions that add page scripts
    return {"parallel_read_safe": True, "parallel_write_safe": True}

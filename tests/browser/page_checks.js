// What tests/browser/test_book_in_browser.py reads off one rendered page, evaluated in the page once it has loaded.
// Returns {ids, links, images, overflows, page_width}.
//
// Overflow, precisely: a box cuts its text off when its content is wider (or, clipped, taller) than the box by
// more than 1 px (scrollWidth > clientWidth + 1) and the box offers no scrollbar for it:
//   - overflow-x auto or scroll: a scrollbar is offered; not a failure, unless the scrollbar has no thickness
//     (hidden by CSS: then the reader sees cut text and no sign that it scrolls);
//   - overflow-x hidden or clip: the text past the right edge is cut off;
//   - overflow-x visible: the text spills out of its box, over the margin or the next column, or is cut by an
//     ancestor that clips it.
// Vertically only clipping counts (overflow-y hidden or clip): visible vertical overflow just grows the page.
// Only the innermost such box is reported (a spilling child makes every visible ancestor overflow too).
// Boxes inside the page's article only (the chapter's text, code, outputs, tables, figures): the theme's sidebars
// let their links run 16 px into their own padding by design. Inline boxes have no width of their own: skipped.
() => {
  const describe = (el) => {
    let name = el.tagName.toLowerCase();
    if (el.id) name += "#" + el.id;
    const classes = [...el.classList].slice(0, 3);
    if (classes.length) name += "." + classes.join(".");
    const section = el.closest("section[id]");
    const where = section ? ` in section #${section.id}` : "";
    const text = (el.innerText || el.textContent || "").replace(/\s+/g, " ").trim().slice(0, 70);
    return `${name}${where} "${text}"`;
  };
  const visible = (el) => {
    const box = el.getBoundingClientRect();
    return box.width > 0 && box.height > 0 && getComputedStyle(el).visibility !== "hidden";
  };

  const ids = [...document.querySelectorAll("[id]")].map((el) => el.id)
    .concat([...document.querySelectorAll("a[name]")].map((el) => el.getAttribute("name")));

  const links = [...document.querySelectorAll("a[href]")].map((a) => ({
    href: a.href, raw: a.getAttribute("href"), text: (a.innerText || "").trim().slice(0, 50),
  }));

  const article = document.querySelector("article") || document.querySelector("main") || document.body;
  const images = [...article.querySelectorAll("img")].map((img) => ({
    src: img.currentSrc || img.src, complete: img.complete, natural_width: img.naturalWidth,
    shown: visible(img), in_output: !!img.closest(".cell_output"), alt: img.alt || "",
  }));

  // Chromium at times keeps a scrolling box's scrollbar state from before the box's last resize: seen on about one
  // load in three here, a pre 12 px too wide with no scrollbar until anything lays it out again. Laying each
  // scrolling box out once more first makes a missing scrollbar the page's doing, not that race's.
  const relayout = (el) => {
    const inline = el.style.overflowX;
    el.style.overflowX = "hidden";
    void el.offsetHeight;
    el.style.overflowX = inline;
    void el.offsetHeight;
  };

  const failing = [];
  for (const el of article.querySelectorAll("*")) {
    const style = getComputedStyle(el);
    if (style.display === "inline" || style.display === "contents" || style.display === "none") continue;
    if (el.clientWidth === 0 || !visible(el)) continue;
    const scrolls = style.overflowX === "auto" || style.overflowX === "scroll";
    if (scrolls) relayout(el);
    const wide = el.scrollWidth - el.clientWidth > 1;
    const tall = el.scrollHeight - el.clientHeight > 1;
    const clipsX = style.overflowX === "hidden" || style.overflowX === "clip";
    const clipsY = style.overflowY === "hidden" || style.overflowY === "clip";
    const borders = parseFloat(style.borderTopWidth) + parseFloat(style.borderBottomWidth);
    const bar = el.offsetHeight - el.clientHeight - borders;      // the horizontal scrollbar's thickness
    let how = null;
    if (wide && clipsX) how = "cut off on the right";
    else if (wide && scrolls && bar < 1) how = "scrolls, but shows no scrollbar";
    else if (wide && style.overflowX === "visible") how = "spills out of its box";
    else if (tall && clipsY) how = "cut off at the bottom";
    if (how) failing.push({ el, how });
  }
  const overflows = failing
    .filter(({ el }) => !failing.some((other) => other.el !== el && el.contains(other.el)))
    .map(({ el, how }) => ({
      element: describe(el), how, scroll_width: el.scrollWidth, client_width: el.clientWidth,
      scroll_height: el.scrollHeight, client_height: el.clientHeight,
      overflow: `${getComputedStyle(el).overflowX} / ${getComputedStyle(el).overflowY}`,
    }));

  return {
    ids, links, images, overflows,
    page_width: { scroll: document.documentElement.scrollWidth, client: document.documentElement.clientWidth },
  };
}

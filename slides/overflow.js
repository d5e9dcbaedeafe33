// measureOverflow(): every page of a Marp deck (built with `--template bare`) measured as laid
// out, for slides/build.py's overflow check (overflow.mjs loads a deck in headless Chromium, waits
// until Marp's own script has scaled wide code blocks, and calls this).
//
// A page overflows when any element of its content starts above the slide, runs past its left or
// right edge, or ends below the footer line: the top of the footer or of the page number,
// whichever is higher (the slide's bottom on a page with neither). The section clips what is
// outside it, so such content is simply missing from the projected slide, or drawn over the footer.
function measureOverflow() {
  const slack = 1;  // px: sub-pixel rounding is not an overflow
  const pages = [];
  for (const section of document.querySelectorAll("section[id]")) {  // bg layers have no id
    const box = section.getBoundingClientRect();
    const scale = box.width / section.offsetWidth;  // the SVG scales slides to the window
    const width = section.offsetWidth, height = section.offsetHeight;
    let floor = height;
    const number = getComputedStyle(section, "::after");
    if (number.display !== "none" && number.content !== "none" && number.content !== '""') {
      floor = Math.min(floor, height - parseFloat(number.bottom) - parseFloat(number.height));
    }
    const footer = section.querySelector(":scope > footer");
    if (footer && footer.textContent.trim()) {
      floor = Math.min(floor, (footer.getBoundingClientRect().top - box.top) / scale);
    }
    // side -> [largest excess in px, the last element that overflows there]: elements come in
    // document order, so that is the innermost, last thing cut (a list's last item, an image
    // rather than the paragraph holding it).
    const worst = {};
    const note = (side, excess, element) => {
      if (excess > slack) worst[side] = [Math.max(excess, (worst[side] || [0])[0]), element];
    };
    for (const element of section.querySelectorAll("*")) {
      if (element.closest("footer, header")) continue;
      const r = element.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) continue;  // not rendered
      note("top", (box.top - r.top) / scale, element);
      note("left", (box.left - r.left) / scale, element);
      note("right", (r.right - box.left) / scale - width, element);
      note("bottom", (r.bottom - box.top) / scale - floor, element);
    }
    const findings = Object.entries(worst).map(([side, [excess, element]]) => ({
      side, excess: Math.round(excess), footer: floor < height,
      element: element.tagName.toLowerCase(),
      text: element.tagName === "IMG"
        ? `${Math.round(element.width)}x${Math.round(element.height)} px image`
        : element.textContent.trim().replace(/\s+/g, " ").slice(0, 60),
    }));
    if (findings.length) pages.push({page: Number(section.id), findings});
  }
  return {pages: document.querySelectorAll("section[id]").length, overflows: pages};
}

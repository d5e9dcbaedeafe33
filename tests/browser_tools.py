"""Render executed notebooks' widgets in a real (headless) browser, offline.

A widget's output in a saved notebook is only a model id; the picture exists only once the
widget JavaScript has rebuilt it from the saved widget state. So widget tests export the
executed notebook to HTML, load that page in headless Chromium, and inspect the DOM the
browser ends up with. nbconvert's page fetches require.js and the widget renderer from CDNs;
here both come from tests/browser/node_modules (``npm ci --prefix tests/browser``) and are
copied next to the HTML, and Chromium is denied all network access, so a passing test proves
the page renders from local files alone.
"""
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODE_MODULES = ROOT / "tests" / "browser" / "node_modules"
# require.js, then the AMD build of the widgets HTML manager: it defines the base and
# controls widget modules with require.js and renders every saved widget on page load.
REQUIRE_JS = NODE_MODULES / "requirejs" / "require.js"
WIDGET_JS = NODE_MODULES / "@jupyter-widgets" / "html-manager" / "dist" / "embed-amd.js"
BROWSER_TIMEOUT = 120  # seconds of wall time for one Chromium run
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
    # offline on purpose: every host fails to resolve, file:// still loads
    "--host-resolver-rules=MAP * ~NOTFOUND",
    # virtual time runs the page's scripts to completion (bounded), then the DOM is taken
    "--virtual-time-budget=15000",
]


def chromium_path():
    """CHROME_PATH if set (as for the slide builds), else a Chromium/Chrome on PATH, else None."""
    if os.environ.get("CHROME_PATH") and os.access(os.environ["CHROME_PATH"], os.X_OK):
        return os.environ["CHROME_PATH"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def widget_js_ready() -> bool:
    """True when the npm packages with require.js and the widget renderer are installed."""
    return REQUIRE_JS.is_file() and WIDGET_JS.is_file()


def require_browser():
    """Skip the calling test, saying what to install, unless Chromium and the widget JS exist."""
    missing = []
    if chromium_path() is None:
        missing.append("Chromium (apt-get install chromium, or set CHROME_PATH)")
    if not widget_js_ready():
        missing.append("the widget JavaScript (npm ci --prefix tests/browser)")
    if missing:
        pytest.skip("browser widget test needs " + " and ".join(missing))


def export_html(notebook_path, out_dir) -> Path:
    """Export an executed notebook to ``out_dir/<name>.html`` with local widget JavaScript."""
    import nbformat
    from nbconvert import HTMLExporter

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(notebook_path, as_version=4)
    if "application/vnd.jupyter.widget-state+json" not in nb.metadata.get("widgets", {}):
        raise ValueError(f"{notebook_path} has no saved widget state: execute it with "
                         "nbclient (store_widget_state=True) or save widget state in Jupyter")
    shutil.copy(REQUIRE_JS, out_dir / "require.js")
    shutil.copy(WIDGET_JS, out_dir / "embed-amd.js")
    # relative URLs keep the exported folder self-contained (it can be moved or archived)
    exporter = HTMLExporter(template_name="lab", require_js_url="require.js",
                            widget_renderer_url="embed-amd.js")
    body, _ = exporter.from_notebook_node(nb)
    html_path = out_dir / (Path(notebook_path).stem + ".html")
    html_path.write_text(body, encoding="utf-8")
    return html_path


def _chromium(*args) -> subprocess.CompletedProcess:
    browser = chromium_path()
    if browser is None:
        raise RuntimeError("Chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=BROWSER_TIMEOUT)


def dump_dom(html_path, console=None) -> str:
    """The page's DOM, serialized, after its scripts have run.

    Pass a list as ``console`` to collect the page's console messages (JavaScript errors
    included): the first thing to read when a widget did not render.
    """
    result = _chromium("--enable-logging=stderr", "--dump-dom", Path(html_path).resolve().as_uri())
    if console is not None:
        console.extend(m.group(1) for m in re.finditer(r":CONSOLE[^\]]*\] (.*)", result.stderr))
    if result.returncode != 0 or "<html" not in result.stdout:
        raise RuntimeError(f"Chromium failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def render_in_browser(notebook_path, out_dir, console=None) -> str:
    """Export an executed notebook (saved widget state), open it in Chromium, return its DOM."""
    return dump_dom(export_html(notebook_path, out_dir), console)


def screenshot(html_path, png_path, size=(1000, 1400)):
    """Save a PNG of the rendered page (widgets included) for a human to look at."""
    png_path = Path(png_path).resolve()
    result = _chromium(f"--screenshot={png_path}", f"--window-size={size[0]},{size[1]}",
                       Path(html_path).resolve().as_uri())
    if not png_path.is_file():
        raise RuntimeError(f"Chromium wrote no screenshot ({result.returncode}): "
                           f"{result.stderr[-2000:]}")
    return png_path


# ---- reading the dumped DOM -------------------------------------------------------------------
# A small CSS-selector subset (tag, .class, #id, [attr], compounds, descendant spaces) over the
# real element tree. Script contents are never parsed as elements, so the widget state JSON,
# which contains the widget's HTML as a string, cannot be mistaken for rendered elements.

class Element:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent = tag, dict(attrs), parent
        self.classes = set((self.attrs.get("class") or "").split())

    def ancestors(self):
        node = self.parent
        while node is not None:
            yield node
            node = node.parent


class _TreeBuilder(HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
            "source", "track", "wbr"}

    def __init__(self):
        super().__init__()
        self.elements, self.stack, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        element = Element(tag, attrs, self.stack[-1] if self.stack else None)
        self.elements.append(element)
        if tag not in self.VOID:
            self.stack.append(element)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if not (self.stack and self.stack[-1].tag in ("script", "style")):
            self.text.append(data)


def parse(dom: str) -> _TreeBuilder:
    tree = _TreeBuilder()
    tree.feed(dom)
    return tree


_SIMPLE = re.compile(r"([.#]?)([\w-]+)|\[([\w-]+)\]")


def _matches(element, compound) -> bool:
    for prefix, name, attr in _SIMPLE.findall(compound):
        if attr:
            ok = attr in element.attrs
        elif prefix == ".":
            ok = name in element.classes
        elif prefix == "#":
            ok = element.attrs.get("id") == name
        else:
            ok = element.tag == name
        if not ok:
            return False
    return True


def select(dom, selector: str) -> list[Element]:
    """Elements of ``dom`` (a string or a parse() result) matching a simple CSS selector."""
    tree = parse(dom) if isinstance(dom, str) else dom
    *outer, last = selector.split()
    found = []
    for element in tree.elements:
        if not _matches(element, last):
            continue
        chain = iter(element.ancestors())  # each outer part must match a further-out ancestor
        if all(any(_matches(a, part) for a in chain) for part in reversed(outer)):
            found.append(element)
    return found


def visible_text(dom) -> str:
    """The page's text outside scripts and styles (for error and placeholder checks)."""
    tree = parse(dom) if isinstance(dom, str) else dom
    return " ".join(" ".join(tree.text).split())

"""The documentation site builds without warnings, its internal links resolve, and its pages
render, as a reader sees them in headless Chromium, with their navigation and without error text.

Runs with TNT_DOCS_TESTS=1 (the docs step of .ci/run, after `pip install -e ".[docs]"`); the
default run skips it. With TNT_DOCS_TESTS=1 nothing is skipped: a missing Sphinx fails, and a
missing Chromium is installed with apt-get (Debian's `chromium`) where the test runs as root,
else fails. TNT_DOCS_BUILD=DIR uses a build made already (`sphinx -W ... docs DIR`) instead of
building one. TNT_DOCS_SCREENSHOTS=DIR keeps the screenshots there. About 30 s with a build.
"""

import functools
import html.parser
import http.server
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.environ.get("TNT_DOCS_TESTS") != "1",
                                reason="the documentation site's test runs with TNT_DOCS_TESTS=1 (.ci/run's docs step)")

# The pages a reader opens first, and text that each must show.
PAGES = {"index.html": ["tarantella", "Quick start", "Coming from Horovod"],
         "quick-start.html": ["Quick start", "tnt.Model", "tarantella -n 2"],
         "reference/api.html": ["tarantella.Model", "fit", "synchronized_batch_normalization", "get_rank"]}
# What a page shows when Sphinx, MyST, autodoc or a directive failed, or markup was not parsed.
ERROR_TEXT = re.compile(r"\bError\b|\bWARNING\b|\bERROR\b|System Message|Traceback|autodoc|"
                        r"\{(?:ref|doc|py:[a-z]+|code-block|literalinclude|toctree|eval-rst|tnt-[a-z]+)\}|"
                        r"Unknown directive|```|:::|\]\(")


@pytest.fixture(scope="module")
def site():
    given = os.environ.get("TNT_DOCS_BUILD")
    if given:
        build = pathlib.Path(given)
        assert (build / "index.html").is_file(), f"TNT_DOCS_BUILD={given} holds no built site"
        yield build
        return
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                               str(ROOT / "docs"), folder], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"the site does not build without warnings:\n{done.stderr[-5000:]}"
        yield pathlib.Path(folder)


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    assert os.geteuid() == 0 and shutil.which("apt-get"), \
        "headless Chromium is missing, and this is not root with apt-get to install it: apt-get install chromium"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    if subprocess.run(install, capture_output=True, env=env, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, f"apt-get install chromium failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    found = shutil.which("chromium")
    assert found, "apt-get installed chromium, but it is not on PATH"
    return found


def test_every_internal_link_of_the_site_resolves(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30, f"only {len(pages)} pages built"
    ids = {page: _Links.of(page).ids for page in pages}
    broken, checked = [], 0
    for page in pages:
        for href in _Links.of(page).hrefs:
            parsed = urllib.parse.urlparse(href)
            if parsed.scheme or href.startswith("//") or href.startswith("mailto:"):
                continue
            target = (page.parent / urllib.parse.unquote(parsed.path)).resolve() if parsed.path else page
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
            elif parsed.fragment and target.suffix == ".html" and target in ids and parsed.fragment not in ids[target]:
                broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert checked > 500, f"only {checked} internal links found"
    assert not broken, "broken internal links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_a_page_renders_in_chromium_with_its_navigation_and_no_error_text(page, site, server, chromium, tmp_path):
    url = f"{server}/{page}"
    dom = _chromium(chromium, tmp_path, "--dump-dom", url)
    links = _Links.parse(dom)
    navigation = [href for href in links.sidebar_hrefs if not href.startswith("http")]
    assert len(navigation) >= 15, f"{page}: the sidebar has {len(navigation)} links, not the site's navigation"
    for expected in ("installation.html", "guide.html", "running.html", "performance.html", "from-horovod.html"):
        assert any(href.split("#")[0].endswith(expected) for href in navigation), \
            f"{page}: the navigation has no link to {expected}"
    text = links.main_text
    squeezed = "".join(text.split())  # "tarantella." and "Model" are separate elements of a signature
    for expected in PAGES[page]:
        assert "".join(expected.split()) in squeezed, f"{page}: the rendered page does not show {expected!r}"
    errors = sorted({match.group(0) for match in ERROR_TEXT.finditer(text)})
    assert not errors, f"{page}: the rendered page shows error text or unparsed markup: {errors}"

    picture = tmp_path / "page.png"
    _chromium(chromium, tmp_path, f"--screenshot={picture}", "--window-size=1280,1400", url)
    data = picture.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, f"{page}: no screenshot, or a blank one"
    keep = os.environ.get("TNT_DOCS_SCREENSHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(picture, os.path.join(keep, page.replace("/", "-").replace(".html", ".png")))


def _chromium(chromium, tmp_path, *arguments):
    profile = tempfile.mkdtemp(dir=tmp_path)
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
               "--virtual-time-budget=3000", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"chromium failed: {done.stderr[-2000:]}"
    return done.stdout


class _Links(html.parser.HTMLParser):
    """The hrefs and ids of a page, the links of its sidebar, and the visible text of its article."""

    _cache = {}

    def __init__(self):
        super().__init__()
        self.hrefs, self.ids, self.sidebar_hrefs, self._text = [], set(), [], []
        self._stack = []  # (tag, in sidebar, in article, hidden)

    @classmethod
    def of(cls, path):
        if path not in cls._cache:
            cls._cache[path] = cls.parse(path.read_text())
        return cls._cache[path]

    @classmethod
    def parse(cls, text):
        parser = cls()
        parser.feed(text)
        return parser

    @property
    def main_text(self):
        return " ".join(" ".join(self._text).split())

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        sidebar, article, hidden = self._stack[-1][1:] if self._stack else (False, False, False)
        sidebar = sidebar or "sidebar-tree" in classes
        article = article or tag == "article" or attrs.get("role") == "main"
        hidden = hidden or tag in ("script", "style", "template") or "visually-hidden" in classes
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])
            if sidebar:
                self.sidebar_hrefs.append(attrs["href"])
        if tag not in ("br", "img", "input", "meta", "link", "hr", "wbr", "source", "col"):
            self._stack.append((tag, sidebar, article, hidden))

    def handle_endtag(self, tag):
        for index in range(len(self._stack) - 1, -1, -1):
            if self._stack[index][0] == tag:
                del self._stack[index:]
                break

    def handle_data(self, data):
        if self._stack and self._stack[-1][2] and not self._stack[-1][3]:
            self._text.append(data)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

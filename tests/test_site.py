"""The docs site: built with warnings as errors, then read in a real browser.

Debian's chromium and chromedriver (installed by .ci/run) run headless against
the site served on localhost. Every page loads with no console error, every
internal link resolves to a page and an anchor that exist, the search page
finds ``make_train_step``, and every public name has an entry in the generated
API reference. Screenshots of the index and of the API page are kept in
``out/test-artifacts/site/``.
"""

import functools
import html.parser
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import urllib.parse

import pytest

import jdp

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "out" / "test-artifacts" / "site"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q"]
    run = subprocess.run(
        [*cmd, str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-5000:]
    return out


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


@functools.cache
def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def _pages(site: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in site.rglob("*.html") if not {"_modules", "_static"} & set(p.parts))


def test_site_has_the_guides_notebooks_and_reference(site):
    names = {p.relative_to(site).as_posix() for p in _pages(site)}
    expected = {
        "index.html", "install.html", "concepts.html", "strategies.html", "fsdp.html",
        "exact.html", "changelog.html", "search.html", "api/index.html", "api/jdp.html",
        "api/strategies.html", "api/backends.html", "api/metrics.html",
        "notebooks/01_quickstart.html", "notebooks/04_digits.html",
    }  # fmt: skip
    assert expected <= names, expected - names


def test_every_internal_link_resolves(site):
    broken = []
    for path in _pages(site):
        for href in _parse(path).links:
            url = urllib.parse.urlsplit(href)
            if url.scheme or url.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = (path.parent / urllib.parse.unquote(url.path)).resolve() if url.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site)} -> {href}"
            if not target.is_file():
                broken.append(f"{where}: no such page")
            elif (
                url.fragment
                and target.suffix == ".html"
                and urllib.parse.unquote(url.fragment) not in _parse(target).ids
            ):
                broken.append(f"{where}: no such anchor")
    assert not broken, "\n".join(broken[:40])


def _public_names() -> list[str]:
    names = [f"jdp.{n}" for n in jdp.__all__ if not isinstance(getattr(jdp, n), type(jdp))]
    for sub in (jdp.strategies, jdp.backends, jdp.metrics, jdp.testing):
        names += [f"{sub.__name__}.{n}" for n in sub.__all__]
    return [n for n in names if n != "jdp.__version__"]


def test_every_public_name_is_in_the_api_reference(site):
    ids = set().union(*(_parse(p).ids for p in (site / "api").glob("*.html")))
    # A name re-exported by jdp from a namespace is documented once, there.
    namespaces = ("jdp.backends.", "jdp.strategies.")
    missing = [
        n
        for n in _public_names()
        if n not in ids and not any(ns + n.removeprefix("jdp.") in ids for ns in namespaces)
    ]
    assert not missing, missing


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(site):
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing: .ci/run installs them")
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install ...)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1280,900",
    ):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


def test_every_page_loads_without_a_console_error(site, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    driver, base = browser
    errors = []
    for path in _pages(site):
        driver.get(base + path.relative_to(site).as_posix())
        # get() can return while the page still loads on a loaded machine (seen in CI).
        WebDriverWait(driver, 60).until(
            lambda d: d.execute_script("return document.readyState") == "complete"
        )
        errors += [
            f"{path.relative_to(site)}: {entry['message']}"
            for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE"
        ]
    assert not errors, "\n".join(errors)


def test_search_finds_make_train_step_and_screenshots(site, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver, base = browser
    driver.get(base + "search.html?q=make_train_step")
    wait = WebDriverWait(driver, 30)
    wait.until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "#search-results li"))
    )
    hrefs = [
        a.get_attribute("href")
        for a in driver.find_elements(By.CSS_SELECTOR, "#search-results li a")
    ]
    assert any(h.endswith("api/jdp.html#jdp.make_train_step") for h in hrefs), hrefs
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for page, name in (("index.html", "index.png"), ("api/jdp.html", "api-jdp.png")):
        driver.get(base + page)
        assert driver.save_screenshot(str(ARTIFACTS / name))
        assert (ARTIFACTS / name).stat().st_size > 10_000

"""The manual as a reader gets it (issue 43, finding 14): the site built with ``mkdocs build --strict``, served over
HTTP on loopback (Material's search runs in a web worker that fetches its index, which a file:// page may not),
and opened in headless Chromium: every page of the navigation renders its heading, each command's page its
generated reference, and a word typed into the search box finds pages.

Needs Debian's ``chromium`` and ``chromium-driver`` (CI installs them); Selenium drives that chromedriver by
path, so Selenium Manager downloads nothing. The theme loads no web fonts, so the test runs with no network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import cli_reference

pytestmark = pytest.mark.system

ROOT = Path(__file__).parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 60  # a bound for a hang only: each wait ends when the element appears


def nav_pages(entries: list[Any]) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


PAGES = nav_pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)["nav"])


def title_of(page: str) -> str:
    """The page's first heading as the browser shows it (code spans without their backticks)."""
    source = ROOT / "docs" / page
    text = source.read_text()
    included = re.match(r'--8<-- "([^"]+)"', text)
    if included:
        text = (ROOT / included.group(1)).read_text()
    return re.search(r"^# (.+)$", text, flags=re.MULTILINE).group(1).replace("`", "")  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built from this checkout and served on loopback; its base URL."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    built = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    serve = [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(out), "0"]
    server = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        port = re.search(r"port (\d+)", server.stdout.readline())  # "Serving HTTP on 127.0.0.1 port N ..."
        assert port, "http.server did not say where it serves"
        yield f"http://127.0.0.1:{port.group(1)}/"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Chromium is not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def url_of(site: str, page: str) -> str:
    return site + ("" if page == "index.md" else page.removesuffix(".md") + "/")


def wait_for(driver: Any, css: str) -> list[Any]:
    """The elements ``css`` selects, once at least one is on the page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, css) or False)


def test_every_page_renders_its_heading(site: str, browser: Any) -> None:
    for page in PAGES:
        browser.get(url_of(site, page))
        heading = wait_for(browser, "article h1")[0].text.replace("¶", "").strip()
        assert heading == title_of(page), page
        assert browser.title.endswith("redline"), page


def test_each_command_page_has_its_generated_reference(site: str, browser: Any) -> None:
    pages: dict[str, list[str]] = {}
    for page in PAGES:
        for wanted in cli_reference.MARKER.findall((ROOT / "docs" / page).read_text()):
            if wanted != "index":
                pages.setdefault(page, []).append(wanted)
    assert pages
    for page, commands in pages.items():
        browser.get(url_of(site, page))
        ids = {element.get_attribute("id") for element in wait_for(browser, "article h3[id]")}
        for command in commands:
            assert "redline-" + command.replace(" ", "-") in ids, f"{page} lacks the reference of {command}"


def test_search_finds_pages(site: str, browser: Any) -> None:
    browser.get(site)
    box = wait_for(browser, "input.md-search__input")[0]  # in the header of a window 1400 wide
    box.click()
    box.send_keys("checkpoint")
    results = wait_for(browser, ".md-search-result__item")
    links = {item.find_element("css selector", "a").get_attribute("href") for item in results}
    assert any("/train/" in link for link in links), links

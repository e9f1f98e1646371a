"""Issue #33: the built docs site opened in headless Chromium (Debian's ``chromium`` driven by Playwright's pip
package, which downloads no browser of its own): every page loads without console errors, the search finds a
config key, and the home page is screenshotted (into the test's folder; docs/screenshots/home.png is the committed
copy of one such screenshot, 1280x900).

Needs the ``chromium`` executable (``apt-get install chromium``); without it the test skips saying so.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGES = ("", "migration/", "errors/", "reference/config/", "reference/cli/", "api/")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="the browser check needs Debian's chromium "
                                                          "(apt-get install chromium)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", OMP_NUM_THREADS="1")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                            "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert built.returncode == 0, built.stderr[-3000:]
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.mark.timeout(400)
def test_pages_load_search_finds_a_key_and_home_is_screenshotted(site: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda msg: errors.append(f"{page.url}: {msg.text}") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))
        for path in PAGES:
            response = page.goto(site + path, wait_until="networkidle")
            assert response is not None and response.status == 200, path
        assert errors == []
        page.goto(site, wait_until="networkidle")
        shot = tmp_path / "home.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        search = page.locator("input.md-search__input")
        search.click()
        page.keyboard.type("max_seconds", delay=20)  # a key inside autotuning.max_seconds
        result = page.locator(".md-search-result__item").first
        result.wait_for(timeout=60000)
        assert "reference/config" in (result.locator("a").first.get_attribute("href") or "")
        assert errors == []
        browser.close()

"""``make docs-check``: the built docs site as a reader sees it, in Debian's headless Chromium.

Serves ``site/`` on a loopback port and drives Chromium through the DevTools protocol over a pipe (standard
library only). For the front page, one guide and one reference page it saves a screenshot (``OUT/<name>.png``,
to look at) and checks, in the rendered page, the top tabs, the navigation with links to the other pages and
the search box. The search index must list every built page, and a search typed into the search box must show
results (its screenshot: ``OUT/search.png``). Exit status 1 with the failed checks listed.

Usage: ``python tools/docs_check.py SITE_DIR OUT_DIR`` (``chromium`` on PATH: ``apt-get install chromium``).
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PAGES = {
    "front": "index.html",
    "guide": "guides/transformers.html",
    "reference": "reference/api.html",
}
SEARCH_FOR = "share"
#: Rendered-page checks: name -> a JavaScript expression that must be truthy.
CHECKS = {
    "top tabs": "document.querySelectorAll('.md-tabs__link').length >= 5",
    "navigation": "document.querySelectorAll('nav.md-nav a.md-nav__link[href]').length >= 5",
    "search box": "!!document.querySelector('input.md-search__input')",
    "content": "document.querySelector('article.md-content__inner h1') !== null",
}


class Browser:
    """One headless Chromium, spoken to with the DevTools protocol over ``--remote-debugging-pipe``."""

    def __init__(self, chromium: str, profile: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # the child's fd 3 reads our commands, fd 4 writes its answers
            high_r, high_w = os.dup(to_chrome_r), os.dup(from_chrome_w)  # neither is 3 or 4 any more
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)
            for fd in (3, 4):
                os.set_inheritable(fd, True)

        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"]
        self.proc = subprocess.Popen(
            [chromium, *args, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds,
            pass_fds=(3, 4),  # kept open after fds() ran (subprocess closes the others)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=1366,
            height=900,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self._next += 1
        command: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            command["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(command).encode() + b"\0")
        while True:
            message = self._read()
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate(expression):
                return True
            time.sleep(0.2)
        return False

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete' && !!document.querySelector('.md-header')")
        time.sleep(0.5)  # the theme's scripts lay out the navigation after load

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("docs-check: no chromium on PATH (Debian: apt-get install chromium)")


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def _search_index(site: Path) -> list[str]:
    index = json.loads((site / "search" / "search_index.json").read_text())
    indexed = {doc["location"].split("#")[0] for doc in index.get("docs", [])}
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
    print(f"search index: {len(index.get('docs', []))} entries over {len(indexed)} pages; {len(pages)} pages built")
    unindexed = [p for p in pages if p not in indexed and p.removesuffix("index.html") not in indexed]
    return [f"search index: pages missing from it: {unindexed}"] if unindexed else []


def main(site_dir: str, out_dir: str) -> int:
    site, out = Path(site_dir), Path(out_dir)
    if not (site / "index.html").is_file():
        sys.exit(f"docs-check: {site}/index.html is missing: run make docs first")
    out.mkdir(parents=True, exist_ok=True)
    failures = _search_index(site)
    server, base = _serve(site)
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(_chromium(), profile)
        try:
            for name, page in PAGES.items():
                browser.open(base + page)
                browser.screenshot(out / f"{name}.png")
                failed = [what for what, check in CHECKS.items() if not browser.evaluate(check)]
                failures += [f"{name} ({page}): no {what} in the rendered page" for what in failed]
                title = browser.evaluate("document.title")
                links = browser.evaluate("document.querySelectorAll('nav.md-nav a.md-nav__link[href]').length")
                print(f"{name}: {page} '{title}', {links} navigation links -> {out / f'{name}.png'}")
            browser.open(base + "index.html")
            browser.evaluate("document.querySelector('label.md-header__button[for=__search]')?.click()")
            browser.evaluate("document.querySelector('input.md-search__input').focus()")
            for char in SEARCH_FOR:  # typed as a reader types: key down, the character, key up
                browser.call("Input.dispatchKeyEvent", session=True, type="keyDown", key=char, text=char)
                browser.call("Input.dispatchKeyEvent", session=True, type="keyUp", key=char)
            found = browser.wait_for("document.querySelectorAll('.md-search-result__item').length > 0", timeout=60)
            browser.screenshot(out / "search.png")
            count = browser.evaluate("document.querySelectorAll('.md-search-result__item').length")
            meta = browser.evaluate("document.querySelector('.md-search-result__meta')?.textContent")
            print(f"search for {SEARCH_FOR!r}: {count} results shown ({meta}) -> {out / 'search.png'}")
            if not found:
                failures.append(f"search: typing {SEARCH_FOR!r} shows no results ({meta})")
        finally:
            browser.close()
            server.shutdown()
    for failure in failures:
        print(f"docs-check: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))

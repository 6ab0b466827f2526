"""Screenshots of the built docs site with headless Chromium, to look at pages as a reader does.

Usage: ``python benches/docs_screenshots.py [--out DIR] [--size 1280,900] [PAGE ...]``. It
builds the site (``mkdocs build --strict``) into a temporary folder, serves it
on 127.0.0.1 and writes one PNG per page (default: the index, the ring
allreduce and the API reference). Chromium is not a dependency of gradcoll:
install it from the system's packages (Debian: ``apt-get install chromium``).
The test suite never needs it.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("", "algorithms/ring/", "api/")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build(site: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    subprocess.run([mkdocs, "build", "--strict", "-q", "-d", str(site)], cwd=ROOT, check=True, timeout=300,
                   env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def shoot(browser: str, url: str, png: Path, size: str) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                        f"--screenshot={png}", url], check=True, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pages", nargs="*", default=list(PAGES), help="paths under the site root ('' is the index)")
    ap.add_argument("--out", default="build/screenshots")
    ap.add_argument("--size", default="1280,900", help="window width,height in px")
    a = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("chromium not found: install it from the system's packages (apt-get install chromium)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        handler = functools.partial(QuietHandler, directory=str(site))
        with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            port = server.server_address[1]
            for page in a.pages:
                png = out / ((page.strip("/").replace("/", "_") or "index") + ".png")
                shoot(browser, f"http://127.0.0.1:{port}/{page}", png, a.size)
                print(png)
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

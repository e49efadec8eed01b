"""Screenshot of a review page with the system's Chromium (Playwright, executable_path: no browser download).

    python -m scripts.screenshot demo/review.html docs/review.png [--width 1240 --height 1000]

docs/review.png in the README is this, taken from a demo run (`python -m scripts.demo --out demo`). The
first predicted segment on the page is clicked first, so its player and playhead show a seek.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def screenshot(page: Path, out: Path, *, width: int = 1240, height: int = 1000, chromium: str | None = None) -> Path:
    from playwright.sync_api import sync_playwright

    exe = chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"], timeout=60_000)
        try:
            tab = browser.new_page(viewport={"width": width, "height": height})
            tab.goto(page.resolve().as_uri(), timeout=30_000)
            tab.wait_for_function("[...document.querySelectorAll('video')].every(v => v.readyState >= 4)", timeout=30_000)
            segs = tab.locator(".seg.pred")  # the first predicted segment on the page: the player shows the seek
            if segs.count():
                segs.first.click()
            tab.wait_for_timeout(2000)
            out.parent.mkdir(parents=True, exist_ok=True)
            tab.screenshot(path=str(out))
        finally:
            browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--width", type=int, default=1240)
    ap.add_argument("--height", type=int, default=1000)
    args = ap.parse_args()
    print(screenshot(args.page, args.out, width=args.width, height=args.height))


if __name__ == "__main__":
    main()

"""The review page (train.evaluate --html): static content, then a real headless Chromium (Debian's
package, driven by Playwright with executable_path): no console errors, the filmstrip images decode, the
source video loads from its relative path, clicking a segment seeks it, "keep only" plays the keep list."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from schemas.manifest import SampleRecord, read_records
from schemas.predictions import write_predictions
from train import evaluate as ev
from train.predict import make_row

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(built_shards, synth_videos_dir, tmp_path_factory):
    """review.html for made-up predictions on the fixture build: each gold answer shifted by 0.5 s, one
    window answered with garbage; the videos are played from synth_videos_dir by relative path."""
    records = read_records(built_shards / "manifest.parquet", SampleRecord)
    rows = []
    for i, rec in enumerate(records):
        window = rec.window_end_s - rec.window_start_s
        pairs = [[round(min(s.start_s + 0.5, window - 0.1), 1), round(min(s.end_s + 0.5, window), 1)] for s in rec.segments]
        text = "<argmax>11</argmax>" if i == 1 else json.dumps(pairs)
        rows.append(make_row(rec, text, True, 5))
    out = tmp_path_factory.mktemp("review")
    preds = out / "preds.jsonl"
    write_predictions(preds, rows)
    html_path = out / "site" / "review.html"
    html_path.parent.mkdir()
    assert ev.main([str(preds), "--shards", str(built_shards), "--html", str(html_path),
                    "--videos", str(synth_videos_dir)]) == 0
    return html_path, ev.evaluate(rows, records)


def test_page_is_self_contained_with_filmstrips_tracks_and_raw_outputs(page, synth_videos_dir):
    html_path, report = page
    text = html_path.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched from elsewhere
    assert text.count('<section class="video"') == report["counts"]["videos"] == 4
    assert text.count('<img class="thumb"') == 4 * 16 and text.count('src="data:image/jpeg;base64,') == 4 * 16
    srcs = re.findall(r'<video src="([^"]+)"', text)
    assert len(srcs) == 4 and all(not s.startswith("/") for s in srcs)
    assert all((html_path.parent / s).resolve().is_file() for s in srcs)  # relative to the page
    assert "raw output: &lt;argmax&gt;11&lt;/argmax&gt;" in text  # the model's own words, on hover
    gold = sum(len(v["gold_keep"]) for v in report["per_video"])
    pred = sum(len(v["pred_keep"]) for v in report["per_video"])
    assert text.count('class="seg gold"') == gold and text.count('class="seg pred"') == pred > 0


def test_page_without_videos_or_frames_still_renders(built_shards, tmp_path):
    """No --videos: no players, a note; a manifest whose tars are gone: no thumbnails, a note per window."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(built_shards / "manifest.parquet", shards)
    records = read_records(shards / "manifest.parquet", SampleRecord)
    rows = [make_row(r, json.dumps([[s.start_s, s.end_s] for s in r.segments]), True, 3) for r in records]
    text = ev.render_html(ev.evaluate(rows, records), shards=shards, page=tmp_path / "r.html")
    assert "<video" not in text and "pass --videos DIR" in text
    assert '<img class="thumb"' not in text and "frames not shown" in text


def _browser():
    if CHROMIUM is None or not _has_playwright():
        if os.environ.get("CI"):
            pytest.fail("CI must have Debian's chromium (.ci/run installs it) and playwright (the test extra)")
        pytest.skip("needs chromium (apt-get install chromium) and playwright (pip install -e '.[test]')")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def test_review_page_in_headless_chromium(page):
    html_path, report = page
    with _browser() as p:
        # a browser of the system's packages (none can be downloaded here); file:// only, no network
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=60_000)
        try:
            tab = browser.new_page()
            errors = []
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(html_path.as_uri(), timeout=30_000)
            tab.wait_for_function("[...document.querySelectorAll('video')].every(v => v.readyState >= 1)",
                                  timeout=30_000)  # every source video loads from its relative path
            assert tab.locator("img.thumb").count() == 64
            tab.wait_for_function("[...document.querySelectorAll('img.thumb')].every(e => e.complete)", timeout=30_000)
            sizes = tab.eval_on_selector_all("img.thumb", "els => els.map(e => e.naturalWidth)")
            assert all(w > 0 for w in sizes), sizes  # every filmstrip image decoded

            # vid_a: predicted keep starts at 1.5 s; clicking its second segment seeks there
            card = tab.locator("section.video").filter(has_text="vid_a")
            segs = card.locator(".seg.pred")
            second = float(segs.nth(1).get_attribute("data-start"))
            segs.nth(1).click()
            tab.wait_for_function(f"Math.abs(document.querySelector('#{card.get_attribute('id')} video').currentTime"
                                  f" - {second}) < 0.05", timeout=10_000)
            now = f"#{card.get_attribute('id')} .now"  # the time readout follows (timeupdate fires after the seek)
            tab.wait_for_function(f"document.querySelector('{now}').textContent.startsWith('{second:.1f}')", timeout=10_000)

            # "play keep only" starts at the first keep segment and plays
            keep = json.loads(card.get_attribute("data-keep"))
            card.locator("button.keep-only").click()
            sel = f"#{card.get_attribute('id')} video"
            tab.wait_for_function(f"(v => !v.paused && v.currentTime >= {keep[0][0] - 0.05})(document.querySelector('{sel}'))",
                                  timeout=10_000)
            assert card.locator("button.keep-only").inner_text() == "stop keep only"
            hover = card.locator(".win").first.get_attribute("title")
            assert "raw output:" in hover
            assert errors == []
        finally:
            browser.close()

"""The docs' pictures of the web page: `quill serve` on a run, driven in headless Chromium.

    python scripts/serve_screenshots.py --ckpt out/quickstart     # → docs/serve.png, docs/serve_attention.png

Starts the real command on 127.0.0.1 (a free port), writes from "ROMEO:" with a fixed seed in the
Write tab (docs/serve.png), then shows the attention of the prompt and its continuation
(docs/serve_attention.png), and stops the server. Needs the `serve` extra, selenium and Debian's
chromium + chromium-driver (what tests/serve/test_serve_browser.py uses). --smoke serves a tiny
random run and takes the pictures into a temporary folder (without a browser, it says so and stops).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from harness import ROOT, add_common, serve, skipped, tiny_run


def browser():
    """Headless Chromium through selenium and chromium-driver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="out/quickstart")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs")
    ap.add_argument("--max-tokens", type=int, default=50)  # + "ROMEO:" fits the quickstart's 64
    add_common(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.ckpt, args.out_dir, args.max_tokens = str(tiny_run(Path(tmp) / "tiny")), Path(tmp), 8
        proc, url, _ = serve(ROOT / args.ckpt)  # a relative --ckpt: from the checkout's root
        try:
            if args.smoke and not (shutil.which("chromedriver") and (shutil.which("chromium") or shutil.which("chromium-browser"))):
                skipped("the screenshots", "no chromium + chromium-driver here; the server started")
            else:
                screenshots(url, args)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def screenshots(url: str, args: argparse.Namespace) -> None:
    """The Write tab after a seeded generation, then the Attention tab over prompt and continuation."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser()
    try:
        wait, find = WebDriverWait(driver, 60), lambda id_: driver.find_element(By.ID, id_)
        driver.get(f"{url}/")
        wait.until(lambda d: "layers" in find("model-info").text)
        find("prompt").clear()
        find("prompt").send_keys("ROMEO:")
        find("seed").send_keys("1")
        driver.execute_script(
            f"const m = document.getElementById('max-tokens'); m.value = {args.max_tokens};m.dispatchEvent(new Event('input'));"
        )
        find("generate").click()
        wait.until(lambda d: "finished" in find("stats").text)
        driver.save_screenshot(str(args.out_dir / "serve.png"))
        find("tab-attention").click()
        wait.until(lambda d: "tokens" in find("attn-status").text)
        find("attn-run-all").click()
        wait.until(lambda d: "continuation" in find("attn-status").text)
        driver.save_screenshot(str(args.out_dir / "serve_attention.png"))
        print(f"saved {args.out_dir / 'serve.png'} and {args.out_dir / 'serve_attention.png'}")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()

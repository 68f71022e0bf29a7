"""The web page in a real headless Chromium (Debian's chromium + chromium-driver, via selenium):
type a prompt, Generate, wait for the streamed text (the same text the API gives), stop a long
generation, open the Attention tab, check the heatmaps are drawn (pixels read back through JS)
and that hovering names a token pair, and save a screenshot. `.ci/run` installs Chromium."""

from __future__ import annotations

import shutil

import httpx
import pytest
from serve_support import running_server, tiny_run_dir

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
)
WAIT_S = 30

# Count the drawn pixels of a canvas: not white background, and how many distinct colours.
PIXELS_JS = """
const c = document.getElementById(arguments[0]);
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let drawn = 0; const colours = new Set();
for (let i = 0; i < d.length; i += 4) {
  if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) drawn++;
  colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
}
return [c.width * c.height, drawn, colours.size];
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shakespeare_path):
    return tiny_run_dir(tmp_path_factory.mktemp("browser") / "tiny", shakespeare_path)


@pytest.fixture(scope="module")
def server(run_dir):
    with running_server(run_dir, max_batch=4) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def test_write_stream_stop_attention_and_screenshot(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    find = lambda id_: browser.find_element(By.ID, id_)  # noqa: E731
    browser.get(server + "/")
    wait.until(lambda d: "tiny" in find("model-info").text)

    # write: the streamed text is the API's text for the same settings
    find("prompt").clear()
    find("prompt").send_keys("ROMEO:")
    find("seed").send_keys("3")
    browser.execute_script("const m = document.getElementById('max-tokens'); m.value = 60;m.dispatchEvent(new Event('input'));")
    find("generate").click()
    wait.until(lambda d: "finished: length" in find("stats").text)
    shown = browser.execute_script("return document.getElementById('out-gen').textContent")
    body = {"prompt": "ROMEO:", "max_tokens": 60, "temperature": 0.8, "top_p": 0.95, "seed": 3}
    want = httpx.post(server + "/v1/completions", json=body, timeout=WAIT_S).json()["choices"][0]["text"]
    assert shown == want and len(shown) == 60
    assert "60 tokens" in find("stats").text and "tokens/s" in find("stats").text
    assert find("out-prompt").text == "ROMEO:"

    # stop: a long generation ends at once and frees its row on the server
    browser.execute_script("const m = document.getElementById('max-tokens'); m.value = 1000;m.dispatchEvent(new Event('input'));")
    find("seed").clear()
    find("generate").click()
    wait.until(lambda d: len(find("out-gen").text) > 5)
    find("stop").click()
    wait.until(lambda d: "stopped" in find("stats").text)
    wait.until(lambda d: httpx.get(server + "/health").json()["active"] == 0)
    assert find("generate").is_enabled() and not find("stop").is_enabled()

    # attention: a layer × head grid of heatmaps, drawn, with a hover that names the pair
    find("prompt").clear()
    find("prompt").send_keys("To be, or not")
    find("tab-attention").click()
    wait.until(lambda d: "13 tokens, 2 layers × 2 heads" in find("attn-status").text)
    area, drawn, colours = browser.execute_script(PIXELS_JS, "attn-grid")
    assert drawn > area // 3 and colours > 20, (area, drawn, colours)
    area, drawn, colours = browser.execute_script(PIXELS_JS, "attn-focus")
    assert drawn > area // 3 and colours > 20, (area, drawn, colours)
    grid = find("attn-grid")
    ActionChains(browser).move_to_element_with_offset(grid, -grid.size["width"] // 2 + 30, -grid.size["height"] // 2 + 30).perform()
    wait.until(lambda d: find("tip").is_displayed())
    assert "layer 0 head 0" in find("tip").text and "→" in find("tip").text and "weight" in find("tip").text

    area, drawn, colours = browser.execute_script(PIXELS_JS, "attn-scale")  # the colour scale beside them
    assert drawn > area // 4 and colours > 20, (area, drawn, colours)

    # attention over the generated text: the prompt the text came from and its continuation, cropped
    assert find("attn-run-all").is_enabled()
    find("attn-run-all").click()
    wait.until(lambda d: "of the prompt and its continuation" in find("attn-status").text)
    n = len(
        browser.execute_script("return document.getElementById('out-prompt').textContent + document.getElementById('out-gen').textContent")
    )  # char tokenizer: a token a char
    assert f"{min(n, 16)} tokens" in find("attn-status").text
    assert (f"the first {n - 16} tokens were cropped" in find("attn-status").text) == (n > 16)
    pressed = [find(b).get_attribute("aria-pressed") for b in ("attn-run", "attn-run-all")]
    highlighted = ["primary" in find(b).get_attribute("class") for b in ("attn-run", "attn-run-all")]
    assert pressed == ["false", "true"] and highlighted == [False, True]  # the continuation's button is the selected one

    shot = tmp_path / "serve.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not logs, logs  # no script errors, no failed loads


def test_the_page_asks_for_the_api_key(run_dir, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    find = lambda id_: browser.find_element(By.ID, id_)  # noqa: E731
    with running_server(run_dir, max_batch=1, api_key="sk-browser-key") as (url, _):
        browser.get(url + "/")
        wait.until(lambda d: find("key-form").is_displayed())
        assert "needs an API key" in find("model-info").text
        find("key").send_keys("sk-browser-key")
        find("key-form").submit()
        wait.until(lambda d: "tiny" in find("model-info").text)
        assert not find("key-form").is_displayed()
        find("generate").click()
        wait.until(lambda d: "finished: length" in find("stats").text)
        assert len(find("out-gen").text) > 0

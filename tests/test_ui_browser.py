"""The built-in page in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which
``make test`` installs where they are missing) driven by selenium against a real server on 127.0.0.1.

* Compare: two backends on one prompt, the texts a person sees equal to what ``/generate`` answers, the first
  diverging token marked where the outputs differ (``full`` against ``gqa`` with mean pooling, which needs no
  calibration and diverges) and nothing marked where they are the same (``full`` against ``int8`` on a short
  generation: under 64 cached tokens int8 holds every token in full precision), the KV bytes the request held;
  the shareable URL reproduces a comparison; a server error shows as a message.
* Live: the counters move while a request runs, and settle when it ends.
* Phone width and keyboard alone; with ``API_KEY`` the page asks for the key once.

``KVSERVE_UI_SCREENSHOTS=<folder>`` saves a screenshot of each view there (the README's come from
``KVSERVE_UI_SCREENSHOTS=docs/img``).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest

from tests.conftest import server_with

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PROMPT = "And God said"
SHOTS = os.environ.get("KVSERVE_UI_SCREENSHOTS")

# gqa by mean pooling: no calibration, and its greedy text leaves full's within a few tokens
server = server_with({"KV_BACKEND": "full", "KV_BACKENDS": "full,int8,gqa", "KV_GQA_METHOD": "mean",
                      "KV_CACHE_BUDGET_BYTES": str(64 * 2**20)})
keyed = server_with({"KV_BACKEND": "full", "API_KEY": "s3cret"})


def _browser_paths() -> tuple[str, str]:
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    if not (chromium and driver):
        pytest.skip("no chromium/chromedriver: `make test` installs Debian's chromium and chromium-driver "
                    "(apt-get, as root); they could not be installed here")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = _browser_paths()
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait(driver, condition, timeout=180):
    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d))


def shot(driver, name: str, height: int | None = None) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        if height:
            driver.set_window_size(driver.get_window_size()["width"], height)
        driver.save_screenshot(str(Path(SHOTS) / name))


def tgi_text(server, backend: str, max_new_tokens: int, details: bool = False):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "repetition_penalty": 1.3,
                                             "kv_backend": backend, "details": details}}
    return httpx.post(server.url + "/generate", json=body, timeout=120).json()


def cards(driver) -> dict:
    return {c.get_attribute("data-backend"): c for c in driver.find_elements(By.CSS_SELECTOR, "#results .result")}


def run_from_form(driver, server, backends: list[str], max_new_tokens: int) -> dict:
    driver.get(server.url + "/")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#backends input[value="full"]'))
    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    for box in driver.find_elements(By.CSS_SELECTOR, '#backends input[type="checkbox"]'):
        if box.is_selected() != (box.get_attribute("value") in backends):
            box.click()
    tokens = driver.find_element(By.ID, "max-new-tokens")
    tokens.clear()
    tokens.send_keys(str(max_new_tokens))
    driver.find_element(By.ID, "run").click()
    wait(driver, lambda d: len(cards(d)) == len(backends) and d.find_element(By.ID, "run").is_enabled())
    return cards(driver)


def test_compare_full_and_int8_shows_both_texts_no_divergence_and_kv_bytes(browser, server):
    found = run_from_form(browser, server, ["full", "int8"], 24)
    for backend in ("full", "int8"):
        shown = found[backend].find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")
        assert shown == PROMPT + tgi_text(server, backend, 24)["generated_text"]
    # 3 prompt tokens + 24 new < 64 cached tokens: int8 keeps them all in full precision, the same text
    assert found["int8"].find_elements(By.CSS_SELECTOR, "mark.diverge") == []
    assert found["int8"].get_attribute("data-diverge") == "-1"
    assert "identical to full" in found["int8"].find_element(By.CSS_SELECTOR, ".verdict").text
    prompt_tokens = 3
    full_peak = 16384 * (prompt_tokens + 24 - 1)  # fp32, 8 layers, MHA: 16384 bytes per token
    for backend in ("full", "int8"):  # int8 holds what full holds below 64 tokens
        peak = found[backend].find_element(By.CSS_SELECTOR, ".kv-peak")
        assert int(peak.get_attribute("data-bytes")) == full_peak and peak.text == "416.00 KiB"
        assert found[backend].find_element(By.CSS_SELECTOR, ".kv-per-token").text == "16,384"
        assert found[backend].find_element(By.CSS_SELECTOR, ".ttft").text.endswith(" ms")
    assert found["int8"].find_elements(By.CSS_SELECTOR, "figure svg rect")  # the logprob-difference plot
    assert "backends=full%2Cint8" in browser.current_url or "backends=full,int8" in browser.current_url


def test_shared_url_marks_the_first_diverging_token(browser, server):
    full = tgi_text(server, "full", 40, details=True)["details"]["tokens"]
    gqa = tgi_text(server, "gqa", 40, details=True)["details"]["tokens"]
    first = next(i for i, (a, b) in enumerate(zip(full, gqa)) if a["id"] != b["id"])
    query = urlencode({"prompt": PROMPT, "backends": "full,int8,gqa", "max_new_tokens": 40,
                       "repetition_penalty": 1.3})
    browser.get(f"{server.url}/?{query}")  # the shareable URL runs the comparison by itself
    wait(browser, lambda d: len(cards(d)) == 3 and d.find_element(By.ID, "run").is_enabled())
    mark = cards(browser)["gqa"].find_element(By.CSS_SELECTOR, "mark.diverge")
    assert int(mark.get_attribute("data-index")) == first
    assert mark.get_attribute("textContent") == (gqa[first]["text"] or f"⟨{gqa[first]['id']}⟩")
    assert f"at token {first}" in cards(browser)["gqa"].find_element(By.CSS_SELECTOR, ".verdict").text
    assert cards(browser)["full"].find_elements(By.CSS_SELECTOR, "mark.diverge") == []
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == PROMPT
    shot(browser, "ui-compare.png", 1150)


def test_a_server_error_shows_as_a_message(browser, server):
    run_from_form(browser, server, ["full"], 1)
    tokens = browser.find_element(By.ID, "max-new-tokens")
    tokens.clear()
    tokens.send_keys("100000")
    browser.find_element(By.ID, "run").click()
    error = wait(browser, lambda d: d.find_element(By.ID, "error").is_displayed() and d.find_element(By.ID, "error"))
    assert "422" in error.text and "must be <= 1024" in error.text


def test_live_counters_move_under_a_request(browser, server):
    browser.get(server.url + "/?view=live")
    row = '#live-table tr[data-backend="full"] '
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row + ".running"))
    requests_before = int(browser.find_element(By.CSS_SELECTOR, row + ".requests").text.replace(",", ""))
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 600, "repetition_penalty": 1.3}}
    request = threading.Thread(target=httpx.post, args=(server.url + "/generate",), kwargs={"json": body, "timeout": 300})
    request.start()
    other = {"inputs": PROMPT, "parameters": {"max_new_tokens": 300, "kv_backend": "int8"}}  # a second row moving
    threading.Thread(target=httpx.post, args=(server.url + "/generate",), kwargs={"json": other, "timeout": 300}).start()
    seen = {"running": False, "kv": False, "rate": False}
    deadline, all_seen_at, shot_taken = time.time() + 240, None, not SHOTS
    while request.is_alive() and time.time() < deadline and not (all(seen.values()) and shot_taken):
        try:
            seen["running"] |= browser.find_element(By.CSS_SELECTOR, row + ".running").text == "1"
            seen["kv"] |= int(browser.find_element(By.CSS_SELECTOR, row + ".kv-used").get_attribute("data-bytes")) > 0
            seen["rate"] |= float(browser.find_element(By.CSS_SELECTOR, row + ".rate").text) > 0
        except Exception:  # noqa: BLE001 - the row is redrawn every second; read it again
            pass
        if all(seen.values()) and all_seen_at is None:
            all_seen_at = time.time()
        if not shot_taken and all_seen_at and time.time() - all_seen_at > 3:  # a few seconds in, for the picture
            shot(browser, "ui-live.png", 600)
            shot_taken = True
        time.sleep(0.2)
    assert all(seen.values()), seen
    budget = browser.find_element(By.ID, "live-budget").text
    assert "64.00 MiB" in budget
    request.join()
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, row + ".running").text == "0"
         and int(d.find_element(By.CSS_SELECTOR, row + ".requests").text.replace(",", "")) == requests_before + 1, 30)
    assert browser.find_element(By.CSS_SELECTOR, row + ".kv-used").get_attribute("data-bytes") == "0"


def test_sums_view_lists_every_backend(browser, server):
    browser.get(server.url + "/?view=sums&seq_len=4096&batch=8")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr"))
    shown = {r.get_attribute("data-backend") for r in browser.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr")}
    assert shown >= {"full", "gqa", "mla", "int8", "dca", "mla+int8", "gqa+int8"}
    full = browser.find_element(By.CSS_SELECTOR, '#sums-table tr[data-backend="full"] .total')
    assert full.text == "512.00 MiB"  # 16384 bytes/token x 4096 tokens x 8 sequences
    shot(browser, "ui-sums.png", 700)


def test_phone_width_and_keyboard_alone(browser, server):
    browser.set_window_size(390, 844)
    try:
        browser.get(server.url + "/")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#backends input[value="full"]'))
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        # keyboard alone: Tab from the top of the page reaches the views, the prompt, the backends, the
        # settings and the button; Ctrl+Enter in the prompt runs the comparison
        from selenium.webdriver.common.action_chains import ActionChains

        seen = []
        for _ in range(20):
            ActionChains(browser).send_keys(Keys.TAB).perform()
            active = browser.switch_to.active_element
            seen.append(active.get_attribute("id") or active.get_attribute("value"))
        assert {"tab-compare", "prompt", "full", "int8", "max-new-tokens", "run"} <= set(seen), seen
        prompt = browser.find_element(By.ID, "prompt")
        prompt.click()
        prompt.send_keys(Keys.CONTROL, Keys.ENTER)
        wait(browser, lambda d: len(cards(d)) == 2 and d.find_element(By.ID, "run").is_enabled())
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        shot(browser, "ui-compare-phone.png", 1400)
        # the tabs follow the WAI-ARIA pattern: arrow keys move between views
        browser.find_element(By.ID, "tab-compare").send_keys(Keys.ARROW_RIGHT)
        wait(browser, lambda d: d.find_element(By.ID, "view-live").is_displayed(), 10)
        assert browser.switch_to.active_element.get_attribute("id") == "tab-live"
    finally:
        browser.set_window_size(1280, 1000)


def test_api_key_is_asked_once(browser, keyed):
    browser.get(keyed.url + "/")
    key = wait(browser, lambda d: d.find_element(By.ID, "key").is_displayed() and d.find_element(By.ID, "key"), 30)
    key.send_keys("s3cret", Keys.ENTER)
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#backends input[value="full"]'), 30)
    browser.find_element(By.ID, "tab-live").click()  # a second route: no second question
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#live-table tr[data-backend="full"]'), 30)
    assert not browser.find_element(By.ID, "key-form").is_displayed()

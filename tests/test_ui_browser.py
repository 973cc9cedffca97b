"""The built-in page in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which
``make test`` installs where they are missing) driven by selenium against a real server on 127.0.0.1.

* Compare: two backends on one prompt, the texts a person sees equal to what ``/generate`` answers, the first
  diverging token marked where the outputs differ (``full`` against ``gqa`` with mean pooling, which needs no
  calibration and diverges) and nothing marked where they are the same (``full`` against ``int8`` on a short
  generation: under 64 cached tokens int8 holds every token in full precision, and its card says so), the KV
  bytes the request held; the shareable URL reproduces a comparison; a server error shows as a message. With
  the default prompt every backend's summary row: ratios to full, agreement, the first difference, the reason
  elastic has not compressed; one plot scale; the prompt shown once; timings labelled warm, median of N.
* Live: the counters move while a request runs, and settle when it ends.
* Sums: every backend the server knows, a warning past the model's positions.
* While the model loads the page waits for ``/health`` and goes on by itself (a stub server that answers 503
  first).
* Nothing is cut off at 1280 px or at phone width (390 px); keyboard alone; with ``API_KEY`` the page asks for
  the key once.

``KVSERVE_UI_SCREENSHOTS=<folder>`` saves a screenshot of each view there (the README's come from
``KVSERVE_UI_SCREENSHOTS=docs/img``).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlencode

import httpx
import pytest

from tests.conftest import free_port, server_with

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PROMPT = "And God said"
SHOTS = os.environ.get("KVSERVE_UI_SCREENSHOTS")

# gqa by mean pooling at 2 groups: no calibration, and its greedy text leaves full's within a few tokens; set
# explicitly, it is kept and served with the quality budget's warning (its price is far over +1%)
server = server_with({"KV_BACKEND": "full", "KV_BACKENDS": "full,int8,int4,elastic,gqa", "KV_GQA_METHOD": "mean",
                      "KV_GQA_GROUPS": "2", "KV_CACHE_BUDGET_BYTES": str(64 * 2**20)})
keyed = server_with({"KV_BACKEND": "full", "API_KEY": "s3cret"})


STUB_INFO = {"model_id": "stub-model", "model_dtype": "float32", "model_device_type": "cpu", "kv_backend": "full",
             "kv_backends": ["full", "int8"]}
STUB_DEFAULTS = {"chat_template": True, "chat": True, "repetition_penalty": 1.0,
                 "presets": [{"label": "The capital of France", "prompt": "What is the capital of France?",
                              "tokens": 37}]}


def stub_page(stub: SimpleNamespace, routes):
    """The page's own routes on a stub app on 127.0.0.1 (``stub.url``), after the routes ``routes(app)`` adds
    (they answer first: /info, the page's defaults and any of its routes the stub fakes); yields ``stub``."""
    import uvicorn
    from fastapi import FastAPI

    from server.api.ui import router

    app = FastAPI()
    routes(app)
    app.include_router(router)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started and time.time() < deadline:
        time.sleep(0.05)
    stub.url = f"http://127.0.0.1:{port}"
    yield stub
    uv.should_exit = True
    thread.join(10)


@pytest.fixture
def loading_server():
    """A stub that answers /health and /info 503 ("model is loading") until ``ready`` is set, as kvserve does
    while it loads and calibrates; counts the /health polls."""
    from server.errors import error_response

    stub = SimpleNamespace(ready=threading.Event(), health_polls=0)

    def routes(app):
        @app.get("/health")
        async def health():
            stub.health_polls += 1
            return {"status": "ok"} if stub.ready.is_set() else error_response(503, "model is loading", "unhealthy")

        @app.get("/info")
        async def info():
            return STUB_INFO if stub.ready.is_set() else error_response(503, "model is loading", "unhealthy")

        @app.get("/ui/api/defaults")
        async def defaults():
            return STUB_DEFAULTS

    yield from stub_page(stub, routes)


def answering_stub(served_info: dict, more_routes=None):
    """A stub of a chat model serving ``served_info`` as /info, whose every backend answers end-of-text at once
    (SmolLM2 given a question as raw text): one token, no TPOT; keeps the bodies the page sent. ``more_routes(app)``
    adds routes of its own first."""
    stub = SimpleNamespace(bodies=[])

    def routes(app):
        if more_routes:
            more_routes(app)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/info")
        async def info():
            return served_info

        @app.get("/ui/api/defaults")
        async def defaults():
            return STUB_DEFAULTS

        @app.post("/ui/api/generate")
        async def generate(body: dict):
            stub.bodies.append(body)
            return {"kv_backend": body["kv_backend"], "text": "", "tokens": [{"id": 2, "text": "", "logprob": -0.4}],
                    "finish_reason": "eos_token", "prompt_text": body["prompt"], "prompt_tokens": 7,
                    "kv_peak_bytes": 322560, "kv_bytes_per_token": 46080.0, "kv_full_peak_bytes": 322560,
                    "kv_uncompressed_reason": None, "ttft_s": 0.1, "tpot_s": None}

    yield from stub_page(stub, routes)


@pytest.fixture
def stopping_server():
    """:func:`answering_stub` of the stub model."""
    yield from answering_stub(STUB_INFO)


BOUNDED_INT8 = {"backend": "int8", "spec": "int8:group_size=32,residual=32", "budget_pct": 1.0, "min_agreement": 0.9,
                "price": {"kl": 0.004, "ppl_increase_pct": 0.4, "ppl_change_pct": 0.3, "tokens": 768,
                          "agreement": 0.85},
                "within_budget": False, "saves_nothing": False, "searched": None, "explicit": False,
                "agreement_shortfall": 0.05,
                "message": "int8: int8:group_size=32,residual=32: under the quality budget's top-1 agreement of 0.9 "
                           "(short by 0.0500) (explicit setting): 3.14x smaller than full for +0.40% perplexity, "
                           "top-1 agreement 0.850"}
# int4 whose search found no setting reaching the agreement bound: the closest one is served, short of it
CLOSEST_INT4 = {"backend": "int4", "spec": "int4:rotate=true", "budget_pct": 1.0, "min_agreement": 0.95,
                "price": {"kl": 0.006, "ppl_increase_pct": 0.6, "ppl_change_pct": 0.5, "tokens": 768,
                          "agreement": 0.9125},
                "within_budget": False, "saves_nothing": False, "searched": "rotate", "explicit": False,
                "agreement_shortfall": 0.0375,
                "message": "int4: int4:rotate=true: under the quality budget's top-1 agreement of 0.95 (short by "
                           "0.0375) (no setting within it; the highest agreement of those tried: ...): 3.76x smaller "
                           "than full for +0.60% perplexity, top-1 agreement 0.912"}


@pytest.fixture
def bounded_server():
    """:func:`answering_stub` whose int8 is within the price (+1%) but under ``KV_QUALITY_MIN_AGREEMENT`` (0.9), as
    /info's ``kv_quality`` gives it."""
    yield from answering_stub({**STUB_INFO, "kv_quality_budget_pct": 1.0, "kv_quality_min_agreement": 0.9,
                               "kv_quality": {"int8": BOUNDED_INT8}})


@pytest.fixture
def closest_server():
    """:func:`answering_stub` serving full and :data:`CLOSEST_INT4`, with a sums route that prices its rows as
    kvserve's does (:func:`server.api.ui.served_price`)."""
    from server.api.ui import served_price

    info = {**STUB_INFO, "kv_backends": ["full", "int4"], "kv_quality_budget_pct": 1.0,
            "kv_quality_min_agreement": 0.95, "kv_quality": {"int4": CLOSEST_INT4}}

    def row(backend, per_layer, served_as):
        return {"backend": backend, "params": {}, "bytes_per_token_per_layer": per_layer, "aka": None,
                "bytes_per_token": per_layer * 2, "total_bytes": per_layer * 2 * 1024, "vs_full": 1024 / per_layer,
                "served_as": served_as, "price": served_price(served_as, info["kv_quality"])}

    def sums(app):
        @app.get("/ui/api/sums")
        async def ui_sums():
            return {"model": "stub-model", "dtype": "float32", "num_layers": 2, "seq_len": 1024, "batch": 1,
                    "max_position_embeddings": 2048, "warnings": [],
                    "rows": [row("full", 1024, ["full"]), row("int4", 272, ["int4"]), row("int8", 544, [])]}

    stubs = answering_stub(info, sums)
    yield next(stubs)
    next(stubs, None)


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
    """``condition`` polled until true; an element the page redrew between its lookup and its read (the live view
    redraws every second) is looked up again on the next poll, not a failure."""
    return WebDriverWait(driver, timeout, poll_frequency=0.2,
                         ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: condition(d))


def shot(driver, name: str, height: int | None = None) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        if height:
            driver.set_window_size(driver.get_window_size()["width"], height)
        driver.save_screenshot(str(Path(SHOTS) / name))


def tgi_text(server, backend: str, max_new_tokens: int, details: bool = False, prompt: str = PROMPT):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "repetition_penalty": 1.3,
                                             "kv_backend": backend, "details": details}}
    return httpx.post(server.url + "/generate", json=body, timeout=120).json()


def cards(driver) -> dict:
    return {c.get_attribute("data-backend"): c for c in driver.find_elements(By.CSS_SELECTOR, "#results .result")}


def cut_off(driver, selector: str) -> list[str]:
    """The visible elements matching ``selector`` whose right edge is past the page's width (so off screen), and
    the page itself when it scrolls sideways."""
    return driver.execute_script("""
        const width = document.documentElement.clientWidth, out = [];
        if (document.documentElement.scrollWidth > width) out.push("page: " + document.documentElement.scrollWidth);
        for (const e of document.querySelectorAll(arguments[0])) {
          const r = e.getBoundingClientRect();
          if (r.width && r.right > width + 0.5) out.push(e.className + " " + e.textContent + ": " + r.right);
        }
        for (const w of document.querySelectorAll(".table-wrap"))  // a table that scrolls hides columns
          if (w.offsetParent && w.scrollWidth > w.clientWidth) out.push(w.firstElementChild.id + " scrolls");
        return out;""", selector)


def fill(driver, element_id: str, value) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(str(value))


def run_from_form(driver, server, backends: list[str], max_new_tokens: int, prompt: str | None = PROMPT,
                  runs: int = 1) -> dict:
    """Run a comparison from the form (``prompt`` None: the page's default prompt)."""
    driver.get(server.url + "/")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#backends input[value="full"]'))
    if prompt is not None:
        fill(driver, "prompt", prompt)
    fill(driver, "runs", runs)
    for box in driver.find_elements(By.CSS_SELECTOR, '#backends input[type="checkbox"]'):
        if box.is_selected() != (box.get_attribute("value") in backends):
            box.click()
    fill(driver, "max-new-tokens", max_new_tokens)
    driver.find_element(By.ID, "run").click()
    wait(driver, lambda d: len(cards(d)) == len(backends) and d.find_element(By.ID, "run").is_enabled())
    return cards(driver)


def test_compare_full_and_int8_shows_both_texts_no_divergence_and_kv_bytes(browser, server):
    found = run_from_form(browser, server, ["full", "int8"], 24)
    for backend in ("full", "int8"):
        shown = found[backend].find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")
        assert shown == tgi_text(server, backend, 24)["generated_text"]  # the prompt is shown once, above
    assert browser.find_element(By.ID, "shown-prompt-text").text == PROMPT
    # 3 prompt tokens + 24 new < 64 cached tokens: int8 keeps them all in full precision, the same text
    assert found["int8"].find_elements(By.CSS_SELECTOR, "mark.diverge") == []
    assert found["int8"].get_attribute("data-diverge") == "-1"
    assert "identical to full" in found["int8"].find_element(By.CSS_SELECTOR, ".verdict").text
    assert found["int8"].find_element(By.CSS_SELECTOR, ".uncompressed").text == (
        "Not compressed yet: all 26 tokens within the 32 newest tokens kept exact and the group of 32 forming "
        "before them: int8 quantizes from 64 tokens on.")
    assert found["full"].find_elements(By.CSS_SELECTOR, ".uncompressed") == []
    prompt_tokens = 3
    full_peak = 16384 * (prompt_tokens + 24 - 1)  # fp32, 8 layers, MHA: 16384 bytes per token
    for backend in ("full", "int8"):  # int8 holds what full holds below 64 tokens
        peak = found[backend].find_element(By.CSS_SELECTOR, ".kv-peak")
        assert int(peak.get_attribute("data-bytes")) == full_peak and peak.text == "416.00 KiB"
        assert found[backend].find_element(By.CSS_SELECTOR, ".kv-per-token").text == "16,384"
        assert found[backend].find_element(By.CSS_SELECTOR, ".ttft .key").text.endswith(" ms")
        assert found[backend].find_element(By.CSS_SELECTOR, ".ttft .detail").text == "warm, 1 run"
    assert found["int8"].find_elements(By.CSS_SELECTOR, "figure svg rect")  # the logprob-difference plot
    assert "backends=full%2Cint8" in browser.current_url or "backends=full,int8" in browser.current_url


def test_a_backend_over_the_quality_budget_is_flagged_on_the_page(browser, server):
    """/info's kv_quality reaches the page: gqa (2 groups by mean pooling, set explicitly) is over the budget, so a
    warning with its price stands beside the backends and on its card; int8, within it, has none."""
    info = httpx.get(server.url + "/info", timeout=10).json()["kv_quality"]
    assert not info["gqa"]["within_budget"] and info["int8"]["within_budget"]
    browser.get(server.url + "/?" + urlencode({"prompt": PROMPT, "backends": "full,int8,gqa", "max_new_tokens": 4,
                                               "run": "1"}))
    warnings = WebDriverWait(browser, 120).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#backends .quality-warning"))
    assert [w.get_attribute("data-backend") for w in warnings] == ["gqa"]
    assert "over the quality budget" in warnings[0].text and info["gqa"]["message"] in warnings[0].text
    card = WebDriverWait(browser, 300).until(lambda b: cards(b).get("gqa"))
    WebDriverWait(browser, 300).until(lambda b: card.find_elements(By.CSS_SELECTOR, ".quality-warning"))
    assert not cards(browser)["int8"].find_elements(By.CSS_SELECTOR, ".quality-warning")


def test_a_backend_under_the_agreement_bound_is_flagged_with_its_agreement(browser, bounded_server):
    """Within the price but flipping 15% of full's top tokens, under KV_QUALITY_MIN_AGREEMENT: the summary flags the
    figure that misses, and its title gives both figures and the bound."""
    query = urlencode({"prompt": "What is the capital of France?", "backends": "full,int8", "runs": 1, "chat": 0})
    browser.get(f"{bounded_server.url}/?{query}")
    wait(browser, lambda d: len(cards(d)) == 2 and d.find_element(By.ID, "run").is_enabled(), 60)
    warnings = browser.find_elements(By.CSS_SELECTOR, "#backends .quality-warning")
    assert [w.get_attribute("data-backend") for w in warnings] == ["int8"]
    assert BOUNDED_INT8["message"] in warnings[0].text
    row = browser.find_element(By.CSS_SELECTOR, '#summary-table tr[data-backend="int8"]')
    flag = row.find_element(By.CSS_SELECTOR, "th .over-budget")
    assert flag.text == "⚠ over budget: top-1 agreement 0.850"
    assert flag.get_attribute("title") == ("+0.40% perplexity, top-1 agreement 0.850, under the quality budget's "
                                           "top-1 agreement of 0.9")
    short = row.find_element(By.CSS_SELECTOR, "th .agreement-shortfall")  # an explicit setting: no "closest"
    assert short.is_displayed() and short.text == "⚠ agreement short by 0.0500"
    assert short.get_attribute("title") == "top-1 agreement 0.850, 0.0500 under the quality budget's bound of 0.9"
    assert not browser.find_elements(By.CSS_SELECTOR, '#summary-table tr[data-backend="full"] .over-budget')
    assert not browser.find_elements(By.CSS_SELECTOR, '#summary-table tr[data-backend="full"] .agreement-shortfall')


def test_the_closest_setting_short_of_the_agreement_bound_is_flagged(browser, closest_server):
    """No setting the search tried reaches KV_QUALITY_MIN_AGREEMENT, so the closest is served: /info's
    agreement_shortfall shows as a flag beside the price, on the summary row and in the sums view."""
    query = urlencode({"prompt": "What is the capital of France?", "backends": "full,int4", "runs": 1, "chat": 0})
    browser.get(f"{closest_server.url}/?{query}")
    wait(browser, lambda d: len(cards(d)) == 2 and d.find_element(By.ID, "run").is_enabled(), 60)
    row = browser.find_element(By.CSS_SELECTOR, '#summary-table tr[data-backend="int4"]')
    assert row.find_element(By.CSS_SELECTOR, "th .over-budget").text == "⚠ over budget: top-1 agreement 0.912"
    short = row.find_element(By.CSS_SELECTOR, "th .agreement-shortfall")
    assert short.is_displayed() and short.text == "⚠ closest setting: agreement short by 0.0375"
    assert short.get_attribute("title") == ("no setting the search tried reaches the top-1 agreement of 0.95: the "
                                            "closest is served, 0.0375 under it")
    assert float(short.get_attribute("data-shortfall")) == 0.0375
    browser.get(f"{closest_server.url}/?view=sums")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr"))
    price = {r.get_attribute("data-backend"): r.find_element(By.CSS_SELECTOR, ".price")
             for r in browser.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr")}
    flag = price["int4"].find_element(By.CSS_SELECTOR, ".agreement-shortfall")
    assert flag.is_displayed() and flag.text == "⚠ closest setting: agreement short by 0.0375"
    assert "under the quality budget's top-1 agreement of 0.95" in price["int4"].text
    assert not price["full"].find_elements(By.CSS_SELECTOR, ".agreement-shortfall")
    assert not price["int8"].find_elements(By.CSS_SELECTOR, ".agreement-shortfall")


LOSING_WINDOW = {"backend": "window", "spec": "window:sinks=4,window=1024", "budget_pct": 1.0, "min_agreement": None,
                 "price": {"kl": 0.0, "ppl_increase_pct": 0.0, "ppl_change_pct": 0.0, "tokens": 768, "agreement": 1.0},
                 "within_budget": True, "saves_nothing": False, "searched": None, "explicit": False,
                 "agreement_shortfall": None,
                 "message": "window: window:sinks=4,window=1024: within the budget: 1.00x smaller than full",
                 "long_context_warning": "window: on a 8192-token input it finds 0% of the needles where full finds "
                                         "75% (missed at depth 0.1, 0.35, 0.6, 0.85); its price on the quality "
                                         "budget's short windows (+0.00%) does not show it"}


@pytest.fixture
def losing_server():
    """:func:`answering_stub` serving full and :data:`LOSING_WINDOW`: within the budget on its short price, losing
    retrieval on the long input."""
    yield from answering_stub({**STUB_INFO, "kv_backends": ["full", "window"], "kv_quality_budget_pct": 1.0,
                               "kv_quality": {"window": LOSING_WINDOW}})


def test_a_backend_losing_at_long_context_is_flagged(browser, losing_server):
    """/info's long_context_warning shows beside the backend's name in the summary (its words in the title) and
    under the backend choice, though the short price is within the budget (no over-budget flag)."""
    query = urlencode({"prompt": "What is the capital of France?", "backends": "full,window", "runs": 1, "chat": 0})
    browser.get(f"{losing_server.url}/?{query}")
    wait(browser, lambda d: len(cards(d)) == 2 and d.find_element(By.ID, "run").is_enabled(), 60)
    said = LOSING_WINDOW["long_context_warning"]
    row = browser.find_element(By.CSS_SELECTOR, '#summary-table tr[data-backend="window"]')
    flag = row.find_element(By.CSS_SELECTOR, "th .long-context-warning")
    assert flag.is_displayed() and flag.text == "⚠ loses at long context" and flag.get_attribute("title") == said
    assert not row.find_elements(By.CSS_SELECTOR, "th .over-budget")
    listed = browser.find_elements(By.CSS_SELECTOR, "#backends .long-context-warning")
    assert [w.get_attribute("data-backend") for w in listed] == ["window"] and said in listed[0].text
    assert not browser.find_elements(By.CSS_SELECTOR, '#summary-table tr[data-backend="full"] .long-context-warning')


def test_shared_url_marks_the_first_diverging_token(browser, server):
    full = tgi_text(server, "full", 40, details=True)["details"]["tokens"]
    gqa = tgi_text(server, "gqa", 40, details=True)["details"]["tokens"]
    first = next(i for i, (a, b) in enumerate(zip(full, gqa)) if a["id"] != b["id"])
    query = urlencode({"prompt": PROMPT, "backends": "full,int8,gqa", "max_new_tokens": 40,
                       "repetition_penalty": 1.3, "runs": 1})
    browser.get(f"{server.url}/?{query}")  # the shareable URL runs the comparison by itself
    wait(browser, lambda d: len(cards(d)) == 3 and d.find_element(By.ID, "run").is_enabled())
    mark = cards(browser)["gqa"].find_element(By.CSS_SELECTOR, "mark.diverge")
    assert int(mark.get_attribute("data-index")) == first
    assert mark.get_attribute("textContent") == (gqa[first]["text"] or f"⟨{gqa[first]['id']}⟩")
    assert f"at token {first}" in cards(browser)["gqa"].find_element(By.CSS_SELECTOR, ".verdict").text
    assert cards(browser)["full"].find_elements(By.CSS_SELECTOR, "mark.diverge") == []
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == PROMPT


SUMMARY_CELLS = "#summary-table tbody th, #summary-table td"


def size_text(r: float) -> str:
    """A size against full's as the page (and the start-up log, and the README) writes it: N.NNx smaller."""
    times = f"{1 / r if r < 1 else r:.2f}"
    return "same size" if times == "1.00" else f"{times}x {'smaller' if r < 1 else 'larger'}"


def test_summary_of_every_backend_on_the_default_prompt(browser, server):
    backends = ["full", "int8", "int4", "elastic", "gqa"]
    found = run_from_form(browser, server, backends, 40, prompt=None, runs=3)
    default = browser.find_element(By.ID, "prompt").get_attribute("value")
    rows = {r.get_attribute("data-backend"): r
            for r in browser.find_elements(By.CSS_SELECTOR, "#summary-table tbody tr")}
    assert list(rows) == backends  # one row per backend, the reference first

    def cell(backend, cls, attr="data-ratio"):
        return float(rows[backend].find_element(By.CSS_SELECTOR, "." + cls).get_attribute(attr))

    peak = {b: int(found[b].find_element(By.CSS_SELECTOR, ".kv-peak").get_attribute("data-bytes")) for b in backends}
    for b in backends:  # KV as a ratio to full's, shown as such
        assert cell(b, "bytes-ratio") == pytest.approx(peak[b] / peak["full"])
        assert cell(b, "peak-ratio") == pytest.approx(peak[b] / peak["full"])
        assert rows[b].find_element(By.CSS_SELECTOR, ".peak-ratio .key").text == size_text(peak[b] / peak["full"])
        assert cell(b, "ttft-ratio") > 0 and cell(b, "tpot-ratio") > 0
    assert rows["full"].find_element(By.CSS_SELECTOR, ".ttft-ratio .key").text == "same time"
    assert rows["int8"].find_element(By.CSS_SELECTOR, ".peak-ratio .key").text.endswith("x smaller")
    # gqa (2 groups by mean pooling, set explicitly) is over the quality budget: flagged with its price
    quality = httpx.get(server.url + "/info", timeout=10).json()["kv_quality"]
    flag = rows["gqa"].find_element(By.CSS_SELECTOR, "th .over-budget")
    assert flag.text == f"⚠ over budget: +{quality['gqa']['price']['ppl_increase_pct']:.2f}%"
    assert flag.get_attribute("title") == (f"+{quality['gqa']['price']['ppl_increase_pct']:.2f}% perplexity, top-1 "
                                           f"agreement {quality['gqa']['price']['agreement']:.3f}, over the quality "
                                           "budget of +1%")
    assert all(not rows[b].find_elements(By.CSS_SELECTOR, ".over-budget") for b in backends if b != "gqa")
    # the reference model's defaults: text to continue, penalty 1.3, the chat switch offered but off
    assert browser.find_element(By.ID, "repetition-penalty").get_attribute("value") == "1.3"
    assert browser.find_element(By.ID, "chat-switch").is_displayed()
    assert not browser.find_element(By.ID, "chat").is_selected()
    # the default prompt is long enough for every quantizing backend to quantize at its defaults
    prompt_tokens = int(browser.find_element(By.ID, "shown-prompt-tokens").text.split()[0])
    assert prompt_tokens > 100 and 0 < cell("int4", "peak-ratio") < cell("int8", "peak-ratio") < 1
    assert "compressed" == rows["int8"].find_element(By.CSS_SELECTOR, ".note").text
    # elastic has room in the pool: full's bytes, and why, on its row and its card
    assert cell("elastic", "peak-ratio") == 1
    assert rows["elastic"].find_element(By.CSS_SELECTOR, ".note").text.startswith(
        f"not compressed yet: the KV pool had room: elastic keeps all {prompt_tokens + 39} tokens exact")
    assert found["elastic"].find_element(By.CSS_SELECTOR, ".uncompressed").is_displayed()
    # greedy agreement and the first difference, as the cards show them
    full_ids = [t["id"] for t in tgi_text(server, "full", 40, details=True, prompt=default)["details"]["tokens"]]
    gqa_ids = [t["id"] for t in tgi_text(server, "gqa", 40, details=True, prompt=default)["details"]["tokens"]]
    share = sum(a == b for a, b in zip(full_ids, gqa_ids)) / 40
    assert share < 1 and cell("gqa", "agreement", "data-share") == pytest.approx(share)
    first = next(i for i, (a, b) in enumerate(zip(full_ids, gqa_ids)) if a != b)
    assert rows["gqa"].find_element(By.CSS_SELECTOR, ".first-diff").get_attribute("data-index") == str(first)
    assert found["gqa"].get_attribute("data-diverge") == str(first)
    assert rows["full"].find_element(By.CSS_SELECTOR, ".agreement .key").text == "reference"
    # one log-probability scale for every plot; the prompt once, not on each card
    scales = {svg.get_attribute("data-scale") for svg in browser.find_elements(By.CSS_SELECTOR, "#results svg.plot")}
    assert len(browser.find_elements(By.CSS_SELECTOR, "#results svg.plot")) == 4 and len(scales) == 1
    assert browser.find_element(By.ID, "shown-prompt-text").text == default
    assert all(default not in c.find_element(By.CSS_SELECTOR, ".text").text for c in found.values())
    # timings labelled as what they are
    assert "warm, median of 3 (min–max)" in browser.find_element(By.ID, "summary-timing").text
    assert found["int8"].find_element(By.CSS_SELECTOR, ".ttft .detail").text.startswith("warm, median of 3: ")
    assert cut_off(browser, SUMMARY_CELLS + ", #results .result") == []  # at 1280 px
    shot(browser, "ui-compare.png", browser.execute_script("return document.documentElement.scrollHeight") + 200)


def test_the_page_waits_for_the_model_and_goes_on_by_itself(browser, loading_server):
    browser.get(loading_server.url + "/")
    notice = wait(browser, lambda d: d.find_element(By.ID, "waiting").is_displayed()
                  and d.find_element(By.ID, "waiting"), 30)
    assert "/info: 503 model is loading" in notice.text and "checking /health" in notice.text
    assert not browser.find_element(By.ID, "run").is_enabled()
    time.sleep(3)  # a /health poll or two while it loads
    assert loading_server.health_polls >= 1 and not browser.find_element(By.ID, "error").is_displayed()
    loading_server.ready.set()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#backends input[value="int8"]'), 30)
    assert not browser.find_element(By.ID, "waiting").is_displayed()
    assert browser.find_element(By.ID, "run").is_enabled() and "stub-model" in browser.find_element(By.ID, "model").text


def test_a_reference_that_stops_at_once_is_said_so(browser, stopping_server):
    """A chat model given a question as raw text answers end-of-text at once: the summary says so and why, in place
    of "100.0%, 1 of 1 tokens"; three runs of one token each are counted as three, with no TPOT."""
    query = urlencode({"prompt": "What is the capital of France?", "backends": "full,int8", "runs": 3, "chat": 0})
    browser.get(f"{stopping_server.url}/?{query}")
    wait(browser, lambda d: len(cards(d)) == 2 and d.find_element(By.ID, "run").is_enabled(), 60)
    assert all(body["chat"] is False for body in stopping_server.bodies) and len(stopping_server.bodies) == 8
    notice = browser.find_element(By.ID, "summary-notice")
    assert notice.is_displayed() and notice.text.startswith("full stopped at once: its only token was end-of-text")
    assert "turn on “chat template”" in notice.text
    row = browser.find_element(By.CSS_SELECTOR, '#summary-table tr[data-backend="int8"]')
    assert row.find_element(By.CSS_SELECTOR, ".agreement .key").text == "–"
    assert "nothing to compare" in row.find_element(By.CSS_SELECTOR, ".agreement").text
    assert "stopped at once" in cards(browser)["full"].find_element(By.CSS_SELECTOR, ".verdict").text
    tpot = cards(browser)["int8"].find_element(By.CSS_SELECTOR, ".tpot .detail").text
    assert tpot == "3 runs, one token a run: TPOT needs two"
    assert cards(browser)["int8"].find_element(By.CSS_SELECTOR, ".ttft .detail").text.startswith("warm, median of 3")
    # a fresh page: the chat model's defaults, the template on
    browser.get(stopping_server.url + "/")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#backends input[value="full"]'), 30)
    assert browser.find_element(By.ID, "chat").is_selected()
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "What is the capital of France?"
    assert browser.find_element(By.ID, "repetition-penalty").get_attribute("value") == "1"
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#preset option")][1:] == [
        "The capital of France (37 tokens as a chat turn)"]
    browser.find_element(By.ID, "run").click()
    wait(browser, lambda d: len(stopping_server.bodies) > 8 and d.find_element(By.ID, "run").is_enabled(), 60)
    assert stopping_server.bodies[-1]["chat"] is True
    assert "chat=1" in browser.current_url


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


SUMS_CELLS = "#sums-table tbody th, #sums-table td"


def test_sums_view_lists_every_backend(browser, server):
    browser.get(server.url + "/?view=sums&seq_len=1024&batch=32")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr"))
    shown = {r.get_attribute("data-backend") for r in browser.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr")}
    assert shown >= {"full", "gqa", "mla", "int8", "int4", "dca", "elastic", "mla+int8", "gqa+int8", "gqa+int4"}
    full = browser.find_element(By.CSS_SELECTOR, '#sums-table tr[data-backend="full"] .total')
    assert full.text == "512.00 MiB"  # 16384 bytes/token x 1024 tokens x 32 sequences
    k8v4 = browser.find_element(By.CSS_SELECTOR, '#sums-table tr[data-aka="k8v4"] th')
    assert k8v4.text == "int8 (k8v4)"
    elastic = browser.find_element(By.CSS_SELECTOR, '#sums-table tr[data-backend="elastic"] .total').text
    assert elastic.endswith("–512.00 MiB")  # from every compressible token quantized to every token exact
    # one ratio convention; each served row priced by the quality budget (full: 0), gqa over it, the others not
    vs = {r.find_element(By.CSS_SELECTOR, "th").text: r.find_element(By.CSS_SELECTOR, ".vs-full").text
          for r in browser.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr")}
    assert vs["full"] == "same size" and vs["int8 (k8v4)"].endswith("x smaller")
    assert vs["elastic"].startswith("same size to ") and vs["elastic"].endswith("x smaller")
    quality = httpx.get(server.url + "/info", timeout=10).json()["kv_quality"]
    price = {r.find_element(By.CSS_SELECTOR, ".served").text: r.find_element(By.CSS_SELECTOR, ".price")
             for r in browser.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr")}
    assert price["full"].text == "+0.00% perplexity, top-1 agreement 1.000" and price["–"].text == "not priced"
    int8 = quality["int8"]["price"]
    assert price["int8"].text == f"+{int8['ppl_increase_pct']:.2f}% perplexity, top-1 agreement {int8['agreement']:.3f}"
    assert float(price["int8"].get_attribute("data-agreement")) == int8["agreement"]
    assert price["gqa"].text.endswith(f"top-1 agreement {quality['gqa']['price']['agreement']:.3f}, over the "
                                      "quality budget of +1%")
    assert not browser.find_element(By.ID, "sums-warning").is_displayed()
    assert cut_off(browser, SUMS_CELLS) == []  # the last column at 1280 px
    shot(browser, "ui-sums.png", 1100)
    fill(browser, "seq-len", 32768)
    browser.find_element(By.CSS_SELECTOR, "#sums-form button").click()
    warning = wait(browser, lambda d: d.find_element(By.ID, "sums-warning").is_displayed()
                   and d.find_element(By.ID, "sums-warning"), 30)
    assert "32,768 tokens is more than this model's 1,024 positions (max_position_embeddings)" in warning.text


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
        assert {"tab-compare", "preset", "prompt", "full", "int8", "max-new-tokens", "runs", "run"} <= set(seen), seen
        prompt = browser.find_element(By.ID, "prompt")
        prompt.click()
        prompt.send_keys(Keys.CONTROL, Keys.ENTER)
        wait(browser, lambda d: len(cards(d)) == 2 and d.find_element(By.ID, "run").is_enabled(), 300)
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#summary-table tbody tr")) == 2
        assert cut_off(browser, SUMMARY_CELLS + ", #summary-table .key, #results .result, #results dd") == []
        shot(browser, "ui-compare-phone.png", 1400)
        # Live's and Sums' key numbers on screen too (each row a block, each value beside its column's name)
        browser.find_element(By.ID, "tab-live").click()
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#live-table tr[data-backend="full"] .kv-used'), 30)
        assert cut_off(browser, "#live-table tbody th, #live-table td") == []
        browser.find_element(By.ID, "tab-sums").click()
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#sums-table tbody tr .vs-full"), 30)
        assert cut_off(browser, SUMS_CELLS) == []
        label = browser.execute_script(
            "return getComputedStyle(document.querySelector('#sums-table td.total'), '::before').content")
        assert label == '"total"'
        browser.find_element(By.ID, "tab-compare").click()
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

"""The dashboard in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, which `make test` installs) driven by selenium, against the API on a real
HTTP server and a real `llmq worker` process serving SmolLM2 (the default model) beside
Gemma 3 (which has no chat template), as a user's first visit goes; its charts (uPlot,
vendored in api/static/vendor/uplot) drawn from the samples the worker keeps."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.workers.conftest import REPO, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEFAULT, NO_TEMPLATE = "smollm2-135m-instruct", "gemma-3-270m"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):  # CI installs them (make test): never skip
        assert shutil.which(path), f"{path} is missing: apt-get install chromium chromium-driver"
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,1700")
    # the driver is named, so selenium never looks for (or downloads) one of its own
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def smollm2_worker(redis_url: str, real_redis: redis.Redis, monkeypatch) -> Iterator[str]:
    """A worker serving both built-in models with room for one: SmolLM2 (first) is loaded as
    it starts; Gemma is only read for its chat template."""
    monkeypatch.setenv("LLMQ_POOL_CAPACITY", "1")
    # slow steps (~10 tokens: 4 s), so the answer is still streaming when the page refreshes
    worker = WorkerProcess(
        "dash-w1", [DEFAULT, NO_TEMPLATE], redis_url=redis_url, step_delay_ms=400
    )
    worker.wait_registered(real_redis)
    yield worker.name
    worker.stop()


def test_dashboard_shows_the_system_and_streams_a_chat(
    browser, server: str, smollm2_worker: str, redis_url: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait_for(lambda: httpx.get(f"{server}/ready").status_code == 200, 120, "SmolLM2 loaded")
    browser.get(server + "/")
    page = WebDriverWait(browser, 20, poll_frequency=0.1)
    text = lambda element_id: browser.find_element(By.ID, element_id).text  # noqa: E731

    page.until(lambda _: smollm2_worker in text("workers"))
    # each worker's device, and each pool entry's
    assert re.search(rf"^{smollm2_worker} \S+ / \d+ (idle|busy) cpu ", text("workers"), re.M)
    page.until(lambda _: f"{DEFAULT} yes {smollm2_worker} ready cpu " in text("models"))
    # the Redis in use (docs/faults.md F20): the test's own server, a master without replicas
    address = redis_url.split("://")[1].split("/")[0]
    assert text("broker") == f"{address} \u00b7 master \u00b7 0 replicas"
    assert f"{NO_TEMPLATE} no template - not loaded" in text("models")

    model = Select(browser.find_element(By.ID, "model"))
    chat = browser.find_element(By.ID, "chat")
    assert model.first_selected_option.text == DEFAULT  # not the list's first (gemma)
    page.until(lambda _: chat.is_enabled() and chat.is_selected())
    model.select_by_value(NO_TEMPLATE)
    assert not chat.is_enabled() and not chat.is_selected()
    assert "no chat template" in text("chatnote")
    model.select_by_value(DEFAULT)
    assert chat.is_enabled() and chat.is_selected()

    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("Name the capital city of France.")  # a clear margin for SmolLM2
    for field, value in (("temp", "0"), ("maxtok", "48")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "go").click()
    out = browser.find_element(By.ID, "out")
    page.until(lambda _: out.text.strip())  # streamed: text shows before the answer ends
    assert not browser.find_element(By.ID, "go").is_enabled()
    page.until(lambda _: DEFAULT in text("jobs") and smollm2_worker in text("jobs"))
    page.until(lambda _: browser.find_element(By.ID, "go").is_enabled())  # the stream ended
    assert "Paris" in out.text and out.get_attribute("class") != "err", out.text

    # the charts: the answer's tokens and its first token, once a sample after it is taken
    page = WebDriverWait(browser, 30, poll_frequency=0.5)
    page.until(lambda _: any(v > 0 for v in _values(browser, "tps", 1)))
    page.until(lambda _: len(_values(browser, "ttft", 1)) >= 2)  # a line, not a dot
    assert all(0 < v < 60 for v in _values(browser, "ttft", 1) + _values(browser, "ttft", 2))
    assert len(_values(browser, "load", 1)) >= 2 and len(_values(browser, "load", 2)) >= 2
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    for chart, color in (("tps", (31, 119, 180)), ("ttft", (148, 103, 189))):
        assert _pixels_of(browser, chart, color) > 20, chart  # its line is drawn
    assert not browser.find_element(By.ID, "nohistory").is_displayed()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    first = _times(browser)[0]
    browser.refresh()  # the history is in Redis, not in the page
    WebDriverWait(browser, 10, poll_frequency=0.2).until(lambda _: _times(browser))
    assert _times(browser)[0] == first and any(v > 0 for v in _values(browser, "tps", 1))

    icon = browser.find_element(By.CSS_SELECTOR, "link[rel=icon]").get_attribute("href")
    for url in (icon, f"{server}/favicon.ico"):
        response = httpx.get(url)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("image/svg+xml")


def _values(browser, chart: str, series: int) -> list[float]:
    """The non-null values a chart holds now (uPlot's `data`, what it draws)."""
    script = "const c = window.llmqCharts[arguments[0]]; return c ? c.data[arguments[1]] : [];"
    return [v for v in browser.execute_script(script, chart, series) or [] if v is not None]


def _times(browser) -> list[float]:
    script = "const c = window.llmqCharts.tps; return c ? Array.from(c.data[0]) : [];"
    return browser.execute_script(script) or []


def _pixels_of(browser, chart: str, rgb: tuple[int, int, int]) -> int:
    """Pixels of the chart's canvas in (about) a series' colour."""
    script = """
        const [chart, r, g, b] = arguments, ctx = window.llmqCharts[chart].ctx;
        const img = ctx.getImageData(0, 0, ctx.canvas.width, ctx.canvas.height).data;
        let n = 0;
        for (let i = 0; i < img.length; i += 4)
          if (img[i + 3] > 200 && Math.abs(img[i] - r) + Math.abs(img[i + 1] - g)
              + Math.abs(img[i + 2] - b) < 60) n++;
        return n;"""
    return browser.execute_script(script, chart, *rgb)


def test_the_vendored_charting_library_is_the_one_its_readme_names() -> None:
    folder = REPO / "api" / "static" / "vendor" / "uplot"
    readme = (folder / "README.md").read_text()
    version = re.search(r"version: (\S+)", readme).group(1)
    script = (folder / "uPlot.iife.min.js").read_bytes()
    assert script.startswith(f"/*! https://github.com/leeoniya/uPlot (v{version}) */".encode())
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert f"`{name}` {digest}" in readme.replace("\n  ", " "), name
    assert "MIT License" in (folder / "LICENSE").read_text()
    page = (REPO / "api" / "templates" / "index.html").read_text()
    assert f"uPlot {version} (MIT)" in page and "cdn" not in page.lower()

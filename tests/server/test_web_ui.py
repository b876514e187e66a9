"""The web chat page at `/`, driven in a real headless Chromium through Playwright.

Needs Debian's Chromium at /usr/bin/chromium (or $TOKENMILL_CHROMIUM) and the `playwright`
Python package; `scripts/test.sh` installs both. A missing one fails the test: it never skips.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "test-artifacts" / "web-chat.png"
CHROMIUM = os.environ.get("TOKENMILL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOW_TO_INSTALL = (
    "Run scripts/test.sh, which installs everything, or by hand: `pip install playwright` "
    "(do not run `playwright install`; the test drives the system Chromium) and, as root, "
    "`apt-get update && apt-get install -y chromium`."
)
STREAM_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser_or_reason():
    """A launched Chromium, or why there is none (each test then fails with that reason)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        yield (
            "the web UI test needs the `playwright` Python package, which is not installed. "
            f"{HOW_TO_INSTALL}"
        )
        return
    if not os.access(CHROMIUM, os.X_OK):
        yield f"the web UI test needs Chromium at {CHROMIUM}, which is missing. {HOW_TO_INSTALL}"
        return
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        except Exception as exc:  # noqa: BLE001 - reported as the test's failure
            yield f"Chromium at {CHROMIUM} did not start under Playwright: {exc}. {HOW_TO_INSTALL}"
            return
        yield browser
        browser.close()


@pytest.fixture()
def browser_page(browser_or_reason, server):
    """A fresh page (own context, so own localStorage), or why there is none."""
    if isinstance(browser_or_reason, str):
        yield browser_or_reason
        return
    context = browser_or_reason.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.page_errors = []
    page.on("pageerror", lambda exc: page.page_errors.append(str(exc)))
    yield page
    context.close()


def _need(browser_page):
    """The page; a missing browser fails the test itself (a failure, not a setup error or a
    skip)."""
    if isinstance(browser_page, str):
        pytest.fail(browser_page, pytrace=False)
    return browser_page


def _chat_requests(page) -> list:
    requests: list = []
    page.on(
        "request", lambda r: requests.append(r) if r.url.endswith("/v1/chat/completions") else None
    )
    return requests


def _open(page, server, api_key: str | None = API_KEY) -> None:
    from playwright.sync_api import expect

    page.goto(server.url + "/")
    expect(page).to_have_title(re.compile("tokenmill"))
    if api_key is not None:
        page.get_by_label("API key").fill(api_key)


def test_chat_streams_answer_with_stats_and_metrics(browser_page, server) -> None:
    page = _need(browser_page)
    from playwright.sync_api import expect

    requests = _chat_requests(page)
    _open(page, server)
    expect(page.get_by_label("Model")).to_have_value(MODEL_NAME)
    expect(page.get_by_test_id("error-banner")).to_be_hidden()
    page.get_by_test_id("temperature").fill("0")
    page.get_by_label("Max tokens").fill("48")
    page.get_by_label("System prompt").fill("You are terse.")

    prompt = page.get_by_label("Message")
    prompt.fill("Name a capital.")
    prompt.press("Enter")
    answer = page.get_by_test_id("assistant-message").last
    expect(answer).to_have_attribute("data-state", "done", timeout=STREAM_TIMEOUT_MS)

    text = answer.get_by_test_id("message-content").text_content()
    assert text.strip(), "the assistant bubble is empty"
    chunks = int(answer.get_attribute("data-chunks"))
    assert chunks > 1, f"expected the answer to stream in several SSE chunks, got {chunks}"
    stats = answer.get_by_test_id("message-stats")
    expect(stats).to_contain_text(re.compile(r"\d+(\.\d+)? tok/s"))
    expect(stats).to_contain_text(re.compile(r"TTFT \d+(\.\d+)? m?s"))
    assert float(answer.get_attribute("data-tokens-per-second")) > 0

    # What the page sent, and that the streamed text equals the non-streamed answer (greedy
    # decoding).
    body = requests[0].post_data_json
    assert requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL_NAME and body["temperature"] == 0 and body["max_tokens"] == 48
    first_turn = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a capital."},
    ]
    assert body["messages"] == first_turn
    reference = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={k: v for k, v in body.items() if k not in ("stream", "stream_options")},
        timeout=60,
    )
    assert text == reference.json()["choices"][0]["message"]["content"]

    # A second turn carries the whole conversation.
    prompt.fill("And another?")
    page.get_by_role("button", name="Send").click()
    second = page.get_by_test_id("assistant-message").nth(1)
    expect(second).to_have_attribute("data-state", "done", timeout=STREAM_TIMEOUT_MS)
    assert len(requests) == 2
    assert requests[1].post_data_json["messages"] == first_turn + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And another?"},
    ]
    expect(page.get_by_test_id("user-message")).to_have_count(2)

    # The live panel polls /metrics every 2 s: wait for a poll after the answers, then read it.
    panel = page.get_by_test_id("metrics-panel")
    expect(panel).to_have_attribute("data-state", "ok")
    expect(panel).to_have_attribute("data-polls", re.compile(r"^[1-9]"))
    polls = int(panel.get_attribute("data-polls"))
    expect(panel).to_have_attribute("data-polls", str(polls + 1), timeout=10_000)
    expect(page.get_by_test_id("metric-running")).to_have_text("0")  # nothing left in flight
    expect(page.get_by_test_id("metric-waiting")).to_have_text("0")
    expect(page.get_by_test_id("metric-kv")).to_have_text(re.compile(r"^\d+(\.\d+)?%$"))
    # The reference call and the second turn reused the first turn's prompt blocks.
    expect(page.get_by_test_id("metric-prefix")).to_have_text(re.compile(r"^[1-9]\d*(\.\d+)?%$"))
    expect(page.get_by_test_id("metric-throughput")).to_have_text(re.compile(r"^\d+(\.\d+)?$"))

    assert page.page_errors == []
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 10_000


def test_errors_are_shown(browser_page, server) -> None:
    page = _need(browser_page)
    from playwright.sync_api import expect

    _open(page, server, api_key="wrong-key")
    banner = page.get_by_test_id("error-banner")
    expect(banner).to_contain_text("Incorrect API key")

    prompt = page.get_by_label("Message")
    prompt.fill("Hello?")
    prompt.press("Enter")
    answer = page.get_by_test_id("assistant-message").last
    expect(answer).to_have_attribute("data-state", "error")
    expect(answer).to_contain_text("HTTP 401")
    expect(answer).to_contain_text("Incorrect API key")
    expect(banner).to_contain_text("Incorrect API key")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    assert page.page_errors == []


def test_stop_aborts_the_stream(browser_page, server) -> None:
    page = _need(browser_page)
    from playwright.sync_api import expect

    _open(page, server)
    expect(page.get_by_label("Model")).to_have_value(MODEL_NAME)
    page.get_by_label("Max tokens").fill("400")
    # Throttle the download so that the answer is still streaming when Stop is pressed.
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": 1500, "uploadThroughput": -1},
    )

    prompt = page.get_by_label("Message")
    prompt.fill("Tell me a long story.")
    prompt.press("Enter")
    answer = page.get_by_test_id("assistant-message").last
    expect(answer).to_have_attribute(
        "data-chunks", re.compile(r"^[1-9]"), timeout=STREAM_TIMEOUT_MS
    )
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_enabled()
    stop.click()
    expect(answer).to_have_attribute("data-state", "stopped")
    expect(answer.get_by_test_id("message-stats")).to_contain_text("stopped")
    expect(stop).to_be_disabled()
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    assert page.page_errors == []

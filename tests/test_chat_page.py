"""The chat page at `/` in a real headless browser (Chromium from the system's packages, driven by
Playwright): type, send, see the answer stream in; Stop; New chat; the model's name and context
use. Slow suite: `python -m pytest -m slow tests/test_chat_page.py`.
Needs `apt-get install chromium` and `pip install playwright` (no browser download: the system's
Chromium is used), and skips without them.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    pytest.importorskip("starlette")
    if not os.path.exists(CHROMIUM):
        pytest.skip("no system Chromium (apt-get install chromium)")
    sys.path.insert(0, os.path.dirname(__file__))
    from _serve_cli import ServedCLI

    server = ServedCLI("demo", "--chat-template", "chatml", "-np", "2", "-c", "1024")
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
            pg = browser.new_page()
            requests = []
            pg.on("request", lambda r: requests.append(r.url))
            pg.goto(server.url + "/#max_tokens=48")
            pg.requests = requests
            pg.server = server
            yield pg
            browser.close()
    finally:
        server.stop()


def test_type_send_and_see_the_answer_stream_in(page):
    page.wait_for_function("document.getElementById('model').textContent.includes('shakespeare')")
    # count the updates of the answer while it streams
    page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }""")
    page.fill("#input", "Tell me of Verona.")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.user")
    assert page.inner_text(".msg.user") == "Tell me of Verona."
    page.wait_for_selector(".msg.assistant[data-state=done]", state="attached", timeout=120_000)
    answer = page.inner_text(".msg.assistant")
    assert answer.strip()
    assert page.evaluate("window.updates") > 3  # the text came in pieces, not at once
    assert "context" in page.inner_text("#ctx") and "/ 1024" in page.inner_text("#ctx")
    assert page.evaluate("document.getElementById('send').disabled") is False
    assert all(u.startswith(page.server.url) for u in page.requests)  # nothing from the network


def test_stop_and_new_chat(page):
    page.goto(page.server.url + "/#max_tokens=900")  # a long answer, stopped while it streams
    page.reload()
    page.wait_for_function("document.getElementById('model').textContent.includes('shakespeare')")
    page.fill("#input", "Speak at length.")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelector('.msg.assistant') && "
                           "document.querySelector('.msg.assistant').textContent.length > 20", timeout=120_000)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state=done]", state="attached", timeout=60_000)
    stopped = page.inner_text(".msg.assistant")
    page.wait_for_timeout(1000)
    assert page.inner_text(".msg.assistant") == stopped  # nothing more came
    assert page.evaluate("document.getElementById('stop').disabled") is True
    assert page.query_selector(".msg.error") is None  # a stop is no error
    assert page.server.alive()
    page.click("#new")
    assert page.inner_html("#log") == ""
    assert "context 0 /" in page.inner_text("#ctx")


def test_markdown_and_code_render(page):
    html = page.evaluate("markdown('# Title\\n**bold** and `x`\\n```python\\nprint(1 < 2)\\n```\\n- a\\n- b')")
    assert "<h3>Title</h3>" in html and "<strong>bold</strong>" in html and "<code>x</code>" in html
    assert '<pre><code class="lang-python">print(1 &lt; 2)</code></pre>' in html and "<li>a</li>" in html
    assert "<script>" not in page.evaluate("markdown('<script>alert(1)</script>')")

"""The web page in a real browser: Debian's chromium, headless, driven by selenium, on the page the
real `strata serve` (STRATA_BIN, the embedded tiny model, a free port) serves at /. A message sent
streams an answer in, Stop ends a reply, conversations survive a reload, the Monitor tab shows
/status, the model's text is escaped, and nothing is loaded from outside the server.
Skipped when chromium, chromedriver or selenium is missing (./setup.sh installs them)."""
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))
MODEL = ROOT / "models" / "tiny-coder.gguf"
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if not CHROMIUM or not CHROMEDRIVER:
    pytest.skip("chromium or chromedriver not installed (apt-get install chromium chromium-driver; "
                "./setup.sh installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="python selenium not installed (tools/requirements.txt)")
from selenium.common.exceptions import ElementNotInteractableException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

STARTUP_S = 120  # the sanitizer build on a loaded 2-core machine loads the tiny model in seconds; margin


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(log, *extra):
    """The real `strata serve` on the tiny model and a free port; yields its URL, then stops it."""
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([BIN, "serve", "--model", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
                                 "--parallel", "1", *extra], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"strata serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(url + "health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"strata serve did not answer /health within {STARTUP_S} s:\n"
                        f"{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "a timeout: it did not exit within 30 s of SIGTERM"
    assert rc == 0, f"strata serve ended with {rc}:\n{log.read_text(errors='replace')[-4000:]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("web") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1000,800", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def open_page(driver, url, settings=None):
    """Loads the page with a clean localStorage (and the given settings), on the chat tab."""
    driver.get(url)
    driver.execute_script("localStorage.clear();"
                          "if (arguments[0]) localStorage.setItem('strata.settings', arguments[0]);",
                          json.dumps(settings) if settings else None)
    driver.get(url)
    WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "input").is_displayed())


def reply_text(driver):
    """Everything the last reply holds so far: its content and its reasoning."""
    return driver.execute_script(
        "const m = [...document.querySelectorAll('.msg.assistant')].pop();"
        "return m ? m.querySelector('.content').textContent + m.querySelector('.reasoning .text').textContent : '';")


def send(driver, text):
    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def severe_console_errors(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_message_streams_an_answer(server, browser):
    open_page(browser, server, {"temperature": 0, "max_tokens": 48, "system": "", "api_key": ""})
    send(browser, "def fibonacci(n):")
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "stop").is_displayed())
    # While Stop shows, the reply must grow in steps: several distinct partial texts, not one lump.
    seen = []
    deadline = time.time() + 120
    while browser.find_element(By.ID, "stop").is_displayed():
        assert time.time() < deadline, "the reply did not finish in 120 s"
        t = reply_text(browser)
        if t and (not seen or t != seen[-1]):
            seen.append(t)
        time.sleep(0.02)
    final = reply_text(browser)
    assert final.strip(), "no answer appeared"
    assert len(seen) >= 2, f"the answer arrived in one piece, not streamed: {seen}"
    assert browser.find_element(By.ID, "send").is_displayed()
    meta = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
    assert re.search(r"\d+ tokens", meta), meta
    assert "Error" not in browser.find_element(By.CSS_SELECTOR, ".msg.assistant").text
    # The conversation is listed under its first message.
    titles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#conv-list .open")]
    assert titles == ["def fibonacci(n):"]
    # ... and kept in localStorage with the whole reply.
    stored = json.loads(browser.execute_script("return localStorage.getItem('strata.conversations')"))
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    kept = stored[0]["messages"][1]
    assert (kept["content"] + kept["reasoning"]).strip() and "streaming" not in kept
    assert not severe_console_errors(browser)


def test_conversation_survives_reload_and_delete(server, browser):
    conv = {"id": "c1", "title": "hello", "updated": 1, "messages": [
        {"id": "m1", "role": "user", "content": "hello"},
        {"id": "m2", "role": "assistant", "content": "**hi** there", "reasoning": "greet back", "meta": "3 tokens"}]}
    open_page(browser, server)
    browser.execute_script("localStorage.setItem('strata.conversations', arguments[0])", json.dumps([conv]))
    browser.refresh()
    WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#conv-list .open"))
    assert browser.find_element(By.CSS_SELECTOR, "#conv-list .open").text == "hello"
    browser.find_element(By.CSS_SELECTOR, "#conv-list .open").click()
    msgs = browser.find_elements(By.CSS_SELECTOR, "#messages .msg")
    assert [m.get_attribute("class").split()[1] for m in msgs] == ["user", "assistant"]
    assert msgs[1].find_element(By.CSS_SELECTOR, ".content strong").text == "hi"
    details = msgs[1].find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.get_attribute("open") is None  # reasoning starts collapsed
    assert not msgs[1].find_element(By.CSS_SELECTOR, ".reasoning .text").is_displayed()
    details.find_element(By.TAG_NAME, "summary").click()
    assert msgs[1].find_element(By.CSS_SELECTOR, ".reasoning .text").text == "greet back"
    browser.find_element(By.CSS_SELECTOR, "#conv-list .delete").click()
    browser.switch_to.alert.accept()
    assert not browser.find_elements(By.CSS_SELECTOR, "#conv-list li")
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages .msg")
    assert json.loads(browser.execute_script("return localStorage.getItem('strata.conversations')")) == []


def test_stop_ends_a_reply_and_the_server_goes_on(server, browser):
    open_page(browser, server, {"temperature": 0.8, "max_tokens": 4000, "system": "", "api_key": ""})
    for attempt in range(3):  # a sampled reply may end by itself before Stop is pressed: try again
        send(browser, "Write a long Python module with many classes.")
        WebDriverWait(browser, 60).until(lambda d: len(reply_text(d)) > 0 or d.find_element(By.ID, "send").is_displayed())
        try:
            browser.find_element(By.ID, "stop").click()
            break
        except ElementNotInteractableException:  # hidden again: the reply has ended
            pass
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "send").is_displayed())
    else:
        pytest.fail("three replies ended before Stop could be pressed")
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "send").is_displayed())
    replies = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    assert "stopped" in replies[-1].find_element(By.CSS_SELECTOR, ".meta").text
    # A second message in the same conversation is answered.
    settings = {"temperature": 0, "max_tokens": 8, "system": "", "api_key": ""}
    browser.execute_script("localStorage.setItem('strata.settings', arguments[0])", json.dumps(settings))
    browser.refresh()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "input").is_displayed())
    send(browser, "import os")
    WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "send").is_displayed()
                                      and len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == len(replies) + 1)
    last = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert "error" not in last.get_attribute("class"), last.text
    assert re.search(r"\d+ tokens", last.find_element(By.CSS_SELECTOR, ".meta").text)


def test_monitor_tab_shows_numbers(server, browser):
    open_page(browser, server)
    browser.find_element(By.ID, "tab-monitor").click()
    assert browser.find_element(By.ID, "panel-monitor").is_displayed()
    assert not browser.find_element(By.ID, "panel-chat").is_displayed()
    number = re.compile(r"^\d[\d,]*(\.\d+)?$")
    try:
        WebDriverWait(browser, 10).until(lambda d: number.match(d.find_element(By.ID, "m-decode").text))
    except TimeoutException:
        pytest.fail("no decode speed shown; error line: " + browser.find_element(By.ID, "mon-error").text)
    for id_ in ("m-prompt", "m-total", "m-active", "m-errors", "m-tok-prompt", "m-tok-gen"):
        assert number.match(browser.find_element(By.ID, id_).text), id_
    assert int(browser.find_element(By.ID, "m-total").text.replace(",", "")) >= 1  # the chats above
    assert browser.find_element(By.ID, "m-backend").text in ("cpu", "cuda")
    assert re.match(r"^\d+ waiting \(limit \d+\)$", browser.find_element(By.ID, "m-queue").text)
    ecache = browser.find_element(By.ID, "m-ecache").text
    assert ecache == "no expert cache" or re.match(r"^\d+\.\d% hits$", ecache), ecache
    slots = browser.find_elements(By.CSS_SELECTOR, "#m-slots li")
    assert len(slots) == 1 and re.search(r"Slot 0:\s+(idle|prompt|generating), \d+ tokens", slots[0].text)
    system = browser.find_element(By.ID, "m-system").text
    assert re.search(r"CPU\s+\d+%", system) and re.search(r"RAM\s+[\d.]+ \w?B of [\d.]+ \w?B", system), system
    # A second poll a second later: the sparkline has two points, so it is drawn.
    time.sleep(2.2)
    drawn = browser.execute_script(
        "const c = document.getElementById('spark-decode'), g = c.getContext('2d');"
        "return g.getImageData(0, 0, c.width, c.height).data.some((v, i) => i % 4 == 3 && v > 0);")
    assert drawn, "the decode sparkline is empty"
    assert not browser.find_element(By.ID, "mon-error").is_displayed()
    # Back to the chat tab: polling stops.
    browser.find_element(By.ID, "tab-chat").click()
    assert browser.find_element(By.ID, "panel-chat").is_displayed()


def test_nothing_loaded_from_outside(server, browser):
    open_page(browser, server)
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"
                                  ".concat([...document.querySelectorAll('[src],[href]')]"
                                  ".map(e => e.src || e.href))")
    origin = server.rstrip("/")
    outside = [u for u in urls if not (u.startswith(origin) or u.startswith("data:"))]
    assert not outside, outside
    for f in ("index.html", "app.js", "style.css"):
        text = (ROOT / "web" / f).read_text()
        assert not re.search(r"(src|href|url)\s*[=(]\s*['\"]?(https?:)?//", text), f
        assert "@import" not in text


MARKDOWN = """# Title
Some **bold**, *italic* and `x < y` and a [link](https://example.com/?a=1&b=2).

- one
- two
  - nested
1. first
2. second

| name | value |
|:-----|------:|
| a | 1 |

```python
def f(x):  # comment
    return "s" + 42
```
"""

HOSTILE = [
    "<img src=x onerror=\"window.__pwned=1\">",
    "<script>window.__pwned=1</script>",
    "[click](javascript:window.__pwned=1)",
    "[click](JaVaScRiPt:window.__pwned=1)",
    "[click](\u0001javascript:window.__pwned=1)",
    "[x](https://a.example/\"onmouseover=\"window.__pwned=1)",
    "`<b>code</b>` **<i>bold</i>**",
    "```html\n<iframe src=\"javascript:window.__pwned=1\"></iframe>\n```",
    "| <svg onload=window.__pwned=1> | b |\n|---|---|\n| <img src=x onerror=window.__pwned=1> | c |",
    "- <a href=\"javascript:window.__pwned=1\">x</a>\n  - <style>body{display:none}</style>",
    "# <u>h</u>\n> <object data=x></object>",
    "\u00011\u0001 `a` \u00010\u0001",
]


def test_markdown_renders_and_escapes(server, browser):
    open_page(browser, server)
    html = browser.execute_script(
        "const d = document.createElement('div'); d.innerHTML = Strata.renderMarkdown(arguments[0]);"
        "return d.innerHTML;", MARKDOWN).replace("\n<", "<")
    for want in ("<h1>Title</h1>", "<strong>bold</strong>", "<em>italic</em>", "<code>x &lt; y</code>",
                 'href="https://example.com/?a=1&amp;b=2"', "<li>two<ul><li>nested</li></ul></li>",
                 "<ol><li>first</li>", '<th style="text-align:left">name</th>', '<td style="text-align:right">1</td>',
                 '<code class="lang-python"><span class="hl-k">def</span>', '<span class="hl-c"># comment</span>',
                 '<span class="hl-s">"s"</span>', '<span class="hl-n">42</span>'):
        assert want in html, (want, html)
    # Hostile input, rendered into the live page: no element or attribute of its making survives.
    found = browser.execute_script("""
        const out = [];
        for (const src of arguments[0]) {
          const d = document.createElement('div');
          d.innerHTML = Strata.renderMarkdown(src);
          document.body.append(d);
          for (const el of d.querySelectorAll('*')) {
            const ok = ['P','BR','H1','STRONG','EM','CODE','PRE','SPAN','A','UL','OL','LI','TABLE','THEAD',
                        'TBODY','TR','TH','TD','BLOCKQUOTE','DEL','HR'];
            if (!ok.includes(el.tagName)) out.push(src + ' -> <' + el.tagName + '>');
            for (const a of el.attributes)
              if (!['href','class','style','target','rel','start'].includes(a.name)) out.push(src + ' -> @' + a.name);
            if (el.tagName === 'A' && !/^https?:/.test(el.href)) out.push(src + ' -> href ' + el.href);
          }
          d.querySelectorAll('a').forEach(a => a.dispatchEvent(new MouseEvent('mouseover')));
          d.remove();
        }
        return out;""", HOSTILE)
    assert not found, found
    time.sleep(0.3)  # an onerror would fire once the image fails
    assert browser.execute_script("return window.__pwned") is None
    text = browser.execute_script("const d = document.createElement('div');"
                                  "d.innerHTML = Strata.renderMarkdown(arguments[0]); return d.textContent;", HOSTILE[6])
    assert "<b>code</b>" in text and "<i>bold</i>" in text


def test_api_key_from_settings(server, browser, tmp_path):
    with serve(tmp_path / "serve-key.log", "--api-key", "sesame") as url:
        open_page(browser, url, {"temperature": 0, "max_tokens": 4, "system": "", "api_key": ""})
        send(browser, "import os")
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant.error"))
        assert "401" in browser.find_element(By.CSS_SELECTOR, ".msg.assistant.error").text
        browser.find_element(By.ID, "tab-monitor").click()
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "mon-error").is_displayed())
        assert "401" in browser.find_element(By.ID, "mon-error").text
        # The key typed into Settings is kept and sent: the monitor and the chat work.
        browser.find_element(By.ID, "tab-chat").click()
        browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
        key = browser.find_element(By.ID, "set-api-key")
        key.send_keys("sesame")
        browser.find_element(By.ID, "set-system").click()  # leaving the field saves it
        assert json.loads(browser.execute_script("return localStorage.getItem('strata.settings')"))["api_key"] == "sesame"
        browser.find_element(By.ID, "tab-monitor").click()
        WebDriverWait(browser, 10).until(lambda d: not d.find_element(By.ID, "mon-error").is_displayed())
        browser.find_element(By.ID, "tab-chat").click()
        send(browser, "import sys")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "send").is_displayed()
                                         and len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2)
        last = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
        assert "error" not in last.get_attribute("class"), last.text

"""The web console (`GET /` in a browser) in a real headless browser: Debian's chromium
driven by Selenium through Debian's chromedriver (both installed by scripts/test; no
browser download). Signs in (a bad key first), creates a session, runs code and sees
its streamed output, values and rich outputs, sees the tree grow, opens a node's
variables and files, uploads and downloads a file, forks from a node and runs in the
fork, reverts, runs alternatives, and checks the phone-sized layout and that the page
asked nothing of any other origin. A screenshot of each step goes to
target/console-screenshots/. Fails (never skips) without chromium or chromedriver."""

import base64
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO

SHOTS = REPO / "target" / "console-screenshots"
# A 2x2 red PNG.
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000002000000020802000000fdd49a73"
    "0000001649444154789c63f8cfc0c0f09f8181e13f0303c37f00003dd205fb4b5d5c"
    "ab0000000049454e44ae426082")).decode()


def browser_paths() -> tuple[str, str]:
    chromium = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "") if p and os.access(p, os.X_OK)), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.access("/usr/bin/chromedriver", os.X_OK) else None)
    if not chromium or not driver:
        pytest.fail("the console test needs Debian's chromium and chromium-driver "
                    "(scripts/test installs them: apt-get install chromium chromium-driver); it is never skipped")
    return chromium, driver


@pytest.fixture
def browser(tmp_path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing from the test venv (tests/python/requirements.txt; scripts/test installs it)")
    chromium, driver = browser_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,800",
              "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-sync",
              "--disable-component-update", "--disable-default-apps", "--metrics-recording-only", "--no-default-browser-check"):
        opts.add_argument(a)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False})
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
    d.downloads = downloads
    d.set_window_size(1280, 800)
    yield d
    d.quit()


class Steps:
    """Screenshots numbered in order, and waits that say what they waited for."""

    def __init__(self, driver):
        self.d = driver
        self.n = 0
        SHOTS.mkdir(parents=True, exist_ok=True)
        for old in SHOTS.glob("*.png"):
            old.unlink()

    def shot(self, name: str):
        self.n += 1
        path = SHOTS / f"{self.n:02d}-{name}.png"
        assert self.d.save_screenshot(str(path)), path
        assert path.stat().st_size > 1000

    def wait(self, what: str, cond, timeout: float = 15):
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            try:
                v = cond()
                if v:
                    return v
            except Exception as e:  # noqa: BLE001 - retried until the deadline
                last = e
            time.sleep(0.05)
        logs = [e["message"] for e in self.d.get_log("browser")]
        raise AssertionError(f"timed out waiting for {what} (last error: {last!r}); browser log: {logs}")


def test_console_in_a_headless_browser(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d, s = browser, Steps(browser)
    css = lambda q: d.find_elements(By.CSS_SELECTOR, q)  # noqa: E731
    one = lambda q: d.find_element(By.CSS_SELECTOR, q)  # noqa: E731
    nodes = lambda: [int(e.get_attribute("data-checkpoint")) for e in css("#tree g.node[data-checkpoint]")]  # noqa: E731
    entries = lambda: css("#transcript .entry")  # noqa: E731

    def run(code: str, keys=(Keys.SHIFT, Keys.ENTER)):
        before = len(entries())
        box = one("#code")
        box.clear()
        box.send_keys(code)
        box.send_keys(*keys)
        s.wait(f"the result of {code!r}", lambda: len(entries()) > before and entries()[-1].get_attribute("data-state") in ("done", "exception", "failed"))
        return entries()[-1]

    # The page: the API's JSON stays for API clients, the console for browsers, with a strict CSP.
    r = httpx.get(server.url + "/")
    assert r.headers["content-type"].startswith("application/json") and r.json()["openapi"] == "/v1/openapi.json"
    assert r.json()["console"] == "/"
    page = httpx.get(server.url + "/", headers={"Accept": "text/html,*/*;q=0.8"})
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert httpx.get(server.url + "/console/console.js").headers["content-security-policy"] == csp
    assert httpx.get(server.url + "/console/nope.js").status_code == 404

    d.get(server.url + "/")
    assert d.title == "forkbox console"
    s.wait("the sign-in form", lambda: one("#apikey").is_displayed())
    s.shot("sign-in")

    # A bad key: a clear message, still signed out.
    one("#apikey").send_keys("fbk_" + "0" * 32)
    one("#signin-button").click()
    msg = s.wait("the sign-in error", lambda: one("#signin-error").text)
    assert "Sign-in failed" in msg and "does not accept that API key" in msg, msg
    assert not one("#app-view").is_displayed()
    assert d.execute_script("return sessionStorage.getItem('forkbox.apiKey')") is None
    s.shot("bad-key")
    one("#apikey").clear()
    one("#apikey").send_keys("not a key", Keys.ENTER)
    s.wait("the malformed-key message", lambda: "printable ASCII" in one("#signin-error").text)

    # The real key: kept in session storage only.
    one("#apikey").clear()
    one("#apikey").send_keys(server.key, Keys.ENTER)
    s.wait("the console", lambda: one("#app-view").is_displayed())
    assert d.execute_script("return sessionStorage.getItem('forkbox.apiKey')") == server.key
    assert d.execute_script("return localStorage.length") == 0
    s.shot("signed-in")

    # A new session, opened.
    one("#new-session").click()
    sid = s.wait("the new session", lambda: one("#current-session").text)
    assert sid.startswith("s") or len(sid) > 8, sid
    assert css(f'#session-list li.current button[data-session="{sid}"]')
    assert nodes() == []
    s.shot("new-session")

    # Code: streamed stdout and stderr, guest text shown as text, never as markup.
    e = run('x = 41\nprint("hello", x)\nimport sys; print("<b id=pwn>oops</b>", file=sys.stderr)')
    assert e.find_element(By.CSS_SELECTOR, "pre.stdout").text == "hello 41"
    assert e.find_element(By.CSS_SELECTOR, "pre.stderr").text == "<b id=pwn>oops</b>"
    assert not css("#pwn") and not css("#transcript b")
    c1 = int(e.get_attribute("data-checkpoint"))
    assert e.find_element(By.CSS_SELECTOR, "pre.in").get_attribute("data-prompt") == f"[{c1}]"
    s.wait("the tree's first node", lambda: nodes() == [c1])
    s.shot("first-exec")

    # A value (Ctrl+Enter runs too), and the tree grows.
    e = run("x + 1", keys=(Keys.CONTROL, Keys.ENTER))
    assert e.find_element(By.CSS_SELECTOR, "pre.value").text == "42"
    c2 = int(e.get_attribute("data-checkpoint"))
    s.wait("two nodes", lambda: nodes() == [c1, c2])
    assert css(f'#tree g.node.head[data-checkpoint="{c2}"]')

    # An exception, and rich outputs: an HTML table in a sandboxed frame (its script does not run, its
    # image on another origin, a listener of this test, is never fetched), an image.
    e = run("1/0")
    assert "ZeroDivisionError" in e.find_element(By.CSS_SELECTOR, "pre.exc").text
    spy = socket.socket()
    spy.bind(("127.0.0.1", 0))
    spy.listen(8)
    spy.settimeout(0.2)
    hits = []

    def watch():
        while not stop.is_set():
            try:
                c, _ = spy.accept()
                hits.append(c.recv(200))
                c.close()
            except OSError:
                pass

    stop = threading.Event()
    threading.Thread(target=watch, daemon=True).start()
    spy_url = f"http://127.0.0.1:{spy.getsockname()[1]}"
    html = (f"<table><tr><td id=cell>cell 7</td></tr></table><script>parent.document.title='pwned'</script>"
            f"<img src={spy_url}/x.png><link rel=stylesheet href={spy_url}/x.css>")
    e = run(f"display({{'text/html': {html!r}}}, raw=True)\ndisplay({{'image/png': {PNG!r}}}, raw=True)")
    frame = e.find_element(By.CSS_SELECTOR, "iframe.rich")
    assert frame.get_attribute("sandbox") == "" and "cell 7" in frame.get_attribute("srcdoc")
    img = e.find_element(By.CSS_SELECTOR, "img.rich")
    assert img.get_attribute("src").startswith("data:image/png;base64,")
    s.wait("the image to load", lambda: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 2)
    d.switch_to.frame(frame)
    assert s.wait("the table in the frame", lambda: d.find_element(By.ID, "cell").text) == "cell 7"
    d.switch_to.default_content()
    time.sleep(0.5)
    assert d.title == "forkbox console"
    stop.set()
    spy.close()
    assert hits == [], f"the guest's HTML made the browser fetch from another origin: {hits}"
    s.shot("rich-outputs")

    # A file: uploaded (a checkpoint), listed, downloaded.
    one("#files-box summary").click()
    src = d.downloads.parent / "notes.txt"
    src.write_text("a,b\n1,2\n")
    one("#upload-input").send_keys(str(src))
    one("#upload").click()
    s.wait("the upload", lambda: "Uploaded /data/notes.txt" in one("#status").text)
    s.wait("the upload's node", lambda: len(nodes()) == 5)
    c_up = max(nodes())
    one("#list-files").click()
    item = s.wait("the file list", lambda: [b for b in css("#file-list button") if b.get_attribute("aria-label") == "Download /data/notes.txt"])
    item[0].click()
    got = d.downloads / "notes.txt"
    s.wait("the download", lambda: got.exists() and got.read_text() == "a,b\n1,2\n")
    s.shot("files")

    # Click a node: its code, result, variables; and the head node's files.
    one(f'#tree g.node[data-checkpoint="{c_up}"]').click()
    s.wait("the upload node's files", lambda: "/data/notes.txt" in one("#node-files").text)
    one(f'#tree g.node[data-checkpoint="{c1}"]').click()
    s.wait("the variables of the first node", lambda: css('#node-vars-table tr[data-name="x"]'))
    row = one('#node-vars-table tr[data-name="x"]').text
    assert "int" in row and "41" in row, row
    assert one("#node-code").text.startswith("x = 41")
    assert one(f'#tree g.node.selected[data-checkpoint="{c1}"]')
    s.shot("node-variables")

    # Keyboard: the focused node moves with the arrows, Enter opens it.
    assert d.switch_to.active_element.get_attribute("data-checkpoint") == str(c1)
    d.switch_to.active_element.send_keys(Keys.ARROW_RIGHT)
    assert d.switch_to.active_element.get_attribute("data-checkpoint") == str(c2)
    d.switch_to.active_element.send_keys(Keys.ARROW_LEFT)
    d.switch_to.active_element.send_keys(Keys.ENTER)
    assert d.switch_to.active_element.get_attribute("data-checkpoint") == str(c1)

    # Diff against the head, and alternatives from here.
    one("#diff-head").click()
    diff = s.wait("the diff", lambda: one("#diff-list").text)
    assert "/data/notes.txt" in diff and f"#{c2}" in diff, diff
    one("#explore-toggle").click()
    one("#explore-codes").send_keys("x * 2\n---\nprint('alt')\nx * 3")
    one("#explore-run").click()
    s.wait("the alternatives", lambda: len(css("#explore-table tbody tr")) == 2)
    cells = [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in css("#explore-table tbody tr")]
    assert cells[0][2] == "82" and cells[1][2] == "123" and cells[1][3] == "alt", cells
    s.shot("diff-and-alternatives")

    # Fork at the first node: the console opens the fork; it runs there, from x = 41.
    one("#fork-here").click()
    fork = s.wait("the fork", lambda: one("#current-session").text != sid and one("#current-session").text)
    assert css(f'#session-list button[data-session="{fork}"]') and css(f'#session-list button[data-session="{sid}"]')
    e = run("x * 100")
    assert e.find_element(By.CSS_SELECTOR, "pre.value").text == "4100"
    c_fork = int(e.get_attribute("data-checkpoint"))
    assert c_fork > c_up  # one numbering for the tree
    s.wait("the fork's node", lambda: c_fork in nodes() and css(f'#tree g.node.head[data-checkpoint="{c_fork}"]'))
    # The source's head is still marked, as another session's.
    assert css(f'#tree g.node.other-head[data-checkpoint="{c_up}"]')
    s.shot("fork")

    # Revert the fork to the first node: the head moves there; the next exec branches from it.
    one(f'#tree g.node[data-checkpoint="{c1}"]').click()
    one("#revert-here").click()
    s.wait("the head at the first node", lambda: css(f'#tree g.node.head[data-checkpoint="{c1}"]'))
    s.wait("the details to say so", lambda: "(this session's head)" in one("#node-title").text)
    e = run("x")
    assert e.find_element(By.CSS_SELECTOR, "pre.value").text == "41"
    c_rev = int(e.get_attribute("data-checkpoint"))
    tree = httpx.get(f"{server.url}/v1/sessions/{fork}/tree", headers=server.headers()).json()
    assert {n["checkpoint"]: n["parent"] for n in tree["nodes"]}[c_rev] == c1
    s.wait("the reverted branch's node", lambda: c_rev in nodes())
    s.wait("the details to follow the head", lambda: "(this session's head)" not in one("#node-title").text)
    s.shot("revert")

    # Switching back to the first session keeps its transcript.
    one(f'#session-list button[data-session="{sid}"]').click()
    s.wait("the first session", lambda: one("#current-session").text == sid)
    assert "hello 41" in one("#transcript").text
    # Its head, far right in the tree, is scrolled into the tree's view.
    s.wait("the head in view", lambda: d.execute_script(
        "const w = document.getElementById('tree-wrap').getBoundingClientRect();"
        f"const n = document.querySelector('#tree g.node.head[data-checkpoint=\"{c_up}\"]').getBoundingClientRect();"
        "return n.left >= w.left - 1 && n.right <= w.right + 1 && n.top >= w.top - 1 && n.bottom <= w.bottom + 1;"))

    # Output streams while the code runs; Interrupt stops it with a KeyboardInterrupt, the session keeps going.
    before = len(entries())
    one("#code").send_keys("import time\nfor i in range(400):\n    print('tick', i)\n    time.sleep(0.05)", Keys.SHIFT, Keys.ENTER)
    s.wait("streamed output while running", lambda: len(entries()) > before and "tick 3" in entries()[-1].text
           and entries()[-1].get_attribute("data-state") == "running")
    s.shot("streaming")
    one("#interrupt").click()
    s.wait("the interrupted exec", lambda: entries()[-1].get_attribute("data-state") == "exception")
    assert "KeyboardInterrupt" in entries()[-1].find_element(By.CSS_SELECTOR, "pre.exc").text
    assert run("x").find_element(By.CSS_SELECTOR, "pre.value").text == "41"

    # A phone-sized viewport: one column, nothing wider than the screen.
    d.set_window_size(390, 844)
    time.sleep(0.3)
    s.shot("phone")
    overflow = d.execute_script("return document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 1, f"the page is {overflow}px wider than a phone's viewport"
    panes = [one(q).rect for q in ("#sessions-pane", "#repl-pane", "#tree-pane")]
    assert panes[0]["y"] < panes[1]["y"] < panes[2]["y"], panes
    d.set_window_size(1280, 800)

    # Signing out forgets the key.
    one("#signout").click()
    s.wait("the sign-in form again", lambda: one("#apikey").is_displayed())
    assert d.execute_script("return sessionStorage.getItem('forkbox.apiKey')") is None

    # Nothing but this server was asked for anything (the guest's <img> in the frame included).
    urls = []
    for entry in d.get_log("performance"):
        m = json.loads(entry["message"])["message"]
        if m["method"] == "Network.requestWillBeSent":
            urls.append(m["params"]["request"]["url"])
    assert any(u.startswith(server.url + "/v1/sessions") for u in urls), urls
    foreign = [u for u in urls if not (u.startswith(server.url + "/") or u.startswith(("data:", "blob:", "about:")))]
    assert foreign == [], foreign
    # No CSP violation or script error in the console itself.
    # (The bad key's 401 is logged as a failed load, and the guest's <img> as refused by the CSP.)
    errors = [e["message"] for e in d.get_log("browser")
              if e["level"] == "SEVERE" and spy_url not in e["message"] and "status of 401" not in e["message"]]
    assert errors == [], errors


# A line chart drawn in the guest with numpy and written as a PNG (zlib), shown with `display` as an
# `image/png` bundle: the path a matplotlib figure takes (the default template has numpy, not matplotlib).
CHART = '''import numpy as np, zlib, struct, base64
W, H = 120, 80
img = np.full((H, W, 3), 255, np.uint8)
xs = np.arange(W)
ys = (H / 2 - (H / 3) * np.sin(xs / 12)).astype(int)
img[ys, xs] = (31, 119, 180)
img[ys + 1, xs] = (31, 119, 180)
raw = b''.join(b'\\x00' + img[r].tobytes() for r in range(H))
def chunk(t, d):
    return struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t + d) & 0xffffffff)
png = b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', W, H, 8, 2, 0, 0, 0)) + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b'')
display({'image/png': base64.b64encode(png).decode()}, raw=True)
'chart drawn\''''


def test_console_shows_a_sessions_history(server, browser):
    """A session made through the API (a chart among its calls) opened in the console: the REPL shows
    each call's code and output, the chart as an image; a node's panel shows its call's full output;
    modules are hidden among the variables; the list shows the session's tags and last line of code;
    after a revert (and a reload of the page) the REPL shows the history of the reverted-to path."""
    from selenium.webdriver.common.by import By

    d, s = browser, Steps(browser)
    css = lambda q: d.find_elements(By.CSS_SELECTOR, q)  # noqa: E731
    one = lambda q: d.find_element(By.CSS_SELECTOR, q)  # noqa: E731
    past = lambda: css("#transcript .entry.past")  # noqa: E731
    h = server.headers()

    r = httpx.post(f"{server.url}/v1/sessions", headers=h, json={"tags": {"project": "charts"}}, timeout=60)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]

    def ex(code):
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", headers=h, json={"code": code}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    c1 = ex("import json, zlib\nx = 41\nprint('hello', x)")["checkpoint"]
    chart = ex(CHART)
    assert chart["display"][0]["image/png"] and chart["value"] == "'chart drawn'", chart
    c2 = chart["checkpoint"]
    c3 = ex("y = x + 1\ny")["checkpoint"]

    d.get(server.url + "/")
    s.wait("the sign-in form", lambda: one("#apikey").is_displayed())
    one("#apikey").send_keys(server.key)
    one("#signin-button").click()
    s.wait("the console", lambda: one("#app-view").is_displayed())

    # The list: the session's tags and its last line of code.
    item = s.wait("the session in the list", lambda: css(f'#session-list button[data-session="{sid}"]'))[0]
    assert "project=charts" in item.find_element(By.CSS_SELECTOR, ".meta.tags").text
    assert item.find_element(By.CSS_SELECTOR, ".meta.last-code").text == "y"
    # The templates of new sessions.
    assert css('#new-template option[value="python"]')

    # Opened: the REPL shows the three calls, their output and the chart.
    item.click()
    s.wait("the history", lambda: [int(e.get_attribute("data-checkpoint")) for e in past()] == [c1, c2, c3])
    e1, e2, e3 = past()
    assert e1.find_element(By.CSS_SELECTOR, "pre.in").text.startswith("import json, zlib")
    assert e1.find_element(By.CSS_SELECTOR, "pre.in").get_attribute("data-prompt") == f"[{c1}]"
    assert e1.find_element(By.CSS_SELECTOR, "pre.stdout").text == "hello 41"
    assert "display({'image/png'" in e2.find_element(By.CSS_SELECTOR, "pre.in").text
    img = e2.find_element(By.CSS_SELECTOR, "img.rich")
    assert img.get_attribute("src") == "data:image/png;base64," + chart["display"][0]["image/png"]
    s.wait("the chart to load", lambda: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 120)
    assert e2.find_element(By.CSS_SELECTOR, "pre.value").text == "'chart drawn'"
    assert e3.find_element(By.CSS_SELECTOR, "pre.value").text == "42"
    s.shot("history")

    # A node's panel: the full output of its call; the variables without the modules, unless asked.
    one(f'#tree g.node[data-checkpoint="{c2}"]').click()
    out_img = s.wait("the chart in the node's output", lambda: css("#node-output img.rich"))[0]
    assert out_img.get_attribute("src") == img.get_attribute("src")
    assert one("#node-output pre.value").text == "'chart drawn'"
    one(f'#tree g.node[data-checkpoint="{c1}"]').click()
    s.wait("the first node's output", lambda: one("#node-output pre.stdout").text == "hello 41")
    s.wait("the variables", lambda: css('#node-vars-table tr[data-name="x"]'))
    assert not css('#node-vars-table tr[data-name="json"]') and not css('#node-vars-table tr[data-name="zlib"]')
    hidden = int(one("#modules-hidden").text.split()[0])  # json, zlib and the template's numpy
    assert hidden >= 2, one("#modules-hidden").text
    one("#show-modules").click()
    s.wait("the modules", lambda: css('#node-vars-table tr[data-name="json"]') and css('#node-vars-table tr[data-name="zlib"]'))
    modules = [r for r in css("#node-vars-table tbody tr") if r.find_elements(By.TAG_NAME, "td")[1].text == "module"]
    assert len(modules) == hidden and not css("#modules-hidden")
    s.shot("node-output")

    # Revert to the first node: the REPL shows the path to it (the chart is gone), also after a reload.
    one("#revert-here").click()
    s.wait("the reverted history", lambda: [int(e.get_attribute("data-checkpoint")) for e in past()] == [c1])
    assert not css("#transcript img.rich")
    assert "reverted to checkpoint" in one("#transcript").text
    d.refresh()
    s.wait("the console again", lambda: one("#app-view").is_displayed())
    s.wait("the session in the list", lambda: css(f'#session-list button[data-session="{sid}"]'))[0].click()
    s.wait("the history after a reload", lambda: [int(e.get_attribute("data-checkpoint")) for e in past()] == [c1])
    assert past()[0].find_element(By.CSS_SELECTOR, "pre.stdout").text == "hello 41"
    assert one(f'#session-list button[data-session="{sid}"] .meta.last-code').text == "print('hello', x)"
    s.shot("history-after-revert")

    errors = [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


SITE_SERVER = """
import http.server, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ('served from the sandbox: ' + self.path).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'text/plain')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(('127.0.0.1', 8000), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
"""


def test_console_shows_running_processes_and_opens_ports(server, browser):
    """A session with a background command and a server (made through the API): the console's
    "Processes and ports" panel lists the process (its output, a Stop button that ends it) and the
    listening port, whose Open link (a signed URL, no key in the page's request) reaches the server."""
    from selenium.webdriver.common.by import By

    d, s = browser, Steps(browser)
    css = lambda q: d.find_elements(By.CSS_SELECTOR, q)  # noqa: E731
    one = lambda q: d.find_element(By.CSS_SELECTOR, q)  # noqa: E731
    h = server.headers()
    r = httpx.post(f"{server.url}/v1/sessions", headers=h, json={}, timeout=60)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", headers=h, json={"code": SITE_SERVER}, timeout=120)
    assert r.status_code == 200 and r.json().get("error") is None, r.text
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/commands", headers=h, timeout=120,
                   json={"cmd": "while true; do echo tick; sleep 0.2; done", "background": True})
    assert r.status_code == 201, r.text
    pid = r.json()["pid"]

    d.get(server.url + "/")
    s.wait("the sign-in form", lambda: one("#apikey").is_displayed())
    one("#apikey").send_keys(server.key)
    one("#signin-button").click()
    item = s.wait("the session in the list", lambda: css(f'#session-list button[data-session="{sid}"]'))[0]
    # A command's call shows as its label line, not the helper program that ran it.
    label = "# command (background): while true; do echo tick; sleep 0.2; done"
    assert item.find_element(By.CSS_SELECTOR, ".meta.last-code").text == label[:59] + "…"  # the list cuts at 60
    item.click()
    entry = s.wait("the history", lambda: css("#transcript .entry.past"))[-1]
    assert entry.find_element(By.CSS_SELECTOR, "pre.in").text == label
    one("#running-box summary").click()
    row = s.wait("the process", lambda: css(f'#process-list li[data-pid="{pid}"]'))[0]
    assert "running" in row.text and "sleep" in row.text, row.text
    port = s.wait("the port", lambda: css('#port-list li[data-port="8000"]'))[0]
    assert "127.0.0.1" in port.text
    s.shot("processes-and-ports")

    # Its output.
    row.find_element(By.XPATH, ".//button[text()='Output']").click()
    s.wait("the process' output", lambda: one("#process-output").is_displayed() and "tick" in one("#process-output").text)

    # The port's link: a signed URL of this origin that reaches the server in the sandbox.
    port.find_element(By.XPATH, ".//button[text()='Open']").click()
    link = s.wait("the port's link", lambda: css('#port-list li[data-port="8000"] a'))[0]
    href = link.get_attribute("href")
    assert href.startswith(f"{server.url}/v1/sessions/{sid}/ports/8000/?fbx_token="), href
    assert link.get_attribute("rel") == "noopener noreferrer" and link.get_attribute("target") == "_blank"
    assert server.key not in href
    r = httpx.get(href, timeout=60)
    assert r.status_code == 200 and r.text.startswith("served from the sandbox: /"), r.text

    # Stop ends the process; the panel shows how it ended.
    one(f'#process-list li[data-pid="{pid}"]').find_element(By.XPATH, ".//button[text()='Stop']").click()
    s.wait("the stopped process", lambda: "signal 15" in one(f'#process-list li[data-pid="{pid}"]').text, timeout=30)
    assert not one(f'#process-list li[data-pid="{pid}"]').find_elements(By.XPATH, ".//button[text()='Stop']")
    s.shot("process-stopped")

    errors = [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

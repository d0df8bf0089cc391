"""The HTML report: self-contained, and checked in a real headless Chromium.

The browser tests drive Chromium through the DevTools protocol with a small
websocket client below (no extra dependencies): they load the page, collect
console errors, exceptions and network requests, count the charts in the DOM,
and decode a screenshot (a small PNG reader, numpy for the pixels) to check
that the charts are drawn where the DOM says they are.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.parse
import warnings
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest

from kvtrace.engine import FAULT_WORKLOADS, record_embedded
from kvtrace.findings import Divergence, by_request, headline
from kvtrace.report import html as report_html
from kvtrace.report.html import write_html_report
from kvtrace.report.figures import MAX_RUNS, SERIES_POINTS, step_runs

from tests._paths import REPO
from tests.mini_traces import write_mini_trace

TRACES = REPO / "traces"
FAULTED = TRACES / "faults" / "async-load-overshoot.jsonl.gz"


# --------------------------------------------------------------------------- without a browser


def _no_external_references(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page, re.I)
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page, re.I)
    assert not re.search(r"<script[^>]*\bsrc\b", page, re.I)
    assert "@import" not in page and "url(" not in page


def _report(trace, out, against=None):
    """The report ``kvtrace report`` writes: the command runs the analysis."""
    from kvtrace.commands.report import analysis

    found = analysis(trace, against)
    return write_html_report(trace, out, found.divergences, findings=found.findings, source=found.source,
                             against=against, note=found.note, stop=found.stop,
                             steps_checked=found.steps_checked)


def _runs(steps) -> int:
    """How many runs of consecutive steps there are, counted here."""
    s = sorted(set(steps))
    return sum(1 for i, k in enumerate(s) if i == 0 or s[i - 1] != k - 1)


@pytest.fixture(scope="module")
def overshoot(tmp_path_factory):
    """An embedded trace with the async-load-overshoot fault (divergences in
    several requests, at several runs of steps), and the same run without it."""
    d = tmp_path_factory.mktemp("overshoot")
    fault = "async-load-overshoot"
    bad = record_embedded(d / "bad.jsonl.gz", workload=FAULT_WORKLOADS[fault], fault=fault).path
    good = record_embedded(d / "good.jsonl.gz", workload=FAULT_WORKLOADS[fault]).path
    return Path(bad), Path(good)


def test_report_from_replay(tmp_path):
    out = tmp_path / "r.html"
    rep = _report(FAULTED, out)
    page = out.read_text()
    _no_external_references(page)
    assert rep.source == "replay" and rep.divergences
    assert page.count('<tr class="story"') == len(by_request(rep.divergences))
    first = headline(by_request(rep.divergences))
    assert first.step == 1 and f"<b>step {first.step}</b>" in page
    assert 'class="rec">64<' in page and 'class="exp">40<' in page
    assert page.count('class="req has-div"') == 1
    assert page.count("<svg class=\"chart") == 3 + rep.timelines


def test_report_from_diff(tmp_path):
    out = tmp_path / "d.html"
    rep = _report(TRACES / "faults" / "stale-computed-on-preempt.jsonl.gz", out,
                  against=TRACES / "preemption.jsonl.gz")
    page = out.read_text()
    assert rep.source == "diff" and rep.divergences
    assert "From <code>kvtrace diff</code>" in page
    assert page.count('<tr class="story"') == len(by_request(rep.divergences))
    assert "<th>A</th><th>B</th>" in page


def test_given_divergences_and_request_cap(tmp_path):
    trace = write_mini_trace(tmp_path / "many.jsonl", requests={f"r{i}": 5 for i in range(120)})
    divs = [Divergence(step=1, req="r100", field="num_computed_tokens", recorded=9, expected=5,
                       rule="test")]
    rep = write_html_report(trace, tmp_path / "m.html", divergences=divs, max_requests=10)
    page = (tmp_path / "m.html").read_text()
    assert rep.source == "given" and rep.timelines == 11            # first 10 + the divergent one
    assert 'data-req="r100"' in page and 'data-req="r11"' not in page
    assert "11 of 120 requests drawn" in page


def test_long_trace_is_downsampled(tmp_path):
    from tests.unit.report.test_show import _one_long_request

    trace = _one_long_request(tmp_path / "long.jsonl.gz", decode_steps=6000)
    write_html_report(trace, tmp_path / "l.html", divergences=[])
    page = (tmp_path / "l.html").read_text()
    for d in re.findall(r'<path class="series[^"]*" d="([^"]*)"', page):
        assert d.count("H") <= SERIES_POINTS + 2
    assert len(page) < 2_000_000


def test_unreplayable_trace_still_gets_a_report(tmp_path, monkeypatch):
    from kvtrace.trace.io import TraceError

    def refuse(path, *a, **k):
        raise TraceError(path, 1, "async scheduling is on")
    monkeypatch.setattr("kvtrace.replay.replay_file", refuse)
    rep = _report(TRACES / "connector.jsonl.gz", tmp_path / "n.html")
    assert rep.note and "async scheduling is on" in (tmp_path / "n.html").read_text()


# --------------------------------------------------------------------------- the browser

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--mute-audio"]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        msg = ("SKIPPING BROWSER TESTS: no chromium on PATH. Install Debian's 'chromium' package "
               "(apt-get install -y chromium); CI installs it.")
        if os.environ.get("KVTRACE_REQUIRE_BROWSER") == "1":
            pytest.fail(msg.replace("SKIPPING", "CANNOT RUN") + " KVTRACE_REQUIRE_BROWSER=1 is set.")
        warnings.warn(msg)
        print("\n" + "!" * 80 + "\n" + msg + "\n" + "!" * 80)
        pytest.skip(msg)
    profile = tempfile.mkdtemp(prefix="kvtrace-chromium-")
    proc = subprocess.Popen([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"chromium did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        ws = _WebSocket(f"ws://127.0.0.1:{port}{path}")
        yield _Browser(ws)
        ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


class _WebSocket:
    """Just enough of RFC 6455 for the DevTools protocol: text frames, client masking."""

    def __init__(self, url: str):
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
                           "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buf = bytearray()
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        assert b" 101 " in head.split(b"\r\n")[0], head
        self.buf = bytearray(rest)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise EOFError("the browser closed the connection")
        self.buf += chunk

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        n = len(data)
        head = bytearray([0x81])
        if n < 126:
            head.append(0x80 | n)
        elif n < 1 << 16:
            head.append(0x80 | 126)
            head += struct.pack(">H", n)
        else:
            head.append(0x80 | 127)
            head += struct.pack(">Q", n)
        mask = os.urandom(4)
        arr = np.frombuffer(data, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)
        self.sock.sendall(bytes(head) + mask + arr.tobytes())

    def recv(self) -> dict:
        msg = b""
        while True:
            b0, b1 = self._take(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._take(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._take(8))[0]
            mask = self._take(4) if b1 & 0x80 else None
            payload = self._take(n)
            if mask:
                payload = (np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
            op = b0 & 0x0F
            if op == 8:
                raise EOFError("the browser closed the connection")
            if op in (9, 10):
                continue
            msg += payload
            if b0 & 0x80:
                return json.loads(msg)

    def close(self) -> None:
        self.sock.close()


class _Browser:
    def __init__(self, ws: _WebSocket):
        self.ws = ws
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(msg)
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.ws.recv()
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self.events.append(m)
        raise TimeoutError(method)

    def wait_for(self, method: str, session: str, timeout: float = 60) -> dict:
        for m in self.events:
            if m.get("method") == method and m.get("sessionId") == session:
                return m
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.ws.recv()
            self.events.append(m)
            if m.get("method") == method and m.get("sessionId") == session:
                return m
        raise TimeoutError(method)

    def open(self, url: str, width: int = 1280, height: int = 1600):
        """A new tab showing ``url``; returns its session id and the page's problems."""
        self.events.clear()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=sid)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1, "mobile": False},
                  session=sid)
        self.call("Page.navigate", {"url": url}, session=sid)
        self.wait_for("Page.loadEventFired", sid)
        self.evaluate(sid, "new Promise(r => requestAnimationFrame(() => setTimeout(r, 200)))")
        return sid

    def problems(self, sid: str) -> list[str]:
        out = []
        for m in self.events:
            if m.get("sessionId") != sid:
                continue
            meth, p = m.get("method"), m.get("params", {})
            if meth == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')}")
            elif meth == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif meth == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif meth == "Network.loadingFailed":
                out.append(f"failed request: {p.get('errorText')}")
            elif meth == "Network.requestWillBeSent":
                url = p["request"]["url"]
                if not url.startswith(("file:", "data:", "about:")):
                    out.append(f"network request: {url}")
        return out

    def evaluate(self, sid: str, expr: str):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                           "awaitPromise": True}, session=sid)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"])
        return r["result"].get("value")

    def screenshot(self, sid: str) -> np.ndarray:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=sid)["data"]
        return decode_png(base64.b64decode(data))


def decode_png(data: bytes) -> np.ndarray:
    """8-bit RGB or RGBA, non-interlaced PNG → array of shape (height, width, channels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, ihdr
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.uint8)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:
            cur = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif f == 2:
            cur = (line + prev) % 256
        else:
            cur = np.zeros(w * bpp, np.int32)
            up = prev.astype(np.int32)
            for i in range(w * bpp):
                a = int(cur[i - bpp]) if i >= bpp else 0
                b = int(up[i])
                if f == 3:
                    cur[i] = (line[i] + (a + b) // 2) % 256
                else:
                    c = int(up[i - bpp]) if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                    cur[i] = (line[i] + pred) % 256
        out[y] = cur.astype(np.uint8)
        prev = out[y]
    return out.reshape(h, w, bpp)[:, :, :3]


def _hex(c: str) -> np.ndarray:
    return np.array([int(c[i:i + 2], 16) for i in (1, 3, 5)])


def _share_near(img: np.ndarray, color: np.ndarray, tol: int = 24) -> float:
    return float((np.abs(img.astype(int) - color).max(axis=2) <= tol).mean())


def _blend(c: str, alpha: float) -> np.ndarray:
    return np.round(255 - (255 - _hex(c)) * alpha).astype(int)


@pytest.mark.browser
def test_page_loads_cleanly_and_draws_its_charts(browser, tmp_path):
    out = tmp_path / "report.html"
    rep = _report(FAULTED, out)
    sid = browser.open(out.as_uri())
    assert browser.problems(sid) == []
    dom = browser.evaluate(sid, """(() => {
        const box = el => { const r = el.getBoundingClientRect();
                            return [r.left, r.top, r.width, r.height]; };
        return {
          title: document.title,
          charts: document.querySelectorAll('svg.chart').length,
          series: document.querySelectorAll('svg.chart path.series').length,
          kv: box(document.querySelector('svg.kv-chart')),
          req: box(document.querySelector('.req.has-div svg.chart')),
          rows: document.querySelectorAll('tr.story').length,
          dots: document.querySelectorAll('.req svg g.div-dot').length,
          resources: performance.getEntriesByType('resource').length,
        }; })()""")
    assert dom["title"] == "kvtrace report: async-load-overshoot.jsonl.gz"
    assert dom["charts"] == 3 + rep.timelines
    assert dom["series"] >= 3 + 4 * rep.timelines - 2
    assert dom["rows"] == len(rep.per_request)
    token_divs = {(d.step, d.recorded, d.expected) for d in rep.divergences
                  if d.field in ("num_computed_tokens", "state.num_computed_tokens")}
    assert dom["dots"] == 2 * len(token_divs) > 0
    assert dom["resources"] == 0
    kx, ky, kw, kh = dom["kv"]
    assert kw > 600 and kh > 150 and ky + kh < 1600        # the KV chart is in the first screen

    img = browser.screenshot(sid)
    assert img.shape == (1600, 1280, 3)
    assert img.std() > 10                                   # not blank
    kv = img[int(ky):int(ky + kh), int(kx):int(kx + kw)]
    assert _share_near(kv, _blend(report_html.C_KV, 0.55)) > 0.05    # the area fill
    assert _share_near(kv, _hex(report_html.C_FIRST), 30) > 0.001     # the first divergence
    assert _share_near(kv, _hex(report_html.C_DIVERGENCE), 30) < 0.001  # no opaque red lines
    above = img[: max(1, int(ky) - 40)]
    assert _share_near(above, _blend(report_html.C_KV, 0.55), 8) < 0.01  # no chart above it

    # The request chart, further down: scroll it into view and look at it.
    browser.evaluate(sid, "document.querySelector('.req.has-div svg.chart').scrollIntoView(); 0")
    browser.evaluate(sid, "new Promise(r => requestAnimationFrame(() => setTimeout(r, 100)))")
    rx, ry, rw, rh = browser.evaluate(sid, """(() => { const r = document.querySelector(
        '.req.has-div svg.chart').getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })()""")
    img = browser.screenshot(sid)
    chart = img[int(max(0, ry)):int(ry + rh), int(rx):int(rx + rw)]
    assert chart.size and _share_near(chart, _hex(report_html.C_COMPUTED), 30) > 0.001
    assert _share_near(chart, _hex(report_html.C_DIVERGENCE), 30) > 0.0001   # the recorded dot
    assert browser.problems(sid) == []


@pytest.mark.browser
def test_request_filter_works(browser, tmp_path):
    out = tmp_path / "report.html"
    write_html_report(TRACES / "connector.jsonl.gz", out, divergences=[
        Divergence(step=3, req="4-99d0dc83", field="block_ids", recorded=[1], expected=[2], rule="t")])
    sid = browser.open(out.as_uri())
    visible = ("Array.from(document.querySelectorAll('.req'))"
               ".filter(c => !c.classList.contains('hidden')).length")
    assert browser.evaluate(sid, visible) == 7
    browser.evaluate(sid, """(() => { const f = document.getElementById('req-filter');
        f.value = '2-a16'; f.dispatchEvent(new Event('input')); })()""")
    assert browser.evaluate(sid, visible) == 1
    browser.evaluate(sid, """(() => { const f = document.getElementById('req-filter');
        f.value = ''; f.dispatchEvent(new Event('input'));
        const o = document.getElementById('only-div'); o.checked = true;
        o.dispatchEvent(new Event('change')); })()""")
    assert browser.evaluate(sid, visible) == 1
    assert browser.problems(sid) == []


@pytest.mark.browser
def test_page_offline_with_no_network_access(browser, tmp_path):
    """Even with the network switched off the page loads without a failed request."""
    out = tmp_path / "report.html"
    write_html_report(TRACES / "preemption.jsonl.gz", out, divergences=[])
    sid = browser.open("about:blank")
    browser.call("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                                                      "downloadThroughput": -1,
                                                      "uploadThroughput": -1}, session=sid)
    browser.events.clear()
    browser.call("Page.navigate", {"url": out.as_uri()}, session=sid)
    browser.wait_for("Page.loadEventFired", sid)
    assert browser.evaluate(sid, "document.querySelectorAll('svg.chart').length") == 3 + 8
    assert browser.problems(sid) == []


# --------------------------------------------------------------------------- reading the report


def test_step_runs_merge_adjacent_steps_and_stay_bounded():
    assert step_runs([5, 3, 4, 9, 11, 12, 3]) == [(3, 5), (9, 9), (11, 12)]
    many = list(range(0, 20000, 2))            # 10000 runs of one step
    runs = step_runs(many, max_runs=50)
    assert 0 < len(runs) <= 50
    covered = {k for a, b in runs for k in range(a, b + 1)}
    assert set(many) <= covered                  # merging never drops a step


def test_kv_content_text_is_never_cut(tmp_path):
    text = ("block 3 slot 5 (position 37): written by doc-0 at step 0 (its position 21); "
            "3 of 40 positions read are wrong; " * 4).strip()
    divs = [Divergence(step=2, req="4-99d0dc83", field="num_computed_tokens", recorded=9, expected=5,
                       rule="1.3: admission sets num_computed_tokens"),
            Divergence(step=3, req="4-99d0dc83", field="kv-content", recorded=text,
                       expected="prefix of 4-99d0dc83 up to position 37", rule="kv-content: reads",
                       kind="kv-content")]
    write_html_report(TRACES / "connector.jsonl.gz", tmp_path / "k.html", divs)
    page = (tmp_path / "k.html").read_text()
    assert len(text) > 300 and text in page


def test_why_is_shown_under_the_cause(tmp_path):
    d = Divergence(step=2, req="4-99d0dc83", field="num_computed_tokens", recorded=9, expected=5,
                   rule="1.3: admission sets num_computed_tokens")
    d.why = "5 = local prefix hit 0 + external hit 5 (lookup at step 1)"
    write_html_report(TRACES / "connector.jsonl.gz", tmp_path / "w.html", [d])
    # as the terminal says it: the expected value, then its terms; headline and table
    assert (tmp_path / "w.html").read_text().count(f"expected {d.why}") == 2


def test_many_diverging_steps_stay_bounded(tmp_path):
    from tests.unit.report.test_show import _one_long_request

    trace = _one_long_request(tmp_path / "long.jsonl.gz", decode_steps=6000)
    divs = [Divergence(step=k, req="a", field="block_ids", recorded=[k], expected=[k + 1], rule="4.5: t",
                       kind="block") for k in range(1, 6000, 2)]
    rep = write_html_report(trace, tmp_path / "l.html", divergences=divs)
    page = (tmp_path / "l.html").read_text()
    kv = re.search(r'<svg class="chart kv-chart".*?<rect class="frame"', page, re.S).group(0)
    assert 0 < kv.count('class="div-band"') <= MAX_RUNS < _runs(d.step for d in divs)
    assert page.count('<tr class="story"') == len(rep.per_request) == 1
    assert len(page) < 2_000_000


@pytest.mark.browser
def test_headline_table_and_bands(browser, tmp_path, overshoot):
    bad, _ = overshoot
    out = tmp_path / "report.html"
    rep = _report(bad, out)
    findings = by_request(rep.divergences)
    first = headline(findings)
    assert len(findings) > 1 and first is not None
    sid = browser.open(out.as_uri(), 1400, 900)
    dom = browser.evaluate(sid, """(() => {
        const t = document.getElementById('to-table'), c = document.getElementById('to-charts');
        const target = document.querySelector(t.getAttribute('href'));
        const row = target.querySelector('tr.story').children;
        const h = document.getElementById('headline').getBoundingClientRect();
        return {
          headline: document.getElementById('headline').textContent,
          top: h.top, target: target.className, step: row[0].textContent, req: row[1].textContent,
          field: row[2].textContent, charts: document.querySelector(c.getAttribute('href')) !== null,
          rows: document.querySelectorAll('tr.story').length,
          folds: document.querySelectorAll('details.folds').length,
          open: document.querySelectorAll('details.folds[open]').length,
          summaries: Array.from(document.querySelectorAll('details.folds > summary')).map(s => s.textContent),
          bands: Array.from(document.querySelectorAll('svg.chart')).filter(
            s => !s.classList.contains('req-chart')).map(s => s.querySelectorAll('rect.div-band').length),
          reqBands: Array.from(document.querySelectorAll('.req')).map(
            c => [c.getAttribute('data-req'), c.querySelectorAll('rect.div-band').length]),
          marks: document.querySelectorAll('svg.kv-chart g.first-mark:not(.light)').length,
        }; })()""")
    assert dom["top"] < 200                                   # at the top of the page
    assert f"step {first.step}" in dom["headline"] and first.req in dom["headline"]
    assert first.field in dom["headline"] and str(first.recorded) in dom["headline"]
    assert first.rule.partition(": ")[2] in dom["headline"]
    assert "story headline" in dom["target"]                  # the link lands on the headline's row
    assert (dom["step"], dom["req"], dom["field"]) == (str(first.step), first.req, first.field)
    assert dom["charts"]
    assert dom["rows"] == len(findings)
    assert dom["folds"] == sum(1 for s in findings if s.folds) > 0 and dom["open"] == 0
    for s, text in zip([s for s in findings if s.folds], dom["summaries"]):
        assert text.startswith(f"+ {s.count - 1} more in {s.req}")
    steps = [d.step for d in rep.divergences if d.step is not None]
    assert _runs(steps) > 1
    assert dom["bands"] == [_runs(steps)] * 3                 # KV, tokens, requests
    for req, n in dom["reqBands"]:
        assert n == _runs(d.step for d in rep.divergences if d.req == req and d.step is not None)
    assert dom["marks"] == 1

    # the chart link zooms every chart onto the headline's step
    browser.evaluate(sid, "document.getElementById('to-charts').click(); 0")
    boxes = browser.evaluate(sid, """Array.from(document.querySelectorAll('svg.chart svg.plot'))
        .map(p => p.getAttribute('viewBox').split(' ').map(Number))""")
    assert len(boxes) == 3 + rep.timelines
    assert all(b[:2] == boxes[0][:2] and b[2] == boxes[0][2] for b in boxes)
    assert boxes[0][0] <= first.step < boxes[0][0] + boxes[0][2] < rep.summary.steps
    assert browser.problems(sid) == []


@pytest.mark.browser
def test_shared_axis_zoom_moves_every_chart(browser, tmp_path, overshoot):
    bad, _ = overshoot
    out = tmp_path / "report.html"
    rep = _report(bad, out)
    sid = browser.open(out.as_uri(), 1400, 900)
    boxes = ("Array.from(document.querySelectorAll('svg.chart svg.plot'))"
             ".map(p => p.getAttribute('viewBox').split(' ').map(Number))")
    n = rep.summary.steps
    assert browser.evaluate(sid, boxes) == [[0, 0, n, b[3]] for b in browser.evaluate(sid, boxes)]
    browser.evaluate(sid, """(() => { const f = document.getElementById('zoom-from');
        f.value = 40; f.dispatchEvent(new Event('input'));
        const t = document.getElementById('zoom-to'); t.value = 90; t.dispatchEvent(new Event('input'));
        })()""")
    got = browser.evaluate(sid, boxes)
    assert len(got) == 3 + rep.timelines and all(b[:3] == [40, 0, 50] for b in got)
    ticks = browser.evaluate(sid, """Array.from(document.querySelectorAll('svg.kv-chart g.xticks text'))
        .map(t => Number(t.textContent))""")
    assert ticks and min(ticks) >= 40 and max(ticks) <= 90

    # drag across the KV chart: from a quarter to half of its plot
    browser.evaluate(sid, "document.getElementById('zoom-reset').click(); "
                          "document.querySelector('svg.kv-chart').scrollIntoView(); 0")
    x, y, w = browser.evaluate(sid, """(() => { const c = document.querySelector('svg.kv-chart'),
        r = c.getBoundingClientRect(), k = r.width / c.viewBox.baseVal.width;
        return [r.left + (+c.dataset.l) * k, r.top + r.height / 2, (+c.dataset.pw) * k]; })()""")
    for kind, at in (("mousePressed", 0.25), ("mouseMoved", 0.4), ("mouseReleased", 0.5)):
        browser.call("Input.dispatchMouseEvent", {"type": kind, "x": x + w * at, "y": y,
                                                  "button": "left", "buttons": 1, "clickCount": 1},
                     session=sid)
    got = browser.evaluate(sid, boxes)
    lo, span = got[0][0], got[0][2]
    assert abs(lo - n * 0.25) <= 2 and abs(lo + span - n * 0.5) <= 2
    assert all(b == got[0][:3] + [b[3]] for b in got)
    assert browser.problems(sid) == []


@pytest.mark.browser
def test_against_shows_both_traces(browser, tmp_path, overshoot):
    bad, good = overshoot
    out = tmp_path / "against.html"
    rep = _report(bad, out, against=good)
    assert rep.source == "diff" and rep.divergences and rep.against is not None
    sid = browser.open(out.as_uri(), 1400, 900)
    dom = browser.evaluate(sid, """(() => ({
        text: document.body.textContent,
        kv: ['A', 'B'].map(t => document.querySelectorAll(
            `.trace-chart[data-trace="${t}"] svg.kv-chart`).length),
        charts: ['A', 'B'].map(t => document.querySelectorAll(
            `.trace-chart[data-trace="${t}"] svg.chart`).length),
        names: Array.from(document.querySelectorAll('table.compare thead .trace-name'))
            .map(n => n.textContent),
        heads: Array.from(document.querySelectorAll('table.divs thead th')).map(h => h.textContent),
        rows: document.querySelectorAll('tr.story').length,
        steps: Array.from(document.querySelectorAll('svg.kv-chart svg.plot'))
            .map(p => p.getAttribute('viewBox')),
        b_reqs: Array.from(document.querySelectorAll('svg.req-chart-b'))
            .map(c => c.closest('.req').dataset.req),
        req_steps: Array.from(document.querySelectorAll('svg.req-chart svg.plot'))
            .map(p => p.getAttribute('viewBox')),
      }))()""")
    # B's chart of each diverging request that B holds too, under A's, on the same axis
    in_b = {r["req"] for r in map(orjson.loads, gzip.open(good).read().splitlines())
            if r["kind"] == "arrival"}
    diverging = {d.req for d in rep.divergences if d.req is not None}
    assert diverging and sorted(dom["b_reqs"]) == sorted(diverging & in_b)
    assert len({(v.split()[0], v.split()[2]) for v in dom["req_steps"]}) == 1   # one axis
    assert dom["names"] == [f"A {bad.name}", f"B {good.name}"]
    assert dom["kv"] == [1, 1] and dom["charts"] == [3, 3]
    assert dom["heads"][3:5] == ["A", "B"]
    assert dom["rows"] == len(by_request(rep.divergences))
    assert len(set(dom["steps"])) == 1                      # one step axis for both
    assert browser.problems(sid) == []

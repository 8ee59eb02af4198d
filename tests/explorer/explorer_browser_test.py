"""The attention explorer's page in a real browser: Debian's Chromium, headless,
driven by Selenium (python3-selenium, chromium-driver at /usr/bin/chromedriver)
against the real attnserve binary (--http_address=127.0.0.1:0, the port read
from its log; bearer tokens on), the page as embedded in the binary.

What the browser shows is checked against attnserve.v1's Attend through gRPC
(the attnserve package) on the same inputs (the seeded random hidden states
fetched through /explorer/api/inputs, or a .npy the test wrote and uploaded):
  - the page loads, asks for the token, and every URL the browser fetched is
    of the page's own origin (the Chrome performance log's
    Network.requestWillBeSent, after every test); the token is in no URL;
  - each view renders (canvas pixels of many colours; the table's rows);
  - hovering cells of one head's large view shows the weight Attend returns for
    that (query, key) at the page's display precision (4 significant digits),
    masked cells (causal, key mask) as masked, labels for positions; the
    view's .npy export holds the same weights;
  - the statistics table shows Attend's head statistics and sorts;
  - head-mask toggles show the output's relative change that two Attend calls
    (without and with that head mask) give;
  - S=4096 renders pooled, a region over limits.max_region_cells is refused
    by the page (no request) with a message, a smaller one is fetched at full
    resolution and its hover matches Attend's row;
  - a file that is not a .npy gets a message naming the file and the problem;
  - the model choice's ad-hoc layer (grouped-query heads, RoPE, seeded
    weights): the server's refusal of a bad head configuration shows in the
    page's error place, a good one renders, its hover and a head's removal
    match Attend with the same LayerSpec;
  - a decode session's view (what its latest token attends to): its hover
    shows the weights the session's last Extend step returned for that
    token, its .npy export holds them, reading does not extend the session,
    and another caller's token gets the server's refusal in the page.

Screenshots of each view go to --screenshots (default: the build folder's
tests/explorer/screenshots; build folders are ignored by git).

The README's picture (docs/images/explorer.png) is regenerated with:
  cmake --build build --target attnserve && /usr/bin/python3 tests/explorer/explorer_browser_test.py \\
    --server build/server/attnserve --proto_dir proto --readme_image docs/images/explorer.png

  explorer_browser_test.py --server <attnserve> --proto_dir <repo>/proto [--screenshots DIR] [--readme_image PNG]
"""
import argparse
import base64
import io
import json
import math
import os
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e"))
import harness  # noqa: E402

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--server", required=True)
PARSER.add_argument("--proto_dir", required=True)
PARSER.add_argument("--screenshots", default=os.path.join(harness.REPO, "build", "tests", "explorer", "screenshots"))
PARSER.add_argument("--readme_image", default="", help="also write the README's picture here")
PARSER.add_argument("--chromedriver", default="/usr/bin/chromedriver")
ARGS, UNITTEST_ARGS = PARSER.parse_known_args()

TOKEN = "explorer-browser-test-4f1e"
OTHER_TOKEN = "explorer-browser-test-other-9c2d"  # a second caller: may not read TOKEN's sessions
WINDOW = (1700, 1150)
LONG_S = 4096  # the long sequence (--max_seq_len)
WAIT = 300  # seconds: an S=4096 request on a busy 2-core machine
WORDS = ("the quick brown fox jumps over the lazy dog while the old cat sleeps on a warm mat "
         "near the red barn at dusk <eos>").split()


def significant_tolerance(expected, digits=4):
    """Half a unit in the last of `digits` significant digits of `expected`,
    plus float32 slack: how far a correctly rounded display may be off."""
    if expected == 0:
        return 1e-12
    return 0.5 * 10 ** (math.floor(math.log10(abs(expected))) - digits + 1) + 1e-5 * abs(expected)


class ExplorerInBrowser(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import attnserve
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        cls.tmp = tempfile.TemporaryDirectory()
        tokens = os.path.join(cls.tmp.name, "tokens")
        with open(tokens, "w") as f:
            f.write(TOKEN + "\n" + OTHER_TOKEN + "\n")
        # No dynamic batching: the page's requests and the test's gRPC calls
        # compute the same bits for the same inputs.
        cls.server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", "--max_batch_tokens=0",
                                    f"--max_seq_len={LONG_S}", f"--auth_tokens_file={tokens}")
        cls.server.wait_serving()
        assert cls.server.http_port, "attnserve did not log its HTTP port"
        cls.origin = f"http://127.0.0.1:{cls.server.http_port}"
        cls.client = attnserve.Client(cls.server.target, token=TOKEN, timeout=WAIT)
        answer = cls.api("models")
        cls.model = next(m for m in answer["models"] if m["name"] == "default")
        cls.limits = answer["limits"]
        os.makedirs(ARGS.screenshots, exist_ok=True)

        options = webdriver.ChromeOptions()
        for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1"]:
            options.add_argument(flag)
        options.binary_location = "/usr/bin/chromium"
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
        cls.downloads = os.path.join(cls.tmp.name, "downloads")
        os.makedirs(cls.downloads)
        options.add_experimental_option("prefs", {"download.default_directory": cls.downloads,
                                                  "download.prompt_for_download": False})
        started = time.monotonic()
        cls.driver = webdriver.Chrome(service=Service(ARGS.chromedriver), options=options)
        print(f"chromium started in {time.monotonic() - started:.1f} s", file=sys.stderr)
        cls.driver.set_window_size(*WINDOW)
        cls.driver.get_log("performance")  # the browser's own start (about:blank), before any page
        cls.fetched = []  # every URL the browser asked for, over all tests

    @classmethod
    def tearDownClass(cls):
        cls.driver.quit()
        cls.client.close()
        cls.server.stop()
        cls.tmp.cleanup()

    # --- The API outside the browser -----------------------------------------

    @classmethod
    def api(cls, route, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{cls.origin}/explorer/api/{route}", data=data, headers={
            "Authorization": f"Bearer {TOKEN}", **({"Content-Type": "application/json"} if data else {})})
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return json.loads(response.read())

    def seeded_inputs(self, seed, seq_len, d_model=None):
        """The hidden states the page's {"random": ...} runs on, [seq_len, d_model]."""
        d_model = d_model or self.model["d_model"]
        npy = self.api("inputs", {"seed": seed, "seq_len": seq_len, "d_model": d_model})["npy"]
        x = np.load(io.BytesIO(base64.b64decode(npy)))
        self.assertEqual(x.shape, (seq_len, d_model))
        return x

    # --- The browser ----------------------------------------------------------

    def el(self, element_id):
        from selenium.webdriver.common.by import By
        return self.driver.find_element(By.ID, element_id)

    def body_attr(self, name):
        return self.driver.execute_script(f"return document.body.dataset.{name} || ''")

    def wait(self, what, check, timeout=WAIT):
        from selenium.webdriver.support.ui import WebDriverWait
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(
            lambda _: check(), message=f"waiting for {what}")

    def act(self, what, action, expect="ready"):
        """Does `action` and waits until the page has finished what it started
        (body[data-requests] counts finished actions); asserts the end state."""
        before = int(self.body_attr("requests") or 0)
        action()
        self.wait(what, lambda: int(self.body_attr("requests") or 0) > before)
        state = self.body_attr("state")
        if expect:
            self.assertEqual(state, expect, f"{what}: the page says {self.el('error').text!r}")
        return state

    def open_page(self):
        """Loads the page, sees it ask for the token, gives it."""
        from selenium.webdriver.common.keys import Keys
        self.driver.get(f"{self.origin}/explorer/")
        self.wait("the page's first answer", lambda: self.body_attr("state") in ("ready", "error"))
        self.assertEqual(self.body_attr("state"), "error")
        self.assertIn("bearer token (401)", self.el("error").text)
        self.act("the models with the token", lambda: self.el("token").send_keys(TOKEN, Keys.TAB))
        self.assertFalse(self.el("error").is_displayed())
        self.assertIn("12 heads" if self.model["num_heads"] == 12 else "heads", self.el("model-info").text)

    def set_field(self, element_id, text):
        field = self.el(element_id)
        field.clear()
        if text:
            field.send_keys(text)

    def run_page(self, seed, seq_len, labels=None, causal=False, key_mask=""):
        self.el("source-random").click()
        self.set_field("seed", str(seed))
        self.set_field("seq-len", str(seq_len))
        self.driver.execute_script("document.getElementById('labels').value = arguments[0]",
                                   "\n".join(labels) if labels else "")
        if self.el("causal").is_selected() != causal:
            self.el("causal").click()
        self.set_field("key-mask", key_mask)
        self.act(f"a run at S={seq_len}", lambda: self.el("run").click())

    def center(self, element):
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", element)

    def move_to(self, element, x, y):
        """Moves the pointer to canvas pixel (x, y) of `element` (Selenium's
        offsets count from the element's centre)."""
        from selenium.webdriver.common.action_chains import ActionChains
        size = element.size
        ActionChains(self.driver).move_to_element_with_offset(
            element, int(round(x - size["width"] / 2)), int(round(y - size["height"] / 2))).perform()

    def click_tile(self, head):
        from selenium.webdriver.common.action_chains import ActionChains
        grid = self.el("grid-canvas")
        self.center(grid)
        d = {k: int(grid.get_attribute(f"data-{k}")) for k in ("per-row", "tile", "tile-gap", "tile-title")}
        x = (head % d["per-row"]) * (d["tile"] + d["tile-gap"]) + d["tile"] / 2
        y = (head // d["per-row"]) * (d["tile"] + d["tile-gap"] + d["tile-title"]) + d["tile-title"] + d["tile"] / 2
        rendered = int(self.el("large-canvas").get_attribute("data-rendered"))
        self.move_to(grid, x, y)
        ActionChains(self.driver).click().perform()
        self.wait(f"head {head} large", lambda: self.el("large-head").text == str(head) and
                  int(self.el("large-canvas").get_attribute("data-rendered")) > rendered)

    def large_cell_point(self, i, j):
        """Canvas pixel at the centre of the large view's cell (i, j)."""
        c = self.el("large-canvas")
        g = {k: int(c.get_attribute(f"data-{k}")) for k in ("plot-x", "plot-y", "plot-w", "plot-h", "rows", "cols")}
        return (g["plot-x"] + (j + 0.5) * g["plot-w"] / g["cols"], g["plot-y"] + (i + 0.5) * g["plot-h"] / g["rows"])

    def hover(self, i, j):
        """Hovers the large view's cell (i, j); returns #hover-readout's data and text."""
        canvas = self.el("large-canvas")
        self.center(canvas)
        self.move_to(canvas, *self.large_cell_point(i, j))
        readout = self.el("hover-readout")
        step = int(canvas.get_attribute("data-step"))
        q = int(canvas.get_attribute("data-q0")) + i * step
        k = int(canvas.get_attribute("data-k0")) + j * step
        self.wait(f"the readout of cell ({q}, {k})", lambda: readout.get_attribute("data-query") == str(q) and
                  readout.get_attribute("data-key") == str(k))
        return q, k, readout.get_attribute("data-weight"), readout.text

    def drag(self, cell_from, cell_to):
        from selenium.webdriver.common.action_chains import ActionChains
        canvas = self.el("large-canvas")
        self.center(canvas)
        x0, y0 = self.large_cell_point(*cell_from)
        x1, y1 = self.large_cell_point(*cell_to)
        self.move_to(canvas, x0, y0)
        ActionChains(self.driver).click_and_hold().move_by_offset(int(x1 - x0), int(y1 - y0)).release().perform()

    def distinct_colours(self, canvas_id):
        """How many different RGB colours the canvas holds (every 3rd pixel)."""
        return self.driver.execute_script("""
            const c = document.getElementById(arguments[0]);
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const seen = new Set();
            for (let p = 0; p < d.length; p += 12) seen.add((d[p] << 16) | (d[p + 1] << 8) | d[p + 2]);
            return seen.size;""", canvas_id)

    def download(self, button_css, suffix):
        """Clicks an export button; returns the bytes of the file the browser
        saved (in the test's download folder)."""
        from selenium.webdriver.common.by import By
        link = self.el("download-link")
        self.driver.find_element(By.CSS_SELECTOR, button_css).click()
        self.wait(f"the {suffix} export", lambda: (link.get_attribute("download") or "").endswith(suffix))
        path = os.path.join(self.downloads, link.get_attribute("download"))
        # Chromium writes NAME.crdownload and renames it to NAME when complete.
        self.wait(f"{path} saved", lambda: os.path.exists(path))
        with open(path, "rb") as f:
            data = f.read()
        os.remove(path)
        return data

    def screenshot(self, element_id, name):
        element = self.el(element_id)
        self.center(element)
        path = os.path.join(ARGS.screenshots, name)
        self.assertTrue(element.screenshot(path), path)
        print(f"screenshot: {path}", file=sys.stderr)

    def tearDown(self):
        self.assert_fetched_same_origin()

    def assert_fetched_same_origin(self):
        """Every request the browser made since the last look went to the page's origin."""
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] != "Network.requestWillBeSent":
                continue
            url = message["params"]["request"]["url"]
            type(self).fetched.append(url)
            bare = url[len("blob:"):] if url.startswith("blob:") else url
            parts = urllib.parse.urlsplit(bare)
            self.assertEqual(f"{parts.scheme}://{parts.netloc}", self.origin, f"the page fetched {url}")
            self.assertNotIn(TOKEN, url)

    # --- The tests ----------------------------------------------------------------

    def test_page_loads_from_its_own_origin_only(self):
        self.open_page()
        self.run_page(seed=3, seq_len=16)
        self.assert_fetched_same_origin()
        paths = {urllib.parse.urlsplit(u).path for u in self.fetched}
        for path in ["/explorer/", "/explorer/explorer.js", "/explorer/explorer.css", "/explorer/api/models",
                     "/explorer/api/attend"]:
            self.assertIn(path, paths)
        # The page's answer carries the policy that keeps it that way.
        with urllib.request.urlopen(f"{self.origin}/explorer/", timeout=60) as response:
            self.assertIn("default-src 'self'", response.headers["Content-Security-Policy"])
        self.assertNotIn(TOKEN, self.driver.page_source)

    def test_hover_shows_the_weights_attend_returns(self):
        self.open_page()
        rng = np.random.default_rng()
        seed, S, H = int(rng.integers(0, 2**31)), len(WORDS), self.model["num_heads"]
        masked_keys = [3, 10, 11]
        self.run_page(seed, S, labels=WORDS, causal=True, key_mask="3, 10-11")
        x = self.seeded_inputs(seed, S)
        allowed = np.ones((1, 1, S), bool)
        allowed[0, 0, masked_keys] = False
        result = self.client.attend(x[None], causal=True, mask=allowed, maps="per-head", stats=True)
        maps = result.maps[0]  # [H, S, S]

        # Every view rendered.
        self.assertGreater(self.distinct_colours("grid-canvas"), 20)
        self.assertGreater(self.distinct_colours("lines-canvas"), 20)
        self.assertEqual(self.el("grid-canvas").get_attribute("data-pool"), "1")

        head = int(rng.integers(0, H))
        self.click_tile(head)
        self.assertGreater(self.distinct_colours("large-canvas"), 20)
        cells = [(int(rng.integers(1, S)), 0), (S - 1, int(rng.integers(0, 3))), (S - 1, S - 2), (5, 4), (2, 9),
                 (12, 10)]
        for i, j in cells:
            q, k, shown, text = self.hover(i, j)
            self.assertIn(f'query {q} "{WORDS[q]}"', text)
            self.assertIn(f'key {k} "{WORDS[k]}"', text)
            if k > q or k in masked_keys:
                self.assertEqual(shown, "masked", text)
                continue
            expected = float(maps[head, q, k])
            self.assertLessEqual(abs(float(shown) - expected), significant_tolerance(expected),
                                 f"head {head} query {q} key {k}: page {shown}, Attend {expected}")
        self.screenshot("large-section", "large.png")
        # The head view for another query token: one row of every head.
        rendered = int(self.el("lines-canvas").get_attribute("data-rendered"))
        self.set_field("query", "16")
        self.act("the head view of query 16", lambda: self.el("show-query").click())
        self.assertGreater(int(self.el("lines-canvas").get_attribute("data-rendered")), rendered)
        self.assertEqual(self.el("query-label").text, f'"{WORDS[16]}"')
        self.assertGreater(self.distinct_colours("lines-canvas"), 20)

        # The .npy behind the large view: the same weights, masked cells -1.
        exported = np.load(io.BytesIO(self.download('[data-export-npy="large"]', "-large.npy")))
        self.assertEqual(exported.dtype, np.dtype("<f4"))
        masked = ~np.tril(np.ones((S, S), bool)) | ~allowed[0]
        np.testing.assert_array_equal(exported == -1, masked)
        np.testing.assert_allclose(np.where(masked, 0, exported), maps[head], rtol=1e-5, atol=1e-7)
        png = self.download('[data-export-png="grid-canvas"]', "-grid.png")
        self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")

        # The statistics table: Attend's statistics at display precision, sortable.
        from selenium.webdriver.common.by import By
        table = self.el("stats-table")
        rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
        self.assertEqual(len(rows), H)
        for row in rows:
            cells_text = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
            h = int(cells_text[0])
            for text, values in zip(cells_text[1:], [result.stats.entropy, result.stats.max_weight,
                                                     result.stats.contribution]):
                expected = float(values[0, h])
                self.assertLessEqual(abs(float(text) - expected), significant_tolerance(expected) + 1e-5 * abs(expected),
                                     f"head {h}: {cells_text} against Attend's {expected}")
        self.driver.find_element(By.CSS_SELECTOR, '#stats-table th[data-key="entropy"]').click()
        shown = [float(r.find_elements(By.TAG_NAME, "td")[1].text)
                 for r in table.find_elements(By.CSS_SELECTOR, "tbody tr")]
        self.assertEqual(shown, sorted(shown, reverse=True))
        self.screenshot("grid-section", "grid.png")
        self.screenshot("lines-section", "lines.png")
        self.screenshot("stats-section", "stats.png")

        # The square-root colour scale redraws the maps; then the page as a
        # whole, with a head removed (the README's picture).
        from selenium.webdriver.support.ui import Select
        rendered = int(self.el("large-canvas").get_attribute("data-rendered"))
        colours = self.distinct_colours("large-canvas")
        Select(self.el("scale")).select_by_value("sqrt")
        self.wait("the square-root scale", lambda: int(self.el("large-canvas").get_attribute("data-rendered")) > rendered)
        self.assertNotEqual(self.distinct_colours("large-canvas"), colours)
        removed = (head + 1) % H
        self.act(f"head {removed} off", lambda: self.el(f"head-toggle-{removed}").click())
        self.assertIn(f"Removing head {removed} changes the output by", self.el("output-change").text)
        self.hover(16, 14)
        self.driver.execute_script("window.scrollTo(0, 0)")
        page = os.path.join(ARGS.screenshots, "page.png")
        self.assertTrue(self.driver.save_screenshot(page))
        print(f"screenshot: {page}", file=sys.stderr)
        if ARGS.readme_image:
            self.assertTrue(self.driver.save_screenshot(ARGS.readme_image))
            print(f"README picture: {ARGS.readme_image}", file=sys.stderr)

    def test_head_mask_shows_the_output_change_attend_gives(self):
        self.open_page()
        rng = np.random.default_rng()
        seed, S, H = int(rng.integers(0, 2**31)), 40, self.model["num_heads"]
        self.run_page(seed, S)
        x = self.seeded_inputs(seed, S)[None]
        full = self.client.attend(x).output.astype(np.float64)
        removed = []
        for head in rng.choice(H, size=2, replace=False):
            removed.append(int(head))
            self.act(f"head {head} off", lambda: self.el(f"head-toggle-{head}").click())
            change = self.el("output-change")
            head_mask = [0.0 if h in removed else 1.0 for h in range(H)]
            masked = self.client.attend(x, head_mask=head_mask).output.astype(np.float64)
            expected = 100 * np.linalg.norm(masked - full) / np.linalg.norm(full)
            shown = float(change.get_attribute("data-percent"))
            self.assertIn(f"by {change.get_attribute('data-percent')}%", change.text)
            self.assertIn(", ".join(map(str, sorted(removed))), change.text)
            self.assertLessEqual(abs(shown - expected), significant_tolerance(expected) + 1e-4 * expected,
                                 f"heads {removed} off: page {change.text!r}, Attend {expected:.6g}%")
            # The removed head's tile is drawn as removed, its map all zero.
            self.assertEqual(self.el("grid-canvas").get_attribute("data-pool"), "1")
        self.screenshot("ablation", "head_mask.png")
        self.act("head back on", lambda: self.el(f"head-toggle-{removed[-1]}").click())
        self.assertIn(f"head {removed[0]} changes", self.el("output-change").text)

    def test_long_sequence_renders_within_the_servers_limits(self):
        self.open_page()
        rng = np.random.default_rng()
        seed, S, H = int(rng.integers(0, 2**31)), LONG_S, self.model["num_heads"]
        started = time.monotonic()
        self.run_page(seed, S)
        print(f"S={S}: the page's run took {time.monotonic() - started:.1f} s", file=sys.stderr)
        pool = int(self.el("grid-canvas").get_attribute("data-pool"))
        self.assertGreater(pool, 1)
        self.assertLessEqual(math.ceil(S / pool), self.limits["max_grid"])
        self.assertIn(f"pooled {pool} x {pool}", self.el("grid-caption").text)
        self.assertGreater(self.distinct_colours("grid-canvas"), 20)
        max_cells = self.limits["max_region_cells"]
        if H * S <= max_cells:
            self.assertGreater(self.distinct_colours("lines-canvas"), 5)
        else:
            self.assertIn("max_region_cells", self.el("notice").text)
        self.screenshot("grid-section", "long_grid.png")

        head = int(rng.integers(0, H))
        self.click_tile(head)
        canvas = self.el("large-canvas")
        rows = int(canvas.get_attribute("data-rows"))
        self.assertEqual(int(canvas.get_attribute("data-step")), pool)
        # The whole map at full resolution is over the limit: the page says so and asks nothing.
        self.assertGreater(S * S, max_cells)
        self.assert_fetched_same_origin()  # drains the log: what follows is the drag's
        attends = sum(u.endswith("/api/attend") for u in self.fetched)
        requests = self.body_attr("requests")
        self.drag((0, 0), (rows - 1, rows - 1))
        self.wait("the refusal", lambda: f"The region of queries 0-{S - 1} x keys 0-{S - 1}" in self.el("notice").text)
        self.assertIn("max_region_cells", self.el("notice").text)
        self.assert_fetched_same_origin()
        self.assertEqual(sum(u.endswith("/api/attend") for u in self.fetched), attends)
        self.assertEqual(self.body_attr("requests"), requests)
        # A region of 3 x 3 pooled cells comes at full resolution.
        i0, j0 = int(rng.integers(0, rows - 3)), int(rng.integers(0, rows - 3))
        self.act("a region", lambda: self.drag((i0, j0), (i0 + 2, j0 + 2)))
        self.assertEqual(canvas.get_attribute("data-step"), "1")
        self.assertEqual(int(canvas.get_attribute("data-rows")), min(S, (i0 + 3) * pool) - i0 * pool)
        self.assertIn("full resolution", self.el("large-caption").text)
        self.screenshot("large-section", "long_region.png")
        x = self.seeded_inputs(seed, S)[None]
        for i, j in [(int(rng.integers(0, 3 * pool)), int(rng.integers(0, 3 * pool))) for _ in range(3)]:
            q, k, shown, text = self.hover(i, j)
            row = self.client.attend(x, maps="per-head", heads=[head], rows=[q]).maps[0, 0, 0]
            expected = float(row[k])
            self.assertLessEqual(abs(float(shown) - expected), significant_tolerance(expected),
                                 f"S={S} head {head} query {q} key {k}: page {shown}, Attend {expected}")

    def test_a_file_that_is_not_npy_gets_a_clear_message(self):
        self.open_page()
        path = os.path.join(self.tmp.name, "hidden_states.npy")
        with open(path, "w") as f:
            f.write("token,x0,x1\nthe,0.1,0.2\n")
        self.el("npy-file").send_keys(path)
        self.assertTrue(self.el("source-npy").is_selected())
        self.set_field("key-mask", "")
        self.act("the bad upload", lambda: self.el("run").click(), expect="error")
        message = self.el("error").text
        self.assertTrue(self.el("error").is_displayed())
        for part in ['"hidden_states.npy"', "inputs.npy", "NUMPY"]:
            self.assertIn(part, message)
        self.screenshot("controls", "bad_upload.png")

        # A real .npy of the test's own goes through and matches Attend.
        S = 20
        x = np.random.default_rng().standard_normal((S, self.model["d_model"])).astype(np.float32)
        good = os.path.join(self.tmp.name, "states.npy")
        np.save(good, x)
        self.el("npy-file").send_keys(good)
        self.act("the good upload", lambda: self.el("run").click())
        self.assertFalse(self.el("error").is_displayed())
        head = 1
        self.click_tile(head)
        maps = self.client.attend(x[None], maps="per-head").maps[0]
        q, k, shown, _ = self.hover(7, 12)
        self.assertLessEqual(abs(float(shown) - maps[head, q, k]), significant_tolerance(float(maps[head, q, k])))

    def test_an_adhoc_layer_runs_and_its_hover_matches_attend(self):
        from attnserve.v1 import attention_pb2 as pb
        from selenium.webdriver.support.ui import Select
        self.open_page()
        rng = np.random.default_rng()
        d, heads, kv_heads, S = 64, 8, 2, 24
        layer_seed, seed = int(rng.integers(0, 2**31)), int(rng.integers(0, 2**31))
        select = Select(self.el("model"))
        self.assertFalse(self.el("layer-fields").is_displayed())
        select.select_by_index(len(select.options) - 1)
        self.assertEqual(select.first_selected_option.get_attribute("id"), "model-adhoc")
        self.assertTrue(self.el("layer-fields").is_displayed())
        self.assertEqual(self.el("layer-heads").get_attribute("max"), str(self.limits["layer"]["max_heads"]))
        self.assertIn("limits.layer.max_weight_bytes", self.el("layer-info").text)
        for field, value in [("layer-d-model", d), ("layer-heads", heads), ("layer-kv-heads", 3),
                             ("layer-seed", layer_seed), ("layer-theta", 10000)]:
            self.set_field(field, str(value))
        if not self.el("layer-rope").is_selected():
            self.el("layer-rope").click()
        # The server refuses 3 key/value heads for 8 heads; the page says so.
        self.el("source-random").click()
        self.set_field("seed", str(seed))
        self.set_field("seq-len", str(S))
        self.act("a bad head configuration", lambda: self.el("run").click(), expect="error")
        self.assertIn("layer.num_kv_heads: 3 does not divide num_heads 8", self.el("error").text)

        self.set_field("layer-kv-heads", str(kv_heads))
        self.run_page(seed, S, causal=True)
        self.assertIn(f"Ran the ad-hoc layer: d_model {d}, {heads} heads ({kv_heads} key/value heads), head_dim 8, "
                      f"RoPE (theta 10000, 8 dims), weight seed {layer_seed}", self.el("model-info").text)
        self.assertEqual(len(self.driver.find_elements("css selector", "#head-toggles input")), heads)
        self.assertGreater(self.distinct_colours("grid-canvas"), 20)
        self.assertGreater(self.distinct_colours("lines-canvas"), 5)

        spec = pb.LayerSpec(head_config=pb.HeadConfig(d_model=d, num_heads=heads, num_kv_heads=kv_heads,
                                                      rotary=pb.RotaryConfig(rotary_dim=d // heads, theta=10000)),
                            seed=layer_seed)
        x = self.seeded_inputs(seed, S, d)
        maps = self.client.attend(x[None], layer=spec, causal=True, maps="per-head").maps[0]
        head = int(rng.integers(0, heads))
        self.click_tile(head)
        for i, j in [(int(rng.integers(1, S)), 0), (S - 1, int(rng.integers(0, S))), (9, 4), (3, 7)]:
            q, k, shown, text = self.hover(i, j)
            if k > q:
                self.assertEqual(shown, "masked", text)
                continue
            expected = float(maps[head, q, k])
            self.assertLessEqual(abs(float(shown) - expected), significant_tolerance(expected),
                                 f"ad-hoc head {head} query {q} key {k}: page {shown}, Attend {expected}")
        # The head mask reruns the same layer: the output change two Attend calls give.
        removed = (head + 3) % heads
        self.act(f"ad-hoc head {removed} off", lambda: self.el(f"head-toggle-{removed}").click())
        change = self.el("output-change")
        full = self.client.attend(x[None], layer=spec, causal=True).output.astype(np.float64)
        masked = self.client.attend(x[None], layer=spec, causal=True,
                                    head_mask=[0.0 if h == removed else 1.0 for h in range(heads)])
        expected = 100 * np.linalg.norm(masked.output.astype(np.float64) - full) / np.linalg.norm(full)
        shown = float(change.get_attribute("data-percent"))
        self.assertLessEqual(abs(shown - expected), significant_tolerance(expected) + 1e-4 * expected,
                             f"ad-hoc head {removed} off: page {change.text!r}, Attend {expected:.6g}%")
        self.screenshot("side", "adhoc_layer.png")

    def test_a_decode_sessions_latest_token_view_matches_its_last_step(self):
        self.open_page()
        rng = np.random.default_rng()
        d, H = self.model["d_model"], self.model["num_heads"]
        n = int(rng.integers(12, 40))
        with self.client.open_session("default") as session:
            session.extend(rng.standard_normal((n, d)).astype(np.float32))
            step = session.extend(rng.standard_normal((1, d)).astype(np.float32), maps=True)
            length = n + 1
            expected = step.maps[:, 0, :]  # [H, length]: the latest token's weights
            self.assertEqual(expected.shape, (H, length))
            self.set_field("session-id", session.id)
            self.set_field("session-layer", "0")
            self.driver.execute_script("document.getElementById('labels').value = arguments[0]",
                                       "\n".join(f"t{i}" for i in range(length)))
            canvas = self.el("session-canvas")
            self.act("the session view", lambda: self.el("show-session").click())
            self.assertGreater(self.distinct_colours("session-canvas"), 10)
            self.assertIn(f"{length} tokens", self.el("session-caption").text)
            readout = self.el("session-readout")
            self.center(canvas)
            g = {k: int(canvas.get_attribute(f"data-{k}")) for k in ("plot-x", "plot-y", "plot-w", "row")}
            for head, key in [(int(rng.integers(0, H)), int(rng.integers(0, length))), (0, length - 1),
                              (H - 1, 0), (int(rng.integers(0, H)), length // 2)]:
                self.move_to(canvas, g["plot-x"] + (key + 0.5) * g["plot-w"] / length,
                             g["plot-y"] + (head + 0.5) * g["row"])
                self.wait(f"the session readout of head {head} key {key}",
                          lambda: readout.get_attribute("data-head") == str(head) and
                          readout.get_attribute("data-key") == str(key))
                shown = float(readout.get_attribute("data-weight"))
                want = float(expected[head, key])
                self.assertLessEqual(abs(shown - want), significant_tolerance(want),
                                     f"head {head} key {key}: page {shown}, Extend {want}")
                self.assertIn(f'"t{key}"', readout.text)
            exported = np.load(io.BytesIO(self.download('[data-export-npy="session"]', ".npy")))
            np.testing.assert_allclose(exported, expected, rtol=0, atol=1e-6)
            self.screenshot("session-section", "session.png")
            # Reading did not extend the session.
            self.assertEqual(session.info().layer_lengths[0], length)

            # Another caller's token: the server's refusal (as for an unknown id) shows in the page.
            from selenium.webdriver.common.keys import Keys
            self.set_field("token", OTHER_TOKEN)
            self.act("the models with the other token", lambda: self.el("token").send_keys(Keys.TAB))
            self.act("the session view with another token", lambda: self.el("show-session").click(),
                     expect="error")
            self.assertIn("404", self.el("error").text)
            self.assertIn("session", self.el("error").text)
            self.set_field("token", TOKEN)
            self.act("the models with the token", lambda: self.el("token").send_keys(Keys.TAB))


if __name__ == "__main__":
    harness.run_tests_with_stubs(ARGS.proto_dir, UNITTEST_ARGS)

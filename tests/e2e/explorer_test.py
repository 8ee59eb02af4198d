"""The attention explorer's server side on the real attnserve binary's HTTP
port (--http_address=127.0.0.1:0, the port read from its log): the page's
files and their headers, the Host and Origin checks, and the JSON API against
attnserve.v1's Attend on the same server (through the attnserve package).

The server runs without dynamic batching (--max_batch_tokens=0). Inputs are
fresh each run: a random seed for /explorer/api/inputs, whose .npy the test
sends to Attend itself. The explorer's figures are compared in float64 with
the test's own computation from Attend's full maps and outputs:
  - grid: the max-pool of the per-head maps over pool x pool blocks, -1 where
    the causal or key mask removes every cell of a block; region and row: the
    maps at those cells (-1 where masked); absolute tolerance 1e-6 (weights are
    in [0, 1]; the explorer asks Attend for the same rows in chunks);
  - stats: Attend's head_statistics, relative tolerance 1e-6 (1e-5 where many chunks' statistics are
    combined);
  - output norm and relative_change (||y - y_full|| / ||y_full|| from two
    Attend calls, with and without the head mask): relative tolerance 1e-5.
Many chunks run on model-repository Llama layouts (RoPE, grouped-query heads,
causal and not) with a small --max_attention_map_bytes.
An ad-hoc layer (grouped-query heads, RoPE, seeded weights; "layer" instead of
"model") is checked the same way against Attend with the same LayerSpec, and
its refusals name the layer's field.
S=4096 on the built-in model (--max_seq_len=4096) answers a grid within the
limits while the server's peak RSS (VmHWM) stays under 400 MB, half the size
of the full maps (12 x 4096 x 4096 x 4 bytes = 805 MB).

  explorer_test.py --server <attnserve> --proto_dir <repo>/proto --web_dir <repo>/server/explorer/web
"""
import argparse
import base64
import http.client
import io
import json
import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--server", required=True)
PARSER.add_argument("--proto_dir", required=True)
PARSER.add_argument("--web_dir", required=True)
ARGS, UNITTEST_ARGS = PARSER.parse_known_args()

D_MODEL, NUM_HEADS = 768, 12  # the built-in model
LONG_S = 4096
ADHOC_WEIGHT_BYTES = 32 << 20  # --max_adhoc_weight_bytes, reported in limits.layer
RSS_BOUND_MB = 400
ALLOWED_HOST = "attn.example.org"
TOKEN = "explorer-test-token-41f9"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css",
                 ".svg": "image/svg+xml", ".png": "image/png"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def request(port, method, path, body=None, headers=None, host=None):
    """(status, headers dict, body bytes) of one request; `host` overrides the Host header."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        all_headers = dict(headers or {})
        if body is not None:
            all_headers.setdefault("Content-Type", "application/json")
            if not isinstance(body, bytes):
                body = json.dumps(body).encode()
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        for key, value in all_headers.items():
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def f32(text, shape):
    return np.frombuffer(base64.b64decode(text), dtype="<f4").reshape(shape).astype(np.float64)


def pooled_reference(maps, masked, grid):
    """Max-pool of maps [H, S, S] (float64) over p x p blocks, -1 where every cell is masked."""
    heads, s, _ = maps.shape
    p = -(-s // grid)
    cells = -(-s // p)
    padded = np.full((heads, cells * p, cells * p), -1.0)
    padded[:, :s, :s] = np.where(masked[None], -1.0, maps)
    return padded.reshape(heads, cells, p, cells, p).max(axis=(2, 4)), p


class ExplorerServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import attnserve
        cls.server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", "--max_batch_tokens=0",
                                    f"--max_seq_len={LONG_S}", f"--http_allowed_hosts={ALLOWED_HOST}",
                                    f"--max_adhoc_weight_bytes={ADHOC_WEIGHT_BYTES}")
        cls.server.wait_serving()
        assert cls.server.http_port, "attnserve did not log its HTTP port"
        cls.port = cls.server.http_port
        cls.client = attnserve.Client(cls.server.target, options=[
            ("grpc.max_receive_message_length", 256 << 20)])
        cls.rng = np.random.default_rng()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def api(self, path, body=None, **kwargs):
        status, headers, data = request(self.port, "GET" if body is None else "POST", path, body, **kwargs)
        return status, headers, json.loads(data)

    def fresh_inputs(self, s, d_model=D_MODEL):
        """(seed, x [S, d_model] float32) from /explorer/api/inputs, for a fresh seed."""
        seed = int(self.rng.integers(0, 1 << 53))
        status, _, reply = self.api("/explorer/api/inputs", {"seed": seed, "seq_len": s, "d_model": d_model})
        self.assertEqual(status, 200, reply)
        x = np.load(io.BytesIO(base64.b64decode(reply["npy"])))
        self.assertEqual((x.dtype, x.shape), (np.dtype("<f4"), (s, d_model)))
        return seed, x

    def test_the_page_and_its_files_are_served_with_the_security_headers(self):
        names = sorted(n for n in os.listdir(ARGS.web_dir) if not n.startswith("."))
        self.assertIn("index.html", names)
        for name in names:
            with open(os.path.join(ARGS.web_dir, name), "rb") as f:
                expected = f.read()
            status, headers, body = request(self.port, "GET", f"/explorer/{name}")
            self.assertEqual(status, 200, name)
            self.assertEqual(body, expected, name)
            self.assertEqual(headers["Content-Type"],
                             CONTENT_TYPES.get(os.path.splitext(name)[1], "application/octet-stream"), name)
            for key, value in SECURITY_HEADERS.items():
                self.assertEqual(headers.get(key), value, f"{name}: {key}")
        with open(os.path.join(ARGS.web_dir, "index.html"), "rb") as f:
            index = f.read()
        status, headers, body = request(self.port, "GET", "/explorer/")
        self.assertEqual((status, body), (200, index))
        self.assertEqual(headers["Content-Security-Policy"], SECURITY_HEADERS["Content-Security-Policy"])
        status, headers, _ = request(self.port, "GET", "/explorer")
        self.assertEqual((status, headers.get("Location")), (308, "/explorer/"))
        for path in ["/explorer/no-such-file.js", "/explorer/..%2Findex.html", "/explorer/.hidden",
                     "/explorer/a/b"]:
            status, headers, body = request(self.port, "GET", path)
            self.assertIn(status, (400, 404), path)
            self.assertIn("error", json.loads(body), path)
            self.assertEqual(headers.get("Content-Security-Policy"),
                             SECURITY_HEADERS["Content-Security-Policy"], path)
        status, headers, models = self.api("/explorer/api/models")
        self.assertEqual(status, 200, models)
        self.assertEqual(headers["Cache-Control"], "no-store")
        self.assertEqual(headers["Content-Type"], "application/json")
        for key, value in SECURITY_HEADERS.items():
            self.assertEqual(headers.get(key), value, key)
        default = {m["name"]: m for m in models["models"]}["default"]
        self.assertEqual((default["d_model"], default["num_heads"], default["max_seq_len"]),
                         (D_MODEL, NUM_HEADS, LONG_S))
        self.assertLessEqual({"num_kv_heads", "head_dim", "max_attention_map_bytes", "description"},
                             set(default))
        self.assertEqual(models["limits"]["max_grid"], 512)
        self.assertEqual(models["limits"]["layer"], {
            "max_d_model": 65536, "max_heads": 1024, "max_head_dim": 4096, "max_weight_bytes": ADHOC_WEIGHT_BYTES,
            "max_seq_len": LONG_S, "max_attention_map_bytes": 64 << 20, "max_input_values": 1 << 24})
        self.assertGreater(models["limits"]["max_region_cells"], 0)
        self.assertGreater(models["limits"]["max_body_bytes"], 0)

    def test_a_foreign_host_or_origin_is_refused_and_the_allowed_ones_pass(self):
        port = self.port
        for host in [f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}",
                     "127.0.0.1", f"{ALLOWED_HOST}:{port}", ALLOWED_HOST.upper()]:
            status, _, body = request(port, "GET", "/explorer/api/models", host=host)
            self.assertEqual(status, 200, f"Host {host}: {body!r}")
            status, _, _ = request(port, "GET", "/explorer/", host=host)
            self.assertEqual(status, 200, host)
        for host in ["evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}",
                     f"{ALLOWED_HOST}.evil.example", "", "localhost:80@evil.example"]:
            for path in ["/explorer/", "/explorer/api/models", "/explorer/index.html"]:
                status, headers, body = request(port, "GET", path, host=host)
                self.assertEqual(status, 403, f"Host {host!r} {path}")
                self.assertIn("--http_allowed_hosts", json.loads(body)["error"])
                self.assertEqual(headers.get("Content-Security-Policy"),
                                 SECURITY_HEADERS["Content-Security-Policy"])
        # A POST from a foreign host is refused before its body counts.
        status, _, body = request(port, "POST", "/explorer/api/inputs",
                                  {"seed": 1, "seq_len": 2, "d_model": 4}, host="evil.example")
        self.assertEqual(status, 403, body)
        # Origin, when sent, must be this Host's.
        host = f"127.0.0.1:{port}"
        for origin in [f"http://{host}", f"https://{host}"]:
            status, _, body = request(port, "POST", "/explorer/api/inputs",
                                      {"seed": 1, "seq_len": 2, "d_model": 4}, headers={"Origin": origin})
            self.assertEqual(status, 200, f"Origin {origin}: {body!r}")
        for origin in ["http://evil.example", f"http://localhost:{port}", "null", f"ftp://{host}",
                       f"http://{host}.evil.example", f"http://{host}/"]:
            status, _, body = request(port, "POST", "/explorer/api/inputs",
                                      {"seed": 1, "seq_len": 2, "d_model": 4}, headers={"Origin": origin})
            self.assertEqual(status, 403, f"Origin {origin}")
            self.assertIn("Origin", json.loads(body)["error"])
        # The Open Inference Protocol's routes take any Host (their clients send any).
        status, headers, body = request(port, "GET", "/v2/health/live", host="evil.example")
        self.assertEqual((status, json.loads(body)), (200, {"live": True}))
        self.assertNotIn("Content-Security-Policy", headers)

    def test_grid_region_row_and_stats_equal_attends_full_maps(self):
        s, grid = int(self.rng.integers(120, 200)), 48
        seed, x = self.fresh_inputs(s)
        key_mask = np.ones(s, dtype=bool)
        key_mask[self.rng.choice(np.arange(1, s), size=s // 5, replace=False)] = False
        region = {"head": 5, "q0": 10, "q1": 70, "k0": 3, "k1": 90}
        query_row = int(self.rng.integers(0, s))
        body = {"model": "default", "inputs": {"random": {"seed": seed, "seq_len": s}}, "causal": True,
                "key_mask": key_mask.astype(int).tolist(), "grid": grid, "region": region,
                "query_row": query_row}
        status, headers, reply = self.api("/explorer/api/attend", body)
        self.assertEqual(status, 200, reply)
        self.assertEqual(headers["Cache-Control"], "no-store")
        self.assertEqual((reply["model"], reply["seq_len"], reply["num_heads"], reply["d_model"]),
                         ("default", s, NUM_HEADS, D_MODEL))

        full = self.client.attend(x[None], causal=True, mask=key_mask[None, None, :], maps="per-head",
                                  stats=True)
        maps = full.maps[0].astype(np.float64)  # [H, S, S]
        q, k = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
        masked = (k > q) | ~key_mask[None, :]
        expected, p = pooled_reference(maps, masked, grid)
        g = reply["grid"]
        self.assertEqual((g["pool"], g["rows"], g["cols"]), (p, expected.shape[1], expected.shape[2]))
        got = f32(g["data"], expected.shape)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
        # Causal: every block above the diagonal is all masked; masked keys too.
        self.assertTrue(np.all(got[:, 0, 1:] == -1))
        self.assertTrue((got == -1).any() and (got > 0).any())

        r = reply["region"]
        self.assertEqual((r["heads"], r["q0"], r["q1"], r["k0"], r["k1"]), ([5], 10, 70, 3, 90))
        want = np.where(masked, -1.0, maps[5])[10:70, 3:90]
        np.testing.assert_allclose(f32(r["data"], (1, 60, 87))[0], want, rtol=0, atol=1e-6)
        row = reply["row"]
        self.assertEqual(row["query"], query_row)
        want = np.where(masked[query_row][None, :], -1.0, maps[:, query_row, :])
        np.testing.assert_allclose(f32(row["data"], (NUM_HEADS, s)), want, rtol=0, atol=1e-6)

        for name in ["entropy", "max_weight", "contribution"]:
            np.testing.assert_allclose(np.array(reply["stats"][name]),
                                       getattr(full.stats, name)[0].astype(np.float64), rtol=1e-6, atol=0,
                                       err_msg=name)
        self.assertAlmostEqual(reply["output"]["norm"] / np.linalg.norm(full.output.astype(np.float64)), 1,
                               delta=1e-5)
        self.assertNotIn("relative_change", reply["output"])

        # The same inputs uploaded as a float64 (1, S, D) .npy, and as big-endian
        # float32 in Fortran order (both converted by the parser): the same answer.
        for stored in (x.astype("<f8")[None], np.asfortranarray(x.astype(">f4"))):
            with io.BytesIO() as f:
                np.save(f, stored)
                upload = base64.b64encode(f.getvalue()).decode()
            body["inputs"] = {"npy": upload}
            status, _, again = self.api("/explorer/api/attend", body)
            self.assertEqual(status, 200, again)
            np.testing.assert_allclose(f32(again["grid"]["data"], expected.shape), got, rtol=0, atol=1e-6)
            np.testing.assert_allclose(again["stats"]["entropy"], reply["stats"]["entropy"], rtol=1e-6)

    def test_a_sessions_latest_token_pooled_and_at_full_resolution(self):
        n = int(self.rng.integers(200, 400))
        with self.client.open_session("default") as session:
            session.extend(self.rng.standard_normal((n, D_MODEL)).astype(np.float32))
            step = session.extend(self.rng.standard_normal((1, D_MODEL)).astype(np.float32), maps=True)
            length = n + 1
            latest = session.latest_attention(0)
            weights = latest.maps.astype(np.float64)  # [H, length]
            self.assertEqual(weights.shape, (NUM_HEADS, length))
            # The read is the last step's row (the session's own check: Extend's maps).
            np.testing.assert_allclose(weights, step.maps[:, 0, :], rtol=0, atol=1e-6)

            cols = int(self.rng.integers(16, 100))
            status, _, reply = self.api("/explorer/api/session", {
                "session_id": session.id, "layer": 0, "cols": cols, "keys": {"k0": 7, "k1": 71}})
            self.assertEqual(status, 200, reply)
            p = -(-length // cols)
            c = -(-length // p)
            self.assertEqual((reply["length"], reply["pool"], reply["cols"], reply["num_heads"]),
                             (length, p, c, NUM_HEADS))
            self.assertEqual(reply["position"], length - 1)
            padded = np.zeros((NUM_HEADS, c * p))
            padded[:, :length] = weights
            np.testing.assert_array_equal(f32(reply["data"], (NUM_HEADS, c)),
                                          padded.reshape(NUM_HEADS, c, p).max(axis=2))
            np.testing.assert_array_equal(f32(reply["keys"]["data"], (NUM_HEADS, 64)), weights[:, 7:71])
            np.testing.assert_allclose(reply["stats"]["entropy"], latest.entropy, rtol=1e-6)
            np.testing.assert_allclose(reply["stats"]["max_weight"], weights.max(axis=1), rtol=1e-6)
            # Reading never extends the session.
            self.assertEqual(session.info().layer_lengths[0], length)

            cases = [
                ({}, 400, "session_id"),
                ({"session_id": "0" * 32}, 404, ""),
                ({"session_id": session.id, "layer": 1}, 400, "layer"),
                ({"session_id": session.id, "cols": 0}, 400, "cols"),
                ({"session_id": session.id, "keys": {"k0": 0, "k1": length + 1}}, 400, "keys.k1"),
                ({"session_id": session.id, "keys": {"k0": 5, "k1": 5}}, 400, "keys.k1"),
            ]
            for body, code, field in cases:
                status, _, reply = self.api("/explorer/api/session", body)
                self.assertEqual(status, code, f"{body}: {reply}")
                self.assertTrue(reply["error"].startswith(field), f"{body}: {reply['error']}")

    def test_a_region_of_every_head_alone_without_grid(self):
        s = 64
        seed, x = self.fresh_inputs(s)
        status, _, reply = self.api("/explorer/api/attend", {
            "model": "default", "inputs": {"random": {"seed": seed, "seq_len": s}}, "grid": 0,
            "region": {"q0": 40, "q1": 64, "k0": 0, "k1": 64}})
        self.assertEqual(status, 200, reply)
        self.assertNotIn("grid", reply)
        full = self.client.attend(x[None], maps="per-head")
        np.testing.assert_allclose(f32(reply["region"]["data"], (NUM_HEADS, 24, 64)),
                                   full.maps[0][:, 40:64, :].astype(np.float64), rtol=0, atol=1e-6)

    def test_relative_change_is_the_output_change_attend_gives_for_the_head_mask(self):
        s = int(self.rng.integers(40, 100))
        seed, x = self.fresh_inputs(s)
        head_mask = [1] * NUM_HEADS
        for head in self.rng.choice(NUM_HEADS, size=2, replace=False):
            head_mask[int(head)] = 0
        status, _, reply = self.api("/explorer/api/attend", {
            "model": "default", "inputs": {"random": {"seed": seed, "seq_len": s}}, "head_mask": head_mask,
            "grid": 32})
        self.assertEqual(status, 200, reply)
        masked = self.client.attend(x[None], head_mask=head_mask, maps="per-head", stats=True)
        full = self.client.attend(x[None])
        y, y_full = masked.output.astype(np.float64), full.output.astype(np.float64)
        expected = np.linalg.norm(y - y_full) / np.linalg.norm(y_full)
        self.assertGreater(expected, 0)
        self.assertAlmostEqual(reply["output"]["relative_change"] / expected, 1, delta=1e-5)
        self.assertAlmostEqual(reply["output"]["norm"] / np.linalg.norm(y), 1, delta=1e-5)
        # A removed head's map is all 0 (not masked), its contribution 0.
        grid = f32(reply["grid"]["data"], (NUM_HEADS, reply["grid"]["rows"], reply["grid"]["cols"]))
        for head, gate in enumerate(head_mask):
            self.assertEqual(bool(np.all(grid[head] == 0)), gate == 0, head)
        np.testing.assert_allclose(reply["stats"]["contribution"], masked.stats.contribution[0], rtol=1e-6)

    def test_bad_requests_are_400_naming_the_field(self):
        seed = 3
        base = {"model": "default", "inputs": {"random": {"seed": seed, "seq_len": 16}}}
        not_npy = base64.b64encode(b"PK\x03\x04 this is a zip file, not a .npy").decode()
        with io.BytesIO() as f:
            np.save(f, np.zeros((16, D_MODEL + 1), dtype="<f4"))
            wrong_width = base64.b64encode(f.getvalue()).decode()
        with io.BytesIO() as f:
            np.save(f, np.zeros((16, D_MODEL), dtype="<c8"))
            complex_values = base64.b64encode(f.getvalue()).decode()
        with_nan = np.zeros((16, D_MODEL), dtype="<f8")
        with_nan[2, 5] = np.nan
        with io.BytesIO() as f:
            np.save(f, with_nan)
            with_nan = base64.b64encode(f.getvalue()).decode()
        cases = [
            ({"inputs": {"npy": not_npy}}, "inputs.npy: not a .npy file"),
            ({"inputs": {"npy": "%%% not base64"}}, "inputs.npy: not valid base64"),
            ({"inputs": {"npy": wrong_width}}, "inputs.npy: shape"),
            ({"inputs": {"npy": complex_values}}, "inputs.npy: bad .npy header: dtype '<c8' cannot be"),
            ({"inputs": {"npy": with_nan}}, "inputs.npy: data: row 2, column 5 is nan"),
            ({"inputs": {"random": {"seed": 1, "seq_len": LONG_S + 1}}}, "inputs.random.seq_len"),
            ({"head_mask": [1, 0]}, "head_mask"),
            ({"key_mask": [1] * 15}, "key_mask"),
            ({"grid": 513}, "grid"),
            ({"region": {"head": 12, "q0": 0, "q1": 4, "k0": 0, "k1": 4}}, "region.head"),
            ({"region": {"q0": 5, "q1": 5, "k0": 0, "k1": 4}}, "region.q1"),
            ({"query_row": 16}, "query_row"),
        ]
        for change, field in cases:
            status, headers, reply = self.api("/explorer/api/attend", {**base, **change})
            self.assertEqual(status, 400, f"{change}: {reply}")
            self.assertTrue(reply["error"].startswith(field), f"{field}: {reply['error']}")
        # Over limits.max_region_cells.
        status, _, models = self.api("/explorer/api/models")
        cells = models["limits"]["max_region_cells"]
        side = int(np.ceil(np.sqrt(cells / NUM_HEADS))) + 1
        status, _, reply = self.api("/explorer/api/attend", {
            "model": "default", "inputs": {"random": {"seed": 1, "seq_len": side}}, "grid": 0,
            "region": {"q0": 0, "q1": side, "k0": 0, "k1": side}})
        self.assertEqual(status, 400, reply)
        self.assertTrue(reply["error"].startswith("region:"), reply)
        self.assertIn("max_region_cells", reply["error"])
        status, _, reply = self.api("/explorer/api/attend", {**base, "model": "no-such-model"})
        self.assertEqual(status, 404, reply)
        status, _, body = request(self.port, "POST", "/explorer/api/attend", b"{not json")
        self.assertEqual(status, 400)
        status, _, body = request(self.port, "POST", "/explorer/api/attend", b"{}",
                                  headers={"Content-Type": "text/plain"})
        self.assertEqual(status, 415)

    def test_an_adhoc_gqa_layer_with_rope_gives_attends_maps(self):
        from attnserve.v1 import attention_pb2 as pb
        d, heads, kv_heads, head_dim, grid = 64, 8, 2, 8, 24
        s = int(self.rng.integers(60, 120))
        layer_seed = int(self.rng.integers(0, 1 << 53))
        layer = {"d_model": d, "num_heads": heads, "num_kv_heads": kv_heads, "seed": layer_seed,
                 "rotary": {"theta": 10000}}
        spec = pb.LayerSpec(head_config=pb.HeadConfig(d_model=d, num_heads=heads, num_kv_heads=kv_heads,
                                                      head_dim=head_dim,
                                                      rotary=pb.RotaryConfig(rotary_dim=head_dim, theta=10000)),
                            seed=layer_seed)
        for causal in [False, True]:
            with self.subTest(causal=causal):
                seed, x = self.fresh_inputs(s, d)
                key_mask = np.ones(s, dtype=bool)
                key_mask[self.rng.choice(np.arange(1, s), size=s // 6, replace=False)] = False
                region = {"head": 5, "q0": 7, "q1": 50, "k0": 2, "k1": 44}
                query_row = int(self.rng.integers(0, s))
                status, _, reply = self.api("/explorer/api/attend", {
                    "layer": layer, "inputs": {"random": {"seed": seed, "seq_len": s}}, "causal": causal,
                    "key_mask": key_mask.astype(int).tolist(), "grid": grid, "region": region,
                    "query_row": query_row})
                self.assertEqual(status, 200, reply)
                self.assertNotIn("model", reply)
                echo = dict(reply["layer"])
                self.assertAlmostEqual(echo.pop("scale"), head_dim ** -0.5, delta=1e-7)
                self.assertEqual(echo, {"d_model": d, "num_heads": heads, "num_kv_heads": kv_heads,
                                        "head_dim": head_dim, "seed": layer_seed,
                                        "rotary": {"rotary_dim": head_dim, "theta": 10000.0}})
                self.assertEqual((reply["seq_len"], reply["num_heads"], reply["num_kv_heads"], reply["d_model"],
                                  reply["causal"]), (s, heads, kv_heads, d, causal))

                full = self.client.attend(x[None], layer=spec, causal=causal, mask=key_mask[None, None, :],
                                          maps="per-head", stats=True)
                maps = full.maps[0].astype(np.float64)  # [H, S, S]
                q, k = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
                masked = ((k > q) if causal else np.zeros((s, s), bool)) | ~key_mask[None, :]
                expected, p = pooled_reference(maps, masked, grid)
                g = reply["grid"]
                self.assertEqual((g["pool"], g["rows"], g["cols"]), (p, expected.shape[1], expected.shape[2]))
                np.testing.assert_allclose(f32(g["data"], expected.shape), expected, rtol=0, atol=1e-6)
                want = np.where(masked, -1.0, maps[5])[7:50, 2:44]
                np.testing.assert_allclose(f32(reply["region"]["data"], (1, 43, 42))[0], want, rtol=0, atol=1e-6)
                want = np.where(masked[query_row][None, :], -1.0, maps[:, query_row, :])
                np.testing.assert_allclose(f32(reply["row"]["data"], (heads, s)), want, rtol=0, atol=1e-6)
                for name in ["entropy", "max_weight", "contribution"]:
                    np.testing.assert_allclose(np.array(reply["stats"][name]),
                                               getattr(full.stats, name)[0].astype(np.float64), rtol=1e-5,
                                               atol=0, err_msg=name)
                self.assertAlmostEqual(
                    reply["output"]["norm"] / np.linalg.norm(full.output.astype(np.float64)), 1, delta=1e-5)
                # The layer's RoPE and seed matter: without them Attend's maps differ.
                for other in [pb.LayerSpec(head_config=pb.HeadConfig(d_model=d, num_heads=heads,
                                                                     num_kv_heads=kv_heads), seed=layer_seed),
                              pb.LayerSpec(head_config=spec.head_config, seed=layer_seed + 1)]:
                    plain = self.client.attend(x[None], layer=other, causal=causal, mask=key_mask[None, None, :],
                                               maps="per-head").maps[0].astype(np.float64)
                    self.assertGreater(np.abs(plain - maps).max(), 1e-3)

    def test_adhoc_layer_refusals_name_the_field(self):
        inputs = {"random": {"seed": 5, "seq_len": 16}}
        layer = {"d_model": 64, "num_heads": 8, "num_kv_heads": 2}
        cases = [
            ({"model": "default", "layer": layer}, 400, "model:"),
            ({}, 400, "model: required"),
            ({"layer": {**layer, "num_kv_heads": 3}}, 400, "layer.num_kv_heads: 3 does not divide num_heads 8"),
            ({"layer": {**layer, "num_kv_heads": 0}}, 400, "layer.num_kv_heads: 0 is outside [1, 1024]"),
            ({"layer": {**layer, "num_heads": "8"}}, 400, "layer.num_heads: expected an integer"),
            ({"layer": {"num_heads": 8}}, 400, "layer.d_model: required"),
            ({"layer": {**layer, "d_model": 60}}, 400, "layer.num_heads: 8 does not divide d_model 60"),
            ({"layer": {**layer, "seed": -1}}, 400, "layer.seed"),
            ({"layer": {**layer, "rotary": {"rotary_dim": 3}}}, 400, "layer.rotary.rotary_dim: must be even"),
            ({"layer": {**layer, "rotary": {"theta": 0.5}}}, 400, "layer.rotary.theta"),
            # Too small for float32 and zero: refused, not taken as the default.
            ({"layer": {**layer, "rotary": {"theta": 1e-50}}}, 400, "layer.rotary.theta: expected a number > 1"),
            ({"layer": {**layer, "rotary": {"theta": 0}}}, 400, "layer.rotary.theta: expected a number > 1"),
            ({"layer": {**layer, "rotary": "yes"}}, 400, "layer.rotary"),
            ({"layer": [64, 8]}, 400, "layer: expected"),
            ({"layer": {"d_model": 2048, "num_heads": 16}}, 400, "layer (weight bytes as FP32)"),
            ({"layer": {"d_model": 8192, "num_heads": 64},
              "inputs": {"random": {"seed": 1, "seq_len": LONG_S}}}, 400, "inputs.random.seq_len"),
            ({"layer": layer, "head_mask": [1] * 12}, 400, "head_mask"),
        ]
        for change, code, start in cases:
            status, _, reply = self.api("/explorer/api/attend", {"inputs": inputs, **change})
            self.assertEqual(status, code, f"{change}: {reply}")
            self.assertTrue(reply["error"].startswith(start), f"{change}: {reply['error']}")
        status, _, reply = self.api("/explorer/api/attend", {"inputs": inputs,
                                                             "layer": {"d_model": 2048, "num_heads": 16}})
        self.assertIn("max_adhoc_weight_bytes", reply["error"])

    def test_a_long_sequence_answers_a_grid_within_the_limits_and_memory(self):
        seed = int(self.rng.integers(0, 1 << 53))
        before = self.server.memory_kib()
        status, _, reply = self.api("/explorer/api/attend", {
            "model": "default", "inputs": {"random": {"seed": seed, "seq_len": LONG_S}}, "grid": 256,
            "query_row": 17})
        self.assertEqual(status, 200, reply)
        after = self.server.memory_kib()
        g = reply["grid"]
        self.assertEqual((g["pool"], g["rows"], g["cols"]), (16, 256, 256))
        grid = f32(g["data"], (NUM_HEADS, 256, 256))
        # Nothing is masked; every block holds a positive weight, none over 1.
        self.assertTrue(np.all(grid > 0) and np.all(grid <= 1))
        # The row is query 17's weights: they sum to 1 per head, and each block's
        # largest is at most the grid's cell (equal, unless another query of the
        # block attends more).
        row = f32(reply["row"]["data"], (NUM_HEADS, LONG_S))
        np.testing.assert_allclose(row.sum(axis=1), 1, rtol=1e-4)
        row_blocks = row.reshape(NUM_HEADS, 256, 16).max(axis=2)
        self.assertTrue(np.all(row_blocks <= grid[:, 17 // 16, :] + 1e-7))
        full_maps_mb = NUM_HEADS * LONG_S * LONG_S * 4 / 1e6
        peak_mb = after["VmHWM"] * 1024 / 1e6
        print(f"\nS={LONG_S}: {reply['seconds']:.1f} s; server VmHWM {before['VmHWM'] * 1024 / 1e6:.0f} MB "
              f"before, {peak_mb:.0f} MB after (full maps: {full_maps_mb:.0f} MB, bound {RSS_BOUND_MB} MB)",
              file=sys.stderr)
        self.assertLess(peak_mb, RSS_BOUND_MB)


class ExplorerChunksOnRepositoryModels(unittest.TestCase):
    """Many chunks (--max_attention_map_bytes small) on Llama-layout models with RoPE and grouped-query heads: one
    made bidirectional ("causal": false; chunks asked as cross-attention with position offsets) and one causal
    (causal for every request; chunks asked as self-attention with query rows). The reference maps come from
    Attend in row subsets of self-attention, as the limit allows."""

    D, HEADS, KV_HEADS, S = 64, 4, 2, 57
    MAP_BYTES = 20000  # 21 rows of 4 heads x 57 keys per chunk: 3 chunks

    @classmethod
    def setUpClass(cls):
        import attnserve
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        cls.tmp = tempfile.TemporaryDirectory()
        rng = np.random.default_rng()
        d, hd = cls.D, cls.D // cls.HEADS
        for name, causal in [("rope_bidirectional", False), ("rope_causal", None)]:
            folder = os.path.join(cls.tmp.name, name)
            os.makedirs(folder)
            p = "model.layers.0.self_attn."
            config = {"layout": "llama", "prefix": p, "d_model": d, "num_heads": cls.HEADS,
                      "num_kv_heads": cls.KV_HEADS, "rotary": {"dim": hd, "theta": 10000.0}}
            if causal is not None:
                config["causal"] = causal
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
            g = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
            harness.write_safetensors(os.path.join(folder, "model.safetensors"), {
                p + "q_proj.weight": (g(cls.HEADS * hd, d), "F32"), p + "k_proj.weight": (g(cls.KV_HEADS * hd, d), "F32"),
                p + "v_proj.weight": (g(cls.KV_HEADS * hd, d), "F32"), p + "o_proj.weight": (g(d, cls.HEADS * hd), "F32")})
        cls.server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", "--max_batch_tokens=0",
                                    f"--model_repository={cls.tmp.name}",
                                    f"--max_attention_map_bytes={cls.MAP_BYTES}")
        cls.server.wait_serving()
        cls.port = cls.server.http_port
        cls.client = attnserve.Client(cls.server.target)
        cls.rng = rng

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        cls.tmp.cleanup()

    def full_maps(self, model, x, causal, key_mask):
        """[H, S, S] float64 from Attend, rows in pieces within --max_attention_map_bytes; and the statistics."""
        s = x.shape[0]
        per_call = self.MAP_BYTES // (self.HEADS * s * 4)
        maps, stats = [], None
        for r0 in range(0, s, per_call):
            rows = list(range(r0, min(s, r0 + per_call)))
            result = self.client.attend(x[None], model=model, causal=causal, mask=key_mask[None, None, :],
                                        maps="per-head", rows=rows, stats=True)
            maps.append(result.maps[0].astype(np.float64))
            stats = result.stats
        return np.concatenate(maps, axis=1), stats

    def test_many_chunks_give_attends_maps_with_rope_grouped_heads_and_a_causal_model(self):
        s, grid = self.S, 16
        for model, causal in [("rope_bidirectional", False), ("rope_bidirectional", True), ("rope_causal", False)]:
            with self.subTest(model=model, causal=causal):
                seed = int(self.rng.integers(0, 1 << 53))
                key_mask = np.ones(s, dtype=bool)
                key_mask[self.rng.choice(np.arange(1, s), size=8, replace=False)] = False
                status, _, reply = request(self.port, "POST", "/explorer/api/inputs",
                                           {"seed": seed, "seq_len": s, "d_model": self.D})
                x = np.load(io.BytesIO(base64.b64decode(json.loads(reply)["npy"])))
                region = {"head": 3, "q0": 15, "q1": 50, "k0": 2, "k1": 40}
                status, _, body = request(self.port, "POST", "/explorer/api/attend", {
                    "model": model, "inputs": {"random": {"seed": seed, "seq_len": s}}, "causal": causal,
                    "key_mask": key_mask.astype(int).tolist(), "grid": grid, "region": region, "query_row": 40})
                reply = json.loads(body)
                self.assertEqual(status, 200, reply)
                effective = causal or model == "rope_causal"
                self.assertEqual(reply["causal"], effective)
                maps, stats = self.full_maps(model, x, effective, key_mask)
                q, k = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
                masked = ((k > q) if effective else np.zeros((s, s), bool)) | ~key_mask[None, :]
                expected, p = pooled_reference(maps, masked, grid)
                got = f32(reply["grid"]["data"], expected.shape)
                np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
                want = np.where(masked, -1.0, maps[3])[15:50, 2:40]
                np.testing.assert_allclose(f32(reply["region"]["data"], (1, 35, 38))[0], want, rtol=0, atol=1e-6)
                want = np.where(masked[40][None, :], -1.0, maps[:, 40, :])
                np.testing.assert_allclose(f32(reply["row"]["data"], (self.HEADS, s)), want, rtol=0, atol=1e-6)
                for name in ["entropy", "max_weight", "contribution"]:
                    np.testing.assert_allclose(np.array(reply["stats"][name]),
                                               getattr(stats, name)[0].astype(np.float64), rtol=1e-5, atol=0,
                                               err_msg=name)


class ExplorerWithTokensAndWebDir(unittest.TestCase):
    def test_the_api_needs_the_token_the_page_does_not_and_web_dir_serves_the_folder(self):
        with tempfile.TemporaryDirectory() as tmp:
            tokens = os.path.join(tmp, "tokens")
            with open(tokens, "w") as f:
                f.write(f"{TOKEN}\n")
            web = os.path.join(tmp, "web")
            os.mkdir(web)
            with open(os.path.join(web, "index.html"), "w") as f:
                f.write("<p>edited without rebuilding</p>\n")
            server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", f"--auth_tokens_file={tokens}",
                                    f"--explorer_web_dir={web}")
            try:
                server.wait_serving()
                port = server.http_port
                status, _, body = request(port, "GET", "/explorer/")
                self.assertEqual((status, body), (200, b"<p>edited without rebuilding</p>\n"))
                with open(os.path.join(web, "extra.js"), "w") as f:
                    f.write("// added while serving\n")
                status, headers, body = request(port, "GET", "/explorer/extra.js")
                self.assertEqual((status, body, headers["Content-Type"]),
                                 (200, b"// added while serving\n", "text/javascript"))
                status, _, body = request(port, "GET", "/explorer/api/models")
                self.assertEqual(status, 401, body)
                status, _, body = request(port, "POST", "/explorer/api/attend", {"model": "default"})
                self.assertEqual(status, 401, body)
                status, _, body = request(port, "GET", "/explorer/api/models",
                                          headers={"Authorization": f"Bearer {TOKEN}"})
                self.assertEqual(status, 200, body)
                status, _, body = request(port, "POST", "/explorer/api/attend", {
                    "model": "default", "inputs": {"random": {"seed": 1, "seq_len": 8}}, "grid": 8},
                    headers={"Authorization": f"Bearer {TOKEN}"})
                self.assertEqual(status, 200, body)
            finally:
                server.stop()


if __name__ == "__main__":
    harness.run_tests_with_stubs(ARGS.proto_dir, UNITTEST_ARGS)

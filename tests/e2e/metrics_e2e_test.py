#!/usr/bin/python3
"""End-to-end: attnserve's /metrics as Prometheus and Grafana see it.

The real attnserve binary (metrics and the access log on 127.0.0.1, free
ports) is scraped over HTTP and checked by promtool; a real Prometheus (Debian's
binary, with deploy/prometheus/prometheus.yml pointed at the test server and its
rules loaded) scrapes it and is queried through its HTTP API; every query of
the Grafana dashboard is checked against the live exposition.

Usage: metrics_e2e_test.py --server PATH/attnserve --proto_dir REPO/proto --repo REPO
"""
import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, run_tests_with_stubs, parse_exposition, stop_process, to_tensor,  # noqa: E402
                     wait_serving)

ARGS = None
STUB_DIR = None


# --- Helpers ------------------------------------------------------------------

def http_get(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AttnServe:
    """attnserve with metrics on a free loopback port, stubs and a scraper."""

    def __init__(self, *flags):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2
        import health_pb2_grpc
        self.pb = attention_pb2
        self.server = Server(ARGS.server, *flags)  # metrics on a free loopback port
        self.channel = grpc.insecure_channel(self.server.target)
        self.stub = attention_pb2_grpc.AttentionServiceStub(self.channel)
        wait_serving(health_pb2_grpc.HealthStub(self.channel), health_pb2)

    def scrape(self):
        return self.server.scrape_text()

    @property
    def metrics_port(self):
        return self.server.metrics_port

    def attend(self, batch, seq, d_model=768, model="default", metadata=()):
        """The status code name of an Attend call, and its call object."""
        import grpc
        x = np.random.default_rng(0).standard_normal((batch, seq, d_model)).astype(np.float32)
        request = self.pb.AttendRequest(model=model, hidden_states=to_tensor(self.pb, x))
        try:
            _, call = self.stub.Attend.with_call(request, timeout=120, metadata=metadata)
            return "OK", call
        except grpc.RpcError as e:
            return e.code().name, e

    def stop(self):
        self.channel.close()
        self.server.stop()


def promtool_check_metrics(test, text):
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=120)
    test.assertEqual(result.returncode, 0, f"promtool check metrics:\n{result.stdout}{result.stderr}")


# --- Start-up -----------------------------------------------------------------

class StartUp(unittest.TestCase):
    def test_series_of_the_model_exist_before_any_request_and_pass_promtool(self):
        launched = time.time()
        s = AttnServe()
        try:
            text = s.scrape()
        finally:
            s.stop()
        scraped = time.time()
        promtool_check_metrics(self, text)
        samples = parse_exposition(text)
        for name, labels in [
            ("attnserve_request_duration_seconds_count", dict(method="Attend", model="default", code="OK")),
            ("attnserve_requests_total", dict(method="Attend", code="OK")),
            ("attnserve_requests_total", dict(method="Attend", code="INVALID_ARGUMENT")),
            ("attnserve_queue_wait_seconds_count", dict(model="default")),
            ("attnserve_compute_seconds_count", dict(model="default", kernel_path="fp32/materialized")),
            ("attnserve_batch_size_count", dict(model="default")),
            ("attnserve_batch_tokens_count", dict(model="default")),
            ("attnserve_tokens_total", dict(model="default")),
            ("attnserve_attention_map_bytes_total", dict(model="default")),
            ("attnserve_queue_depth", {}),
            ("attnserve_requests_in_flight", {}),
        ]:
            self.assertEqual(value(samples, name, **labels), 0, f"{name}{labels}")
        self.assertEqual(value(samples, "attnserve_model_info", model="default", d_model="768",
                               num_heads="12", num_kv_heads="12", head_dim="64"), 1)
        build = [dict(k) for (n, k) in samples if n == "attnserve_build_info"]
        self.assertEqual(len(build), 1)
        self.assertTrue(build[0]["version"] and build[0]["onednn_version"] and build[0]["cpu_isa"])
        for name in ["process_cpu_seconds_total", "process_resident_memory_bytes",
                     "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
                     "process_start_time_seconds", "process_threads"]:
            self.assertIsNotNone(value(samples, name), name)
        self.assertGreater(value(samples, "process_resident_memory_bytes"), 1 << 20)
        # Between the launch and the scrape (the kernel's boot time, which the
        # start time is counted from, has whole seconds).
        start_time = value(samples, "process_start_time_seconds")
        self.assertGreaterEqual(start_time, launched - 2)
        self.assertLessEqual(start_time, scraped + 2)


# --- Traffic ------------------------------------------------------------------

class Traffic(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = AttnServe("--access_log")
        cls.before = parse_exposition(cls.s.scrape())
        cls.codes = [cls.s.attend(1, 4)[0], cls.s.attend(2, 3)[0], cls.s.attend(1, 7)[0],
                     cls.s.attend(1, 4, d_model=32)[0], cls.s.attend(1, 0)[0],
                     cls.s.attend(1, 4, model="no-such-model")[0]]
        code, cls.traced_call = cls.s.attend(
            1, 5, metadata=(("x-request-id", "e2e-trace-1"), ("authorization", "Bearer top-secret-77")))
        cls.codes.append(code)
        cls.text = cls.s.scrape()
        cls.after = parse_exposition(cls.text)

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def delta(self, name, **labels):
        return value(self.after, name, **labels) - (value(self.before, name, **labels) or 0)

    def test_the_calls_got_the_codes_the_counts_expect(self):
        self.assertEqual(self.codes, ["OK", "OK", "OK", "INVALID_ARGUMENT", "INVALID_ARGUMENT",
                                      "NOT_FOUND", "OK"])

    def test_counters_and_histograms_move_by_exactly_the_calls_made(self):
        self.assertEqual(self.delta("attnserve_requests_total", method="Attend", code="OK"), 4)
        self.assertEqual(self.delta("attnserve_requests_total", method="Attend", code="INVALID_ARGUMENT"), 2)
        self.assertEqual(self.delta("attnserve_requests_total", method="Attend", code="NOT_FOUND"), 1)
        self.assertEqual(self.delta("attnserve_requests_total", method="Attend", code="INTERNAL"), 0)
        duration = "attnserve_request_duration_seconds"
        self.assertEqual(self.delta(f"{duration}_count", method="Attend", model="default", code="OK"), 4)
        self.assertEqual(self.delta(f"{duration}_bucket", method="Attend", model="default", code="OK",
                                    le="+Inf"), 4)
        self.assertEqual(self.delta(f"{duration}_count", method="Attend", model="default",
                                    code="INVALID_ARGUMENT"), 2)
        self.assertEqual(self.delta(f"{duration}_count", method="Attend", model="", code="NOT_FOUND"), 1)
        self.assertNotIn("no-such-model", self.text)
        self.assertEqual(self.delta("attnserve_queue_wait_seconds_count", model="default"), 4)
        # None of them asks for maps: all run the blocked path.
        self.assertEqual(self.delta("attnserve_compute_seconds_count", model="default",
                                    kernel_path="fp32/blocked"), 4)
        self.assertEqual(self.delta("attnserve_batch_size_sum", model="default"), 1 + 2 + 1 + 1)
        self.assertEqual(self.delta("attnserve_batch_tokens_sum", model="default"), 4 + 6 + 7 + 5)
        self.assertEqual(self.delta("attnserve_tokens_total", model="default"), 4 + 6 + 7 + 5)
        self.assertEqual(self.delta("attnserve_attention_map_bytes_total", model="default"), 0)
        self.assertEqual(value(self.after, "attnserve_queue_depth"), 0)
        self.assertEqual(value(self.after, "attnserve_requests_in_flight"), 0)

    def test_the_exposition_after_traffic_passes_promtool(self):
        promtool_check_metrics(self, self.text)

    def test_access_log_has_one_json_line_per_call_with_the_request_id_and_no_credentials(self):
        metadata = dict(self.traced_call.initial_metadata())
        self.assertEqual(metadata.get("x-request-id"), "e2e-trace-1")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = [json.loads(l) for l in list(self.s.server.log) if l.startswith("{")]
            if len(lines) >= len(self.codes):
                break
            time.sleep(0.05)
        access = [l for l in lines if l.get("log") == "access"]
        self.assertEqual(len(access), len(self.codes))
        self.assertEqual([l["code"] for l in access], self.codes)
        traced = [l for l in access if l["request_id"] == "e2e-trace-1"]
        self.assertEqual(len(traced), 1)
        traced = traced[0]
        self.assertEqual(traced["method"], "Attend")
        self.assertEqual(traced["model"], "default")
        self.assertEqual(traced["shapes"], {"hidden_states": [1, 5, 768]})
        for key in ["duration_seconds", "queue_seconds", "compute_seconds"]:
            self.assertGreaterEqual(traced[key], 0)
        self.assertNotIn("top-secret", "".join(self.s.server.log))
        self.assertEqual(len({l["request_id"] for l in access}), len(access))
        self.assertIn("message", access[3])
        self.assertNotIn("compute_seconds", access[3])

    def test_every_dashboard_query_uses_metrics_and_labels_the_service_exports(self):
        path = os.path.join(ARGS.repo, "deploy", "grafana", "dashboards", "attnserve.json")
        with open(path) as f:
            dashboard = json.load(f)
        exported = {}
        for name, labels in self.after:
            exported.setdefault(name, set()).update(k for k, _ in labels)
        scrape_labels = {"job", "instance"}  # added by Prometheus at scrape time
        exprs = []
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            self.assertEqual(panel["datasource"]["uid"], "${datasource}", panel["title"])
            self.assertTrue(panel["targets"], panel["title"])
            exprs += [t["expr"] for t in panel["targets"]]
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":
                exprs.append(var["query"]["query"])
        used = set()
        for expr in exprs:
            for name, matchers in selectors(expr):
                used.add(name)
                if name == "up":  # Prometheus' own
                    continue
                self.assertIn(name, exported, f"dashboard query uses {name}, not exported: {expr}")
                for label in matchers:
                    self.assertIn(label, exported[name] | scrape_labels,
                                  f"{name} has no label {label}: {expr}")
            for label in grouping_labels(expr):
                self.assertTrue(any(label in labels for labels in exported.values())
                                or label in scrape_labels, f"no metric has label {label}: {expr}")
        for needed in ["attnserve_request_duration_seconds_bucket", "attnserve_requests_total",
                       "attnserve_queue_depth", "attnserve_queue_wait_seconds_bucket",
                       "attnserve_compute_seconds_bucket", "attnserve_batch_size_sum",
                       "attnserve_batch_tokens_bucket", "attnserve_attention_map_bytes_total",
                       "attnserve_tokens_total", "process_resident_memory_bytes"]:
            self.assertIn(needed, used)


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "le"}


def selectors(expr):
    """(metric name, [label names matched]) of every series selector in a PromQL expression."""
    found = []
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", text):
        name, matchers = m.group(1), m.group(2) or ""
        rest = text[m.end():].lstrip()
        if name in PROMQL_WORDS or (rest.startswith("(") and not matchers):
            continue
        found.append((name, re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*[=!]~?", matchers)))
    # label_values(metric, label): the second argument is a label, not a metric.
    labels_only = set(re.findall(r"label_values\([^,]*,\s*(\w+)\)", expr))
    return [(n, m) for n, m in found if n not in labels_only]


def grouping_labels(expr):
    labels = []
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels += [l.strip() for l in group.split(",") if l.strip() and l.strip() != "le"]
    return labels


# --- A real Prometheus --------------------------------------------------------

class RealPrometheus(unittest.TestCase):
    def test_prometheus_scrapes_the_counts_sent_and_computes_p99(self):
        s = AttnServe()
        work = tempfile.mkdtemp(prefix="attnserve-prom-")
        prometheus = None
        try:
            with open(os.path.join(ARGS.repo, "deploy", "prometheus", "prometheus.yml")) as f:
                config = yaml.safe_load(f)
            job = [j for j in config["scrape_configs"] if j["job_name"] == "attnserve"][0]
            job["static_configs"] = [{"targets": [f"127.0.0.1:{s.metrics_port}"]}]
            config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
            rules_dir = os.path.join(ARGS.repo, "deploy", "prometheus")
            config["rule_files"] = [os.path.join(rules_dir, r) for r in config["rule_files"]]
            with open(os.path.join(work, "prometheus.yml"), "w") as f:
                yaml.safe_dump(config, f)

            port = free_port()
            api = f"http://127.0.0.1:{port}"
            with open(os.path.join(work, "prometheus.log"), "w") as log:
                prometheus = subprocess.Popen(
                    ["prometheus", f"--config.file={work}/prometheus.yml",
                     f"--storage.tsdb.path={work}/data", f"--web.listen-address=127.0.0.1:{port}",
                     "--log.level=warn"],
                    stdout=subprocess.DEVNULL, stderr=log)

            def query(q):
                url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": q})
                status, body = http_get(url)
                reply = json.loads(body)
                self.assertEqual(reply["status"], "success", body)
                return reply["data"]["result"]

            def wait_for(what, check, timeout):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    try:
                        result = check()
                        if result is not None:
                            return result
                    except OSError:  # not listening yet
                        pass
                    if prometheus.poll() is not None:
                        with open(os.path.join(work, "prometheus.log")) as log:
                            self.fail(f"prometheus exited: {log.read()}")
                    time.sleep(0.25)
                self.fail(f"timed out waiting for {what}")

            def scalar(q):
                result = query(q)
                return float(result[0]["value"][1]) if result else None

            # Scraped at least once before any request: the zero series are in.
            wait_for("the first scrape", lambda: scalar(
                'attnserve_requests_total{job="attnserve",method="Attend",code="OK"}'), 120)
            sent = {"OK": 0, "INVALID_ARGUMENT": 0}
            for seq in [3, 5, 8, 13, 21]:
                sent[s.attend(1, seq)[0]] += 1
            for _ in range(2):
                sent[s.attend(1, 4, d_model=16)[0]] += 1
            self.assertEqual(sent, {"OK": 5, "INVALID_ARGUMENT": 2})

            for code, n in sent.items():
                q = f'sum(attnserve_requests_total{{job="attnserve",method="Attend",code="{code}"}})'
                wait_for(f"{code} == {n}", lambda q=q, n=n: True if scalar(q) == n else None, 120)
            p99 = wait_for("p99", lambda: scalar(
                'histogram_quantile(0.99, sum by (le) (rate(attnserve_request_duration_seconds_bucket'
                '{job="attnserve",method="Attend",code="OK"}[1m])))'), 120)
            # A quantile the histogram can answer; how large it is depends on the machine.
            self.assertTrue(math.isfinite(p99) and p99 > 0, p99)
            # The recording rules evaluate on real data.
            ratio = wait_for("the error-ratio rule", lambda: scalar(
                'job:attnserve_request_errors:ratio_rate5m{job="attnserve"}'), 120)
            self.assertEqual(ratio, 0)  # INVALID_ARGUMENT is the client's error
            status, body = http_get(f"{api}/api/v1/rules")
            groups = json.loads(body)["data"]["groups"]
            self.assertEqual({r["health"] for g in groups for r in g["rules"]}, {"ok"})
        finally:
            stop_process(prometheus)
            s.stop()
            shutil.rmtree(work, ignore_errors=True)


def main():
    global ARGS, STUB_DIR
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--repo", required=True)
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()

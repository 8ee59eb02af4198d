#!/usr/bin/python3
"""The deployment files, checked offline: yamllint over deploy/; the compose
file through docker-compose's own validation and against the files it mounts,
the front proxy the only published entry;
the Kubernetes kustomizations (deploy/k8s: the base, each overlay, monitoring)
rendered by `kubectl kustomize` (no cluster), and what they render parsed by
kubectl and put through schema and consistency checks of our own (required
fields and labels, selectors, probe and container ports, the shutdown budget,
scrape configuration, the image and version; the front proxy as the only
way in, its ConfigMap equal to deploy/haproxy/haproxy.cfg, which `haproxy -c`
accepts with the environment the Deployment gives it); the PrometheusRule's groups
equal to the rules file and run through `promtool check rules` and the rules'
unit tests; the dashboard ConfigMap equal to the dashboard; the alerts and the
dashboard on the same classes of status codes; the in-cluster Prometheus
config run by a real Prometheus against a real attnserve.

Usage: manifests_test.py --repo REPO --server PATH/attnserve
"""
import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import numpy as np
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from harness import PACKAGE_DIR, Server, stop_process, write_safetensors  # noqa: E402

ARGS = None
READY_SERVICES = ("attnserve.v1.AttentionService", "")
# Beyond the server's own budget: after the drain timeout up to 2 s for calls
# cut short to answer, 2 s for answers to leave, and process exit.
SHUTDOWN_MARGIN_SECONDS = 5


def repo_path(*parts):
    return os.path.join(ARGS.repo, *parts)


def load_yaml(*parts):
    with open(repo_path(*parts)) as f:
        return yaml.safe_load(f)


def flag_values(args):
    """{flag: value} of --flag=value arguments."""
    values = {}
    for a in args or []:
        m = re.match(r"^--([a-z_]+)=(.*)$", a)
        if m:
            values[m.group(1)] = m.group(2)
    return values


def port_of(address):
    m = re.search(r":(\d+)$", address)
    assert m, f"no port in {address!r}"
    return int(m.group(1))


def server_defaults():
    """The attnserve binary's defaults, from server/common/server_options.h."""
    with open(repo_path("server", "common", "server_options.h")) as f:
        text = f.read()

    def number(name):
        return float(re.search(rf"\b{name}\s*=\s*([0-9.]+)", text).group(1))

    return {
        "listen_address": re.search(r'listen_address\s*=\s*"([^"]*)"', text).group(1),
        "metrics_address": re.search(r'kDefaultMetricsAddress\[\]\s*=\s*"([^"]*)"', text).group(1),
        "lame_duck_seconds": number("lame_duck_seconds"),
        "drain_timeout_seconds": number("drain_timeout_seconds"),
    }


def server_settings(args):
    """gRPC port, metrics port, lame duck and drain seconds of an attnserve
    command line (defaults where a flag is absent)."""
    d = server_defaults()
    d.update(flag_values(args))
    return (port_of(d["listen_address"]), port_of(d["metrics_address"]),
            float(d["lame_duck_seconds"]), float(d["drain_timeout_seconds"]))


def seconds(duration):
    """Seconds of a compose duration ("30s", "1m30s", "500ms")."""
    total = 0.0
    for amount, unit in re.findall(r"([0-9.]+)(ms|us|h|m|s)", str(duration)):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


def project_version():
    """The project's version as deploy/version.sh prints it (from CMakeLists.txt's project(VERSION))."""
    with open(repo_path("CMakeLists.txt")) as f:
        version = re.search(r"\bproject\(attnserve VERSION (\S+)", f.read()).group(1)
    printed = subprocess.run([repo_path("deploy", "version.sh")], capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == version, (printed.stdout, version)
    return version


HAPROXY_CONFIG = ("deploy", "haproxy", "haproxy.cfg")
HAPROXY_DOCKERFILE = ("deploy", "haproxy", "Dockerfile")


def haproxy_config_text():
    with open(repo_path(*HAPROXY_CONFIG)) as f:
        return f.read()


def haproxy_settings():
    """What deploy/haproxy/haproxy.cfg sets that the deployments must agree
    with: the replicas' slots (server-template count), the calls in flight
    per replica (default-server maxconn), hard-stop-after in seconds, the
    default ports of its gRPC and stats listeners, and how long its health
    checks may take to see a replica turn NOT_SERVING (fall checks every
    inter, the last one taking up to timeout check)."""
    text = haproxy_config_text()
    slots = re.search(r"^\s*server-template \S+ 1-(\d+) ", text, re.M)
    maxconn = re.search(r"^\s*default-server .*\bmaxconn (\d+)", text, re.M)
    hard_stop = re.search(r"^\s*hard-stop-after (\d+)s$", text, re.M)
    grpc_bind = re.search(r'bind "\$\{ATTNSERVE_PROXY_BIND-:(\d+)\}" proto h2', text)
    stats_bind = re.search(r'bind "\$\{ATTNSERVE_PROXY_STATS_BIND-:(\d+)\}"', text)
    inter = re.search(r"^\s*default-server .*\bcheck inter (\d+)s fall (\d+)\b", text, re.M)
    check_timeout = re.search(r"^\s*timeout check (\d+)s$", text, re.M)
    assert slots and maxconn and hard_stop and grpc_bind and stats_bind and inter and check_timeout, \
        "haproxy.cfg changed shape"
    return {"slots": int(slots.group(1)), "maxconn": int(maxconn.group(1)),
            "hard_stop_after": int(hard_stop.group(1)), "grpc_port": int(grpc_bind.group(1)),
            "stats_port": int(stats_bind.group(1)),
            "detection_seconds": int(inter.group(1)) * int(inter.group(2)) + int(check_timeout.group(1))}


def haproxy_check(env):
    """`haproxy -c` of the shipped config with `env` (ATTNSERVE_* variables)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    return subprocess.run(["haproxy", "-c", "-f", repo_path(*HAPROXY_CONFIG)], capture_output=True,
                          text=True, timeout=120, env=dict(clean, **env))


def proxy_dockerfile():
    """(FROM image, EXPOSEd ports, USER, STOPSIGNAL, ENTRYPOINT, RUN text) of
    deploy/haproxy/Dockerfile."""
    with open(repo_path(*HAPROXY_DOCKERFILE)) as f:
        text = re.sub(r"\\\n", " ", f.read())
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.*)$", text, re.M) for p in line.split()}
    user = re.findall(r"^USER (\S+)", text, re.M)[-1]
    stop = re.findall(r"^STOPSIGNAL (\S+)", text, re.M)[-1]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    runs = " ".join(re.findall(r"^RUN (.*)$", text, re.M))
    return froms, exposed, user, stop, entrypoint, runs


def image_is_pinned(image):
    name = image.split("@")[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.split("/")[-1] else None
    return "@sha256:" in image or (tag is not None and tag != "latest")


def kubectl_env():
    """An environment with an empty kubeconfig: kubectl must not reach any cluster."""
    work = tempfile.mkdtemp(prefix="attnserve-kube-")
    config = os.path.join(work, "config")
    open(config, "w").close()
    return work, dict(os.environ, KUBECONFIG=config, HOME=work)


def dockerfile_final_stage():
    """(EXPOSEd ports, USER uid, CMD args) of the Dockerfile's final stage."""
    with open(repo_path("Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    final = text[text.rindex("\nFROM "):]
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.*)$", final, re.M) for p in line.split()}
    user = re.findall(r"^USER (\S+)", final, re.M)[-1].split(":")[0]
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", final, re.M).group(1))
    return exposed, user, cmd


# --- yamllint -------------------------------------------------------------------

class YamlLint(unittest.TestCase):
    def test_every_yaml_file_under_deploy_passes_yamllint(self):
        done = subprocess.run(["yamllint", "-c", repo_path(".yamllint.yml"), "-f", "parsable",
                               repo_path("deploy"), repo_path(".yamllint.yml")],
                              capture_output=True, text=True, timeout=300)
        errors = [l for l in done.stdout.splitlines() if "[error]" in l]
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertEqual(errors, [])


# --- Compose --------------------------------------------------------------------

class Compose(unittest.TestCase):
    FILE = ("deploy", "compose", "docker-compose.yml")

    @classmethod
    def setUpClass(cls):
        cls.compose = load_yaml(*cls.FILE)
        cls.dir = os.path.dirname(repo_path(*cls.FILE))
        cls.services = cls.compose["services"]

    def bind_mounts(self, service):
        """[(absolute source, target, read_only)] of a service's bind mounts."""
        mounts = []
        for v in self.services[service].get("volumes", []):
            if isinstance(v, str):
                parts = v.split(":")
                if not parts[0].startswith((".", "/")):
                    continue  # a named volume
                mounts.append((os.path.normpath(os.path.join(self.dir, parts[0])), parts[1],
                               len(parts) > 2 and "ro" in parts[2].split(",")))
            elif v.get("type") == "bind":
                mounts.append((os.path.normpath(os.path.join(self.dir, v["source"])), v["target"],
                               bool(v.get("read_only"))))
        return mounts

    def container_port(self, service, port):
        for p in self.services[service].get("ports", []):
            if str(p).split(":")[-1].split("/")[0] == str(port):
                return True
        return str(port) in [str(e) for e in self.services[service].get("expose", [])]

    def test_docker_compose_validates_the_file_offline(self):
        if shutil.which("docker-compose") is None:
            self.fail("docker-compose is not installed (deploy/install_deps.sh installs it)")
        done = subprocess.run(["docker-compose", "-f", repo_path(*self.FILE), "config", "-q"],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, DOCKER_HOST="unix:///nonexistent.sock"))
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def published(self, service):
        """[(host address or "", host port, container port)] a service publishes."""
        out = []
        for p in self.services[service].get("ports", []):
            parts = str(p).split("/")[0].split(":")
            host_ip = parts[0] if len(parts) == 3 else ""
            out.append((host_ip, int(parts[-2]) if len(parts) > 1 else None, int(parts[-1])))
        return out

    def test_services_are_the_proxy_attnserve_prometheus_and_grafana_with_pinned_images(self):
        self.assertEqual(set(self.services), {"haproxy", "attnserve", "prometheus", "grafana"})
        for name, service in self.services.items():
            self.assertTrue(image_is_pinned(service["image"]), f"{name}: {service['image']}")
        for name, context_dir in [("attnserve", ARGS.repo), ("haproxy", repo_path("deploy", "haproxy"))]:
            self.assertEqual(image_tag(self.services[name]["image"]), project_version(),
                             f"compose tags the {name} image it builds with the project's VERSION")
            build = self.services[name]["build"]
            context = os.path.normpath(os.path.join(self.dir, build["context"]))
            self.assertTrue(os.path.isfile(os.path.join(context, build.get("dockerfile", "Dockerfile"))))
            self.assertEqual(os.path.realpath(context), os.path.realpath(context_dir), name)

    def test_the_proxy_is_the_only_published_grpc_entry_and_attnserve_publishes_nothing(self):
        grpc, metrics, _, _ = server_settings(self.services["attnserve"].get("command"))
        self.assertEqual(self.services["attnserve"].get("ports", []), [], "attnserve must not be published")
        proxy = haproxy_settings()
        env = self.services["haproxy"]["environment"]
        bind_port = port_of(env.get("ATTNSERVE_PROXY_BIND", f":{proxy['grpc_port']}"))
        self.assertEqual([(h, c) for h, _, c in self.published("haproxy")], [("", bind_port)],
                         "the proxy publishes its gRPC listener, and only it")
        for name in ("prometheus", "grafana"):
            for host_ip, _, _ in self.published(name):
                self.assertEqual(host_ip, "127.0.0.1", f"{name} is published beyond this machine")
        # The proxy finds the replicas by the service name, on their gRPC port.
        self.assertEqual(env["ATTNSERVE_REPLICAS_DNS"], f"attnserve:{grpc}")
        self.assertTrue(self.container_port("attnserve", grpc))
        self.assertIn("attnserve", self.services["haproxy"]["depends_on"])

    def test_the_proxy_runs_the_shipped_config_from_debians_haproxy_and_stops_gracefully(self):
        froms, exposed, user, stop, entrypoint, runs = proxy_dockerfile()
        self.assertEqual(len(froms), 1)
        self.assertRegex(froms[0], r"^debian:12(-slim)?$")
        self.assertRegex(runs, r"apt-get install -y( -qq)? --no-install-recommends haproxy\b")
        self.assertIn("HAProxy version 2\\.6\\.", runs, "the image checks it got Debian 12's 2.6")
        self.assertNotIn(user.split(":")[0], ("root", "0"))
        self.assertEqual(stop, "SIGUSR1")
        self.assertEqual(entrypoint[:2], ["/usr/sbin/haproxy", "-db"])
        config_in_image = entrypoint[entrypoint.index("-f") + 1]
        proxy = haproxy_settings()
        env = self.services["haproxy"]["environment"]
        self.assertLessEqual({port_of(env["ATTNSERVE_PROXY_BIND"]), port_of(env["ATTNSERVE_PROXY_STATS_BIND"])},
                             exposed)
        mounts = {t: (s, ro) for s, t, ro in self.bind_mounts("haproxy")}
        self.assertIn(config_in_image, mounts, "the shipped config is mounted where the image reads it")
        self.assertEqual(os.path.realpath(mounts[config_in_image][0]), os.path.realpath(repo_path(*HAPROXY_CONFIG)))
        self.assertTrue(mounts[config_in_image][1])
        self.assertEqual(self.services["haproxy"].get("stop_signal"), "SIGUSR1")
        self.assertGreater(seconds(self.services["haproxy"]["stop_grace_period"]), proxy["hard_stop_after"])
        done = haproxy_check({k: str(v) for k, v in env.items()})
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertNotIn("WARNING", done.stdout + done.stderr)

    def test_attnserve_ports_match_its_flags_and_the_image(self):
        grpc, metrics, lame_duck, drain = server_settings(self.services["attnserve"].get("command"))
        exposed, _, _ = dockerfile_final_stage()
        self.assertLessEqual({grpc, metrics}, exposed)
        self.assertTrue(self.container_port("attnserve", grpc))
        self.assertTrue(self.container_port("attnserve", metrics))
        self.assertGreaterEqual(seconds(self.services["attnserve"]["stop_grace_period"]),
                                lame_duck + drain + SHUTDOWN_MARGIN_SECONDS)
        self.assertGreaterEqual(lame_duck, haproxy_settings()["detection_seconds"],
                                "the lame duck must outlast the proxy's health checks' detection")

    def test_every_bind_mount_source_exists(self):
        for name in self.services:
            for source, target, _ in self.bind_mounts(name):
                self.assertTrue(os.path.exists(source), f"{name}: {source} -> {target}")

    def test_the_model_repository_is_mounted_read_only_at_models(self):
        mounts = {t: (s, ro) for s, t, ro in self.bind_mounts("attnserve")}
        self.assertIn("/models", mounts)
        self.assertTrue(mounts["/models"][1], "/models must be read-only")
        self.assertTrue(os.path.isdir(mounts["/models"][0]))

    def test_prometheus_gets_its_config_and_rules_and_scrapes_attnserve(self):
        mounts = {t: s for s, t, _ in self.bind_mounts("prometheus")}
        command = flag_values(self.services["prometheus"].get("command"))
        config_file = command.get("config.file", "/etc/prometheus/prometheus.yml")
        host_dir = mounts[os.path.dirname(config_file)]
        self.assertEqual(os.path.realpath(host_dir), os.path.realpath(repo_path("deploy", "prometheus")))
        with open(os.path.join(host_dir, os.path.basename(config_file))) as f:
            config = yaml.safe_load(f)
        for rule_file in config.get("rule_files", []):
            self.assertTrue(os.path.isfile(os.path.join(host_dir, rule_file)), rule_file)
        _, metrics, _, _ = server_settings(self.services["attnserve"].get("command"))
        job = [j for j in config["scrape_configs"] if j["job_name"] == "attnserve"][0]
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        self.assertIn(f"attnserve:{metrics}", targets)

    def test_grafana_gets_the_datasource_and_the_dashboard(self):
        mounts = {t: s for s, t, _ in self.bind_mounts("grafana")}
        provisioning = mounts["/etc/grafana/provisioning"]
        self.assertEqual(os.path.realpath(provisioning),
                         os.path.realpath(repo_path("deploy", "grafana", "provisioning")))
        with open(os.path.join(provisioning, "datasources", "prometheus.yml")) as f:
            datasource = yaml.safe_load(f)["datasources"][0]
        m = re.match(r"^http://([^:/]+):(\d+)", datasource["url"])
        self.assertEqual(m.group(1), "prometheus")
        self.assertTrue(self.container_port("prometheus", int(m.group(2))))
        with open(os.path.join(provisioning, "dashboards", "attnserve.yml")) as f:
            provider = yaml.safe_load(f)["providers"][0]
        dashboards = mounts[provider["options"]["path"]]
        self.assertTrue(os.path.isfile(os.path.join(dashboards, "attnserve.json")))
        with open(os.path.join(dashboards, "attnserve.json")) as f:
            json.load(f)
        home = self.services["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
        if home:
            self.assertTrue(home.startswith(provider["options"]["path"] + "/"))
            self.assertTrue(os.path.isfile(os.path.join(dashboards, os.path.basename(home))))


# --- Kubernetes -------------------------------------------------------------------
#
# deploy/k8s: base/ (the built-in model, no volume), overlays/* (built on the
# base), monitoring/ (the Prometheus Operator's objects and the dashboard,
# applied beside either). Every check runs on what `kubectl kustomize` renders.

K8S = ("deploy", "k8s")
# Each kustomization under deploy/k8s: the kinds it renders.
# The workload: attnserve and its front proxy (whose configuration is a
# ConfigMap generated from deploy/haproxy/haproxy.cfg).
WORKLOAD_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
                  "ConfigMap"}
KUSTOMIZATIONS = {
    "base": WORKLOAD_KINDS,
    "overlays/model-repository": WORKLOAD_KINDS | {"PersistentVolumeClaim"},
    "monitoring": {"PodMonitor", "PrometheusRule", "ConfigMap"},
    "kserve": {"ServingRuntime", "InferenceService"},
}
API_VERSIONS = {"Deployment": "apps/v1", "Service": "v1", "HorizontalPodAutoscaler": "autoscaling/v2",
                "PodDisruptionBudget": "policy/v1", "NetworkPolicy": "networking.k8s.io/v1",
                "PersistentVolumeClaim": "v1", "PodMonitor": "monitoring.coreos.com/v1",
                "PrometheusRule": "monitoring.coreos.com/v1", "ConfigMap": "v1",
                "ServingRuntime": "serving.kserve.io/v1alpha1", "InferenceService": "serving.kserve.io/v1beta1"}
REQUIRED_FIELDS = {
    "Deployment": ["spec.selector.matchLabels", "spec.template.metadata.labels", "spec.template.spec.containers"],
    "Service": ["spec.selector", "spec.ports"],
    "HorizontalPodAutoscaler": ["spec.scaleTargetRef", "spec.maxReplicas", "spec.metrics"],
    "PodDisruptionBudget": ["spec.selector.matchLabels"],
    "NetworkPolicy": ["spec.podSelector.matchLabels", "spec.ingress"],
    "PersistentVolumeClaim": ["spec.accessModes", "spec.resources.requests.storage"],
    "PodMonitor": ["spec.selector.matchLabels", "spec.podMetricsEndpoints"],
    "PrometheusRule": ["spec.groups"],
    "ConfigMap": ["data"],
    "ServingRuntime": ["spec.supportedModelFormats", "spec.protocolVersions", "spec.containers"],
    "InferenceService": ["spec.predictor.model.modelFormat.name", "spec.predictor.model.runtime",
                         "spec.predictor.model.protocolVersion", "spec.predictor.model.storageUri"],
}
GRPC_CODES = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
              "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
              "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}
SERVER_CODES = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
SHED_CODES = {"RESOURCE_EXHAUSTED"}
CLIENT_CODES = {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED",
                "FAILED_PRECONDITION", "OUT_OF_RANGE", "ABORTED", "CANCELLED"}


def k8s_path(*parts):
    return repo_path(*K8S, *parts)


def kubectl(*args, stdin=None):
    work, env = kubectl_env()
    try:
        return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=300, env=env,
                              input=stdin)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def parse_objects(text, what):
    """{(kind, name): object} of a multi-document YAML text."""
    objects = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{what}: {key} twice"
            objects[key] = doc
    return objects


_RENDERED = {}


def render(directory):
    """{(kind, name): object} that `kubectl kustomize directory` builds."""
    if directory not in _RENDERED:
        done = kubectl("kustomize", directory)
        if done.returncode != 0:
            raise AssertionError(f"kubectl kustomize {directory} failed: {done.stderr}")
        _RENDERED[directory] = parse_objects(done.stdout, directory)
    return _RENDERED[directory]


def kustomization(name):
    with open(k8s_path(name, "kustomization.yaml")) as f:
        return yaml.safe_load(f)


def image_tag(image):
    name = image.split("@")[0]
    return name.rsplit(":", 1)[1] if ":" in name.split("/")[-1] else None


def rules_file_groups():
    return load_yaml("deploy", "prometheus", "rules", "attnserve.rules.yml")["groups"]


def run_promtool_on_groups(groups, work):
    """`promtool check rules` and `promtool test rules` with the shipped rules
    test (deploy/prometheus/tests/attnserve.rules.test.yml, copied unchanged)
    against `groups` written as the rules file it loads. Returns the two
    CompletedProcesses."""
    os.makedirs(os.path.join(work, "rules"))
    os.makedirs(os.path.join(work, "tests"))
    rules = os.path.join(work, "rules", "attnserve.rules.yml")
    with open(rules, "w") as f:
        yaml.safe_dump({"groups": groups}, f, sort_keys=False)
    test = os.path.join(work, "tests", "attnserve.rules.test.yml")
    shutil.copyfile(repo_path("deploy", "prometheus", "tests", "attnserve.rules.test.yml"), test)
    check = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True, timeout=300)
    tested = subprocess.run(["promtool", "test", "rules", test], capture_output=True, text=True, timeout=300)
    return check, tested


class Kustomizations(unittest.TestCase):
    def test_the_kustomizations_are_the_base_its_overlays_and_monitoring(self):
        found = set()
        for root, _, files in os.walk(k8s_path()):
            if "kustomization.yaml" in files:
                found.add(os.path.relpath(root, k8s_path()))
        self.assertEqual(found, set(KUSTOMIZATIONS), "a new kustomization needs its checks here")

    def test_kubectl_renders_each_kustomization_offline_with_the_kinds_it_is_for(self):
        for name, kinds in KUSTOMIZATIONS.items():
            with self.subTest(kustomization=name):
                self.assertEqual({k for k, _ in render(k8s_path(name))}, kinds)

    def test_every_manifest_file_is_rendered_by_a_kustomization(self):
        rendered = set()
        for name in KUSTOMIZATIONS:
            rendered |= set(render(k8s_path(name)))
        patches = {os.path.normpath(os.path.join(k8s_path(name), p["path"]))
                   for name in KUSTOMIZATIONS for p in kustomization(name).get("patchesJson6902", [])}
        files = 0
        for root, _, names in os.walk(k8s_path()):
            for n in names:
                path = os.path.join(root, n)
                if (not n.endswith(".yaml") or n == "kustomization.yaml" or path in patches):
                    continue
                with open(path) as f:
                    for key in parse_objects(f.read(), path):
                        files += 1
                        self.assertIn(key, rendered, f"{path}: {key} is in no kustomization")
        self.assertGreaterEqual(files, len(WORKLOAD_KINDS) + 3)

    def test_kubectl_parses_every_rendered_object_without_a_cluster(self):
        for name in KUSTOMIZATIONS:
            with self.subTest(kustomization=name):
                objects = render(k8s_path(name))
                text = yaml.safe_dump_all(list(objects.values()))
                done = kubectl("label", "--local", "-o", "json", "-f", "-", "attnserve.dev/checked=yes",
                               stdin=text)
                self.assertEqual(done.returncode, 0, done.stderr)
                items, decoder, out = [], json.JSONDecoder(), done.stdout.strip()
                while out:  # one JSON object per manifest, one after another
                    item, end = decoder.raw_decode(out)
                    items.extend(item.get("items", [item]))
                    out = out[end:].strip()
                for item in items:
                    self.assertEqual(item["metadata"]["labels"]["attnserve.dev/checked"], "yes")
                self.assertEqual({(i["kind"], i["metadata"]["name"]) for i in items}, set(objects))

    def test_every_object_has_the_required_fields_and_the_recommended_labels(self):
        for name in KUSTOMIZATIONS:
            for (kind, obj_name), obj in render(k8s_path(name)).items():
                what = f"{name}: {kind}/{obj_name}"
                self.assertEqual(obj["apiVersion"], API_VERSIONS[kind], what)
                labels = obj["metadata"]["labels"]
                self.assertEqual(labels["app.kubernetes.io/name"], "attnserve", what)
                self.assertEqual(labels["app.kubernetes.io/instance"], "attnserve", what)
                self.assertIn("app.kubernetes.io/component", labels, what)
                self.assertRegex(obj_name, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
                for path in REQUIRED_FIELDS[kind]:
                    node = obj
                    for part in path.split("."):
                        self.assertIn(part, node, f"{what}: {path}")
                        node = node[part]

    def test_the_images_entries_set_the_images_of_this_version_and_the_version_labels_follow_their_tags(self):
        entries = {e["name"]: e for e in kustomization("base")["images"]}
        files = {"attnserve": "deployment.yaml", "attnserve-proxy": "proxy-deployment.yaml"}
        self.assertEqual(set(entries), set(files), "one images: entry per Deployment's image")
        for deployment_name, file in files.items():
            entry = entries[deployment_name]
            self.assertEqual(str(entry["newTag"]), project_version(), "the images' tag is the project's VERSION")
            with open(k8s_path("base", file)) as f:
                raw = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"][0]["image"]
            self.assertEqual(entry["name"], raw, "the images: entry must name the container's image")
            for name in ("base", "overlays/model-repository"):
                deployment = render(k8s_path(name))[("Deployment", deployment_name)]
                image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
                self.assertEqual(image, f"{entry.get('newName', raw)}:{entry['newTag']}", name)
                self.assertTrue(image_is_pinned(image), image)
                for labels in (deployment["metadata"]["labels"],
                               deployment["spec"]["template"]["metadata"]["labels"]):
                    self.assertEqual(str(labels["app.kubernetes.io/version"]), image_tag(image), name)
                self.assertNotIn("app.kubernetes.io/version", deployment["spec"]["selector"]["matchLabels"],
                                 "a selector must not change with the version")

    def test_what_kustomize_edit_set_image_writes_moves_the_image_to_a_registry(self):
        # `kustomize edit set image attnserve=REGISTRY/attnserve:TAG` writes
        # newName and newTag into the base's images: entry; do the same to a copy.
        work = tempfile.mkdtemp(prefix="attnserve-kustomize-")
        try:
            # The same layout: the base includes ../../haproxy.
            copy = os.path.join(work, "k8s", "base")
            shutil.copytree(k8s_path("base"), copy)
            shutil.copytree(repo_path("deploy", "haproxy"), os.path.join(work, "haproxy"))
            config = kustomization("base")
            config["images"] = [{"name": "attnserve", "newName": "registry.invalid/team/attnserve",
                                 "newTag": "9.8.7"}]
            with open(os.path.join(copy, "kustomization.yaml"), "w") as f:
                yaml.safe_dump(config, f)
            deployment = render(copy)[("Deployment", "attnserve")]
            self.assertEqual(deployment["spec"]["template"]["spec"]["containers"][0]["image"],
                             "registry.invalid/team/attnserve:9.8.7")
        finally:
            shutil.rmtree(work, ignore_errors=True)


class KServe(unittest.TestCase):
    """deploy/k8s/kserve: attnserve as a KServe ServingRuntime and an
    InferenceService that uses it. KServe's CRDs are not available offline, so
    the objects are checked against KServe's documented fields by the checks
    here, not by KServe's own schema; the runtime's command line is run for
    real on a model repository laid out as KServe mounts one."""

    @classmethod
    def setUpClass(cls):
        objects = render(k8s_path("kserve"))
        cls.runtime = objects[("ServingRuntime", "attnserve")]
        cls.service = objects[("InferenceService", "attnserve")]
        cls.container = cls.runtime["spec"]["containers"][0]

    def test_the_inference_service_uses_the_runtime_for_a_format_and_protocol_it_declares(self):
        model = self.service["spec"]["predictor"]["model"]
        self.assertEqual(model["runtime"], self.runtime["metadata"]["name"])
        formats = {(f["name"], str(f.get("version", ""))) for f in self.runtime["spec"]["supportedModelFormats"]}
        self.assertIn((model["modelFormat"]["name"], str(model["modelFormat"].get("version", ""))), formats)
        self.assertIn(model["protocolVersion"], self.runtime["spec"]["protocolVersions"])
        # grpc-v2 is the Open Inference Protocol's gRPC form, which attnserve
        # serves on its gRPC port; KServe's REST v2 would need the HTTP port.
        self.assertEqual(self.runtime["spec"]["protocolVersions"], ["grpc-v2"])

    def test_the_one_routed_port_is_the_grpc_port_named_h2c(self):
        self.assertEqual(self.container["name"], "kserve-container")
        grpc, _, _, _ = server_settings(self.container["args"])
        self.assertEqual([(p["name"], p["containerPort"]) for p in self.container["ports"]], [("h2c", grpc)])

    def test_the_server_reads_the_models_where_kserve_mounts_them(self):
        self.assertEqual(flag_values(self.container["args"]).get("model_repository"), "/mnt/models")

    def test_the_image_is_this_versions_and_runs_as_the_images_non_root_user(self):
        self.assertEqual(self.container["image"], f"attnserve:{project_version()}")
        for obj in (self.runtime, self.service):
            self.assertEqual(str(obj["metadata"]["labels"]["app.kubernetes.io/version"]), project_version())
        _, user, _ = dockerfile_final_stage()
        security = self.container["securityContext"]
        self.assertTrue(security["runAsNonRoot"])
        self.assertEqual(str(security["runAsUser"]), user)
        self.assertFalse(security["allowPrivilegeEscalation"])
        self.assertTrue(security["readOnlyRootFilesystem"])

    def test_resources_fit_the_compute_threads_and_the_memory_budget(self):
        resources = self.container["resources"]
        self.assertEqual(resources["requests"], resources["limits"], "Guaranteed QoS, as the base")
        flags = flag_values(self.container["args"])
        self.assertEqual(float(resources["limits"]["cpu"]), int(flags["compute_threads"]))
        limit = resources["limits"]["memory"]
        self.assertRegex(limit, r"^\d+Gi$")
        self.assertLess(int(flags["max_rss_bytes"]), int(limit[:-2]) << 30)
        self.assertLess(int(flags["max_inflight_bytes"]), int(flags["max_rss_bytes"]))

    def test_the_runtimes_command_line_serves_a_repository_laid_out_as_kserve_mounts_it(self):
        # KServe's storage initializer puts storageUri's folder at /mnt/models:
        # here a folder with one model, and the runtime's own arguments but the
        # addresses (free loopback ports) and the folder.
        rng = np.random.default_rng()
        work = tempfile.mkdtemp(prefix="attnserve-kserve-")
        server = None
        try:
            d, heads = 32, 4
            folder = os.path.join(work, "models", "encoder")
            os.makedirs(folder)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({"layout": "torch_mha", "prefix": "attn.", "d_model": d, "num_heads": heads}, f)
            write_safetensors(os.path.join(folder, "model.safetensors"), {
                "attn.in_proj_weight": (rng.normal(size=(3 * d, d)) * 0.2, "F32"),
                "attn.in_proj_bias": (rng.normal(size=3 * d) * 0.2, "F32"),
                "attn.out_proj.weight": (rng.normal(size=(d, d)) * 0.2, "F32"),
                "attn.out_proj.bias": (rng.normal(size=d) * 0.2, "F32")})
            args = []
            for a in self.container["args"]:
                name = a.split("=", 1)[0]
                if name in ("--listen_address", "--metrics_address"):
                    continue  # the harness binds free loopback ports
                args.append(a.replace("/mnt/models", os.path.join(work, "models")))
            server = Server(ARGS.server, *args)
            server.wait_serving(timeout=120)
            sys.path.insert(0, PACKAGE_DIR)
            import attnserve  # noqa: E402  (the Python package, from this checkout)
            with attnserve.Client(server.target) as client:
                self.assertEqual([m.name for m in client.models()], ["encoder"])
                x = rng.normal(size=(1, 5, d)).astype(np.float32)
                out = client.attend(x, model="encoder").output
                self.assertEqual(out.shape, (1, 5, d))
                self.assertTrue(np.isfinite(out).all())
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(work, ignore_errors=True)


class Workload:
    """The checks of a kustomization that renders the attnserve workload."""

    KUSTOMIZATION = None

    @classmethod
    def setUpClass(cls):
        cls.objects = render(k8s_path(cls.KUSTOMIZATION))
        cls.deployment = cls.one("Deployment")
        cls.pod = cls.deployment["spec"]["template"]
        cls.pod_labels = cls.pod["metadata"]["labels"]
        cls.container = cls.pod["spec"]["containers"][0]
        cls.ports = {p["name"]: p["containerPort"] for p in cls.container["ports"]}
        cls.proxy = cls.one("Deployment", "proxy")
        cls.proxy_pod = cls.proxy["spec"]["template"]
        cls.proxy_container = cls.proxy_pod["spec"]["containers"][0]
        cls.proxy_ports = {p["name"]: p["containerPort"] for p in cls.proxy_container["ports"]}

    @classmethod
    def one(cls, kind, component="server"):
        """The one object of `kind` labelled with `component` (attnserve's
        "server", the front proxy's "proxy")."""
        found = [o for (k, _), o in cls.objects.items()
                 if k == kind and o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"{len(found)} {kind}s of {component}"
        return found[0]

    def all(self, kind):
        return [o for (k, _), o in self.objects.items() if k == kind]

    def selects(self, selector, pod_labels):
        labels = selector.get("matchLabels", selector)
        return bool(labels) and all(pod_labels.get(k) == v for k, v in labels.items())

    def assertSelects(self, selector, what):
        labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
        self.assertTrue(labels, f"{what}: empty selector")
        for k, v in labels.items():
            self.assertEqual(self.pod_labels.get(k), v, f"{what}: {k}={v} does not select the pods")
        for expr in selector.get("matchExpressions", []) if "matchLabels" in selector else []:
            self.fail(f"{what}: matchExpressions not checked: {expr}")

    def test_deployment_selects_its_pods_and_runs_a_pinned_image_as_non_root(self):
        self.assertSelects(self.deployment["spec"]["selector"], "Deployment")
        self.assertTrue(image_is_pinned(self.container["image"]), self.container["image"])
        self.assertNotIn("replicas", self.deployment["spec"], "the HPA owns the replica count")
        _, user, _ = dockerfile_final_stage()
        security = self.pod["spec"]["securityContext"]
        self.assertTrue(security["runAsNonRoot"])
        self.assertEqual(str(security["runAsUser"]), user)
        container_security = self.container["securityContext"]
        self.assertFalse(container_security["allowPrivilegeEscalation"])
        self.assertTrue(container_security["readOnlyRootFilesystem"])
        self.assertEqual(container_security["capabilities"]["drop"], ["ALL"])

    def test_resources_requests_and_limits_fit_the_compute_threads(self):
        resources = self.container["resources"]
        for section in ("requests", "limits"):
            self.assertIn("cpu", resources[section])
            self.assertIn("memory", resources[section])
        threads = int(flag_values(self.container["args"]).get("compute_threads", 0))
        self.assertGreater(threads, 0, "--compute_threads: 0 would follow the node's cores, not the limit")
        self.assertEqual(float(resources["limits"]["cpu"]), threads)

    def test_ports_match_the_flags_and_the_image(self):
        grpc, metrics, _, _ = server_settings(self.container["args"])
        self.assertEqual(self.ports, {"grpc": grpc, "metrics": metrics})
        exposed, _, _ = dockerfile_final_stage()
        self.assertLessEqual({grpc, metrics}, exposed)

    def test_grpc_probes_check_the_standard_health_service_on_the_grpc_port(self):
        grpc, _, _, _ = server_settings(self.container["args"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = self.container[probe]["grpc"]
            self.assertEqual(spec["port"], grpc, probe)
            self.assertIn(spec["port"], self.ports.values(), probe)
            self.assertIn(spec.get("service", ""), READY_SERVICES, probe)
        self.assertEqual(self.container["readinessProbe"]["grpc"]["service"], READY_SERVICES[0])
        self.assertEqual(self.container["livenessProbe"]["grpc"].get("service", ""), "")

    def test_grace_period_covers_pre_stop_lame_duck_and_drain(self):
        _, _, lame_duck, drain = server_settings(self.container["args"])
        command = self.container["lifecycle"]["preStop"]["exec"]["command"]
        self.assertEqual(command[0], "/bin/sleep")  # in debian:12-slim (coreutils)
        pre_stop = float(command[1])
        grace = self.pod["spec"]["terminationGracePeriodSeconds"]
        self.assertGreaterEqual(grace, pre_stop + lame_duck + drain + SHUTDOWN_MARGIN_SECONDS,
                                f"grace {grace} < preStop {pre_stop} + lame duck {lame_duck} + drain {drain}")
        liveness = self.container["livenessProbe"]
        # Health "" is NOT_SERVING from SIGTERM on: liveness must not kill a draining server.
        self.assertGreater(liveness["periodSeconds"] * liveness.get("failureThreshold", 3), lame_duck + drain)
        readiness = self.container["readinessProbe"]
        # The readiness probe notices NOT_SERVING within the lame duck.
        self.assertLessEqual(readiness["periodSeconds"] * readiness.get("failureThreshold", 3),
                             pre_stop + lame_duck)

    def test_the_replicas_have_only_a_headless_service_and_the_entry_is_the_proxys(self):
        proxy_labels = self.proxy_pod["metadata"]["labels"]
        to_replicas = [s for s in self.all("Service") if self.selects(s["spec"]["selector"], self.pod_labels)]
        to_proxy = [s for s in self.all("Service") if self.selects(s["spec"]["selector"], proxy_labels)]
        self.assertEqual(len(to_replicas) + len(to_proxy), len(self.all("Service")), "a Service selects nothing")
        # The replicas: one headless Service, for the proxy to resolve.
        self.assertEqual(len(to_replicas), 1)
        self.assertEqual(to_replicas[0]["spec"].get("clusterIP"), "None")
        # The entry: one Service with a cluster IP, in front of the proxy pods.
        self.assertEqual(len(to_proxy), 1)
        self.assertNotEqual(to_proxy[0]["spec"].get("clusterIP"), "None")
        self.assertEqual(to_proxy[0]["metadata"]["name"], "attnserve", "clients keep the address attnserve:PORT")
        for service, ports in [(to_replicas[0], self.ports), (to_proxy[0], self.proxy_ports)]:
            name = service["metadata"]["name"]
            for p in service["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                self.assertIn(target, list(ports) + list(ports.values()), f"Service/{name}")
                self.assertEqual(ports.get(target, target), ports["grpc"], f"Service/{name}")
                self.assertEqual(p.get("appProtocol"), "kubernetes.io/h2c")

    def test_hpa_scales_the_deployment_and_keeps_room_for_the_pdb(self):
        hpa = self.one("HorizontalPodAutoscaler")["spec"]
        ref = hpa["scaleTargetRef"]
        self.assertEqual((ref["apiVersion"], ref["kind"], ref["name"]),
                         ("apps/v1", "Deployment", self.deployment["metadata"]["name"]))
        self.assertGreaterEqual(hpa["minReplicas"], 2)
        self.assertGreater(hpa["maxReplicas"], hpa["minReplicas"])
        for metric in hpa["metrics"]:
            if metric["type"] == "Resource":
                self.assertIn(metric["resource"]["name"], self.container["resources"]["requests"],
                              "utilization needs a request")
        pdb = self.one("PodDisruptionBudget")["spec"]
        self.assertSelects(pdb["selector"], "PodDisruptionBudget")
        if "maxUnavailable" in pdb:
            self.assertLess(int(pdb["maxUnavailable"]), hpa["minReplicas"])
        else:
            self.assertLess(int(pdb["minAvailable"]), hpa["minReplicas"])

    def test_network_policy_lets_only_the_proxy_reach_grpc_and_only_prometheus_the_metrics_port(self):
        policy = self.one("NetworkPolicy")["spec"]
        self.assertSelects(policy["podSelector"], "NetworkPolicy")
        self.assertIn("Ingress", policy["policyTypes"])
        opened = {}
        for rule in policy["ingress"]:
            for p in rule.get("ports", []):
                port = self.ports.get(p["port"], p["port"])
                self.assertIn(port, self.ports.values(), f"NetworkPolicy port {p['port']}")
                opened.setdefault(port, []).append(rule.get("from"))
        self.assertIn(self.ports["grpc"], opened)
        # gRPC only from the proxy's pods: the proxy is the only way in.
        proxy_labels = self.proxy_pod["metadata"]["labels"]
        for sources in opened[self.ports["grpc"]]:
            self.assertTrue(sources, "the gRPC port is open to every pod, around the proxy")
            for peer in sources:
                self.assertNotIn("namespaceSelector", peer)
                self.assertNotIn("ipBlock", peer)
                self.assertTrue(self.selects(peer["podSelector"], proxy_labels), peer)
                self.assertFalse(self.selects(peer["podSelector"], self.pod_labels), peer)
        for sources in opened[self.ports["metrics"]]:
            self.assertTrue(sources, "the metrics port is open to every pod")
            for peer in sources:
                self.assertEqual(peer["podSelector"]["matchLabels"], {"app.kubernetes.io/name": "prometheus"})
        for rule in policy["ingress"]:
            self.assertTrue(rule.get("ports"), "an ingress rule without ports opens the metrics port too")

    def test_scrape_annotations_point_at_the_metrics_port(self):
        annotations = self.pod["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(int(annotations["prometheus.io/port"]), self.ports["metrics"])
        self.assertEqual(annotations["prometheus.io/path"], "/metrics")

    # --- the front proxy

    def proxy_env(self):
        """{name: value} of the proxy container's plain environment values,
        and {name: fieldPath} of those taken from the pod."""
        env = self.proxy_container["env"]
        return ({e["name"]: e["value"] for e in env if "value" in e},
                {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in env if "valueFrom" in e})

    def test_the_proxy_runs_the_shipped_config_from_the_configmap_generated_from_it(self):
        _, _, _, _, entrypoint, _ = proxy_dockerfile()
        config_in_image = entrypoint[entrypoint.index("-f") + 1]
        mounts = {m["name"]: m for m in self.proxy_container["volumeMounts"]}
        volumes = {v["name"]: v for v in self.proxy_pod["spec"]["volumes"]}
        [(name, mount)] = [(n, m) for n, m in mounts.items() if m["mountPath"] == os.path.dirname(config_in_image)]
        self.assertTrue(mount["readOnly"])
        config_map = self.objects[("ConfigMap", volumes[name]["configMap"]["name"])]
        self.assertEqual(config_map["data"], {os.path.basename(config_in_image): haproxy_config_text()},
                         "the ConfigMap is deploy/haproxy/haproxy.cfg, unchanged")
        self.assertRegex(config_map["metadata"]["name"], r"^attnserve-proxy-[a-z0-9]+$",
                         "a hashed name: a changed configuration rolls the proxy pods")

    def test_the_proxy_finds_the_replicas_through_the_headless_service_and_its_config_checks(self):
        values, fields = self.proxy_env()
        self.assertEqual(fields.get("POD_NAMESPACE"), "metadata.namespace")
        names = [e["name"] for e in self.proxy_container["env"]]
        self.assertLess(names.index("POD_NAMESPACE"), names.index("ATTNSERVE_REPLICAS_DNS"),
                        "$(POD_NAMESPACE) expands only a variable defined before it")
        grpc, _, _, _ = server_settings(self.container["args"])
        [headless] = [s for s in self.all("Service") if s["spec"].get("clusterIP") == "None"]
        self.assertEqual(values["ATTNSERVE_REPLICAS_DNS"],
                         f"{headless['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:{grpc}",
                         "HAProxy's resolvers need the full name (no search domains)")
        self.assertTrue(self.selects(headless["spec"]["selector"], self.pod_labels))
        env = {k: v.replace("$(POD_NAMESPACE)", "serving") for k, v in values.items()}
        done = haproxy_check(env)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertNotIn("WARNING", done.stdout + done.stderr)

    def test_the_proxy_ports_probes_and_shutdown_fit_its_config_and_image(self):
        values, _ = self.proxy_env()
        proxy = haproxy_settings()
        _, exposed, user, _, _, _ = proxy_dockerfile()
        self.assertEqual(self.proxy_ports, {"grpc": port_of(values["ATTNSERVE_PROXY_BIND"]),
                                            "stats": port_of(values["ATTNSERVE_PROXY_STATS_BIND"])})
        self.assertNotIn("metrics", self.proxy_ports, "the scrape configs keep ports named metrics for attnserve")
        self.assertLessEqual(set(self.proxy_ports.values()), exposed)
        self.assertEqual(self.proxy_container["readinessProbe"]["httpGet"]["path"], "/ready")
        self.assertEqual(self.proxy_container["livenessProbe"]["httpGet"]["path"], "/alive")
        for probe in ("readinessProbe", "livenessProbe"):
            port = self.proxy_container[probe]["httpGet"]["port"]
            self.assertEqual(self.proxy_ports.get(port, port), self.proxy_ports["stats"], probe)
        text = haproxy_config_text()
        self.assertRegex(text, r"(?m)^\s*monitor-uri /ready$")
        self.assertRegex(text, r"(?m)^\s*http-request return status 200 .* if \{ path /alive \}$")
        pre_stop = float(self.proxy_container["lifecycle"]["preStop"]["exec"]["command"][1])
        self.assertGreaterEqual(self.proxy_pod["spec"]["terminationGracePeriodSeconds"],
                                pre_stop + proxy["hard_stop_after"] + SHUTDOWN_MARGIN_SECONDS)
        security = self.proxy_pod["spec"]["securityContext"]
        self.assertTrue(security["runAsNonRoot"])
        self.assertEqual(str(security["runAsUser"]), user.split(":")[0])
        self.assertTrue(self.proxy_container["securityContext"]["readOnlyRootFilesystem"])
        self.assertEqual(self.proxy_container["securityContext"]["capabilities"]["drop"], ["ALL"])
        self.assertGreaterEqual(self.proxy["spec"]["replicas"], 2)
        pdb = self.one("PodDisruptionBudget", "proxy")["spec"]
        self.assertTrue(self.selects(pdb["selector"], self.proxy_pod["metadata"]["labels"]))
        self.assertLess(int(pdb["maxUnavailable"]), self.proxy["spec"]["replicas"])

    def test_the_proxy_has_a_slot_per_replica_and_queues_before_a_replica_sheds(self):
        proxy = haproxy_settings()
        hpa = self.one("HorizontalPodAutoscaler")["spec"]
        self.assertGreaterEqual(proxy["slots"], hpa["maxReplicas"], "server-template slots < maxReplicas")
        flags = flag_values(self.container["args"])
        self.assertLessEqual(proxy["maxconn"], int(flags["max_queued_requests"]),
                             "the proxy would send a replica more calls than it queues")
        _, _, lame_duck, _ = server_settings(self.container["args"])
        self.assertGreaterEqual(lame_duck, proxy["detection_seconds"],
                                "the lame duck must outlast the proxy's health checks' detection")

    def test_the_proxy_network_policy_opens_grpc_and_only_prometheus_reaches_its_stats(self):
        policy = self.one("NetworkPolicy", "proxy")["spec"]
        self.assertTrue(self.selects(policy["podSelector"], self.proxy_pod["metadata"]["labels"]))
        opened = {}
        for rule in policy["ingress"]:
            self.assertTrue(rule.get("ports"), "an ingress rule without ports opens every port")
            for p in rule["ports"]:
                opened.setdefault(self.proxy_ports.get(p["port"], p["port"]), []).append(rule.get("from"))
        self.assertEqual(set(opened), {self.proxy_ports["grpc"], self.proxy_ports["stats"]})
        self.assertEqual(opened[self.proxy_ports["grpc"]], [None], "gRPC from anywhere: the entry")
        for sources in opened[self.proxy_ports["stats"]]:
            self.assertTrue(sources)
            for peer in sources:
                self.assertEqual(peer["podSelector"]["matchLabels"], {"app.kubernetes.io/name": "prometheus"})


class Base(Workload, unittest.TestCase):
    KUSTOMIZATION = "base"

    def test_the_base_serves_the_built_in_model_and_mounts_no_volume(self):
        # A single-node cluster (kind, minikube) has no ReadOnlyMany storage:
        # a volume here would keep the pods Pending.
        self.assertNotIn("volumes", self.pod["spec"])
        self.assertNotIn("volumeMounts", self.container)
        self.assertNotIn("model_repository", flag_values(self.container["args"]))
        self.assertFalse(self.all("PersistentVolumeClaim"))


class ModelRepositoryOverlay(Workload, unittest.TestCase):
    KUSTOMIZATION = "overlays/model-repository"

    def test_model_repository_is_a_read_only_volume_at_models_that_the_server_serves(self):
        mounts = {m["name"]: m for m in self.container["volumeMounts"]}
        self.assertEqual(mounts["models"]["mountPath"], "/models")
        self.assertTrue(mounts["models"]["readOnly"])
        self.assertEqual(flag_values(self.container["args"])["model_repository"], mounts["models"]["mountPath"])
        volumes = {v["name"]: v for v in self.pod["spec"]["volumes"]}
        claim = volumes["models"]["persistentVolumeClaim"]
        self.assertTrue(claim["readOnly"])
        pvc = self.objects[("PersistentVolumeClaim", claim["claimName"])]
        self.assertEqual(pvc["spec"]["accessModes"], ["ReadOnlyMany"])

    def test_the_overlay_changes_only_the_model_repository_of_the_base(self):
        base = render(k8s_path("base"))
        self.assertEqual(set(self.objects) - set(base), {("PersistentVolumeClaim", "attnserve-models")})
        for key, obj in base.items():
            if key != ("Deployment", "attnserve"):
                self.assertEqual(self.objects[key], obj, key)
        ours = json.loads(json.dumps(self.deployment))
        pod = ours["spec"]["template"]["spec"]
        container = pod["containers"][0]
        del pod["volumes"], container["volumeMounts"]
        container["args"] = [a for a in container["args"] if not a.startswith("--model_repository=")]
        self.assertEqual(ours, base[("Deployment", "attnserve")])


class Monitoring(unittest.TestCase):
    """deploy/k8s/monitoring: the PodMonitor, the PrometheusRule and the
    dashboard ConfigMap, as rendered."""

    @classmethod
    def setUpClass(cls):
        cls.objects = render(k8s_path("monitoring"))
        cls.pod_labels = render(k8s_path("base"))[("Deployment", "attnserve")]["spec"]["template"]["metadata"][
            "labels"]

    def test_the_pod_monitor_scrapes_the_metrics_port_of_the_attnserve_pods(self):
        monitor = self.objects[("PodMonitor", "attnserve")]["spec"]
        for k, v in monitor["selector"]["matchLabels"].items():
            self.assertEqual(self.pod_labels.get(k), v, f"PodMonitor: {k}={v} does not select the pods")
        self.assertNotIn("matchExpressions", monitor["selector"])
        for endpoint in monitor["podMetricsEndpoints"]:
            self.assertEqual(endpoint["port"], "metrics")
            self.assertEqual(endpoint["path"], "/metrics")
        self.assertEqual(self.pod_labels[monitor["jobLabel"]], "attnserve")  # the rules' job

    def test_the_prometheus_rule_carries_the_groups_of_the_rules_file(self):
        rule = self.objects[("PrometheusRule", "attnserve")]
        self.assertEqual(rule["spec"]["groups"], rules_file_groups(),
                         "run deploy/k8s/monitoring/sync_rules.py")
        done = subprocess.run(["/usr/bin/python3", k8s_path("monitoring", "sync_rules.py"), "--check"],
                              capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stderr)

    def test_the_prometheus_rule_groups_pass_promtool_check_and_the_rules_tests(self):
        groups = self.objects[("PrometheusRule", "attnserve")]["spec"]["groups"]
        work = tempfile.mkdtemp(prefix="attnserve-rules-")
        try:
            check, tested = run_promtool_on_groups(groups, os.path.join(work, "rendered"))
            self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
            self.assertEqual(tested.returncode, 0, tested.stdout + tested.stderr)
            self.assertIn("SUCCESS", tested.stdout)
            # The control: the same run on groups whose shedding alert pages
            # fails, so the run above tested the rendered groups.
            broken = json.loads(json.dumps(groups))
            for group in broken:
                for rule in group["rules"]:
                    if rule.get("alert") == "AttnserveLoadShedding":
                        rule["labels"]["severity"] = "critical"
            _, tested = run_promtool_on_groups(broken, os.path.join(work, "broken"))
            self.assertNotEqual(tested.returncode, 0, tested.stdout)
            self.assertIn("AttnserveLoadShedding", tested.stdout + tested.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def test_the_dashboard_config_map_is_the_dashboard_for_grafanas_sidecar(self):
        config_map = self.objects[("ConfigMap", "attnserve-dashboard")]
        self.assertEqual(config_map["metadata"]["labels"]["grafana_dashboard"], "1")
        with open(repo_path("deploy", "grafana", "dashboards", "attnserve.json")) as f:
            dashboard = f.read()
        self.assertEqual(config_map["data"], {"attnserve.json": dashboard})
        self.assertEqual(json.loads(config_map["data"]["attnserve.json"])["uid"], "attnserve")


# --- Alerts and dashboard: the same classes of status codes -----------------------

def code_matchers(expr):
    """[(operator, {codes})] of the code label matchers in a PromQL expression."""
    return [(op, set(value.split("|"))) for op, value in re.findall(r'\bcode\s*(=~|!~|!=|=)\s*"([^"]*)"', expr)]


class AlertsAndDashboard(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.groups = rules_file_groups()
        cls.records = {r["record"]: r["expr"] for g in cls.groups for r in g["rules"] if "record" in r}
        cls.alerts = {r["alert"]: r for g in cls.groups for r in g["rules"] if "alert" in r}
        with open(repo_path("deploy", "grafana", "dashboards", "attnserve.json")) as f:
            cls.panels = {p["title"]: p for p in json.load(f)["panels"] if p["type"] != "row"}

    def test_the_classes_split_every_grpc_code_but_ok_once(self):
        self.assertEqual(len(GRPC_CODES), 17)
        classes = [SERVER_CODES, SHED_CODES, CLIENT_CODES, {"OK"}]
        self.assertEqual(set().union(*classes), GRPC_CODES)
        self.assertEqual(sum(len(c) for c in classes), len(GRPC_CODES))

    def test_the_recording_rules_count_each_class_with_its_codes(self):
        for record, codes in [("job:attnserve_request_errors:rate5m", SERVER_CODES),
                              ("job:attnserve_requests_shed:rate5m", SHED_CODES),
                              ("job:attnserve_request_client_errors:rate5m", CLIENT_CODES)]:
            self.assertEqual([c for _, c in code_matchers(self.records[record])], [codes], record)
        for record in ("job:attnserve_request_errors:ratio_rate5m", "job:attnserve_requests_shed:ratio_rate5m"):
            self.assertIn("- job:attnserve_request_client_errors:rate5m", self.records[record], record)

    def test_server_errors_page_shedding_warns_and_every_alert_has_a_runbook_section(self):
        self.assertIn("job:attnserve_request_errors:ratio_rate5m", self.alerts["AttnserveHighErrorRatio"]["expr"])
        self.assertEqual(self.alerts["AttnserveHighErrorRatio"]["labels"]["severity"], "critical")
        self.assertIn("job:attnserve_requests_shed:ratio_rate5m", self.alerts["AttnserveLoadShedding"]["expr"])
        self.assertEqual(self.alerts["AttnserveLoadShedding"]["labels"]["severity"], "warning")
        with open(repo_path("docs", "runbook.md")) as f:
            headings = re.findall(r"^#{1,6} (.+)$", f.read(), re.M)
        # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
        anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        for name, alert in self.alerts.items():
            self.assertIn(alert["labels"]["severity"], {"critical", "warning"}, name)
            url = alert["annotations"]["runbook_url"]
            self.assertEqual(url, f"docs/runbook.md#{name.lower()}", name)
            self.assertIn(url.split("#")[1], anchors, f"{name}: no section in docs/runbook.md")

    def test_the_dashboard_shows_server_errors_shedding_and_client_errors_apart(self):
        allowed = [{"OK"}, SERVER_CODES, SHED_CODES, CLIENT_CODES, SERVER_CODES | SHED_CODES]
        for title, panel in self.panels.items():
            for target in panel["targets"]:
                for _, codes in code_matchers(target["expr"]):
                    self.assertIn(codes, allowed, f"{title}: {target['expr']}")
        by_class = [code_matchers(t["expr"]) for t in self.panels["Errors by class"]["targets"]]
        self.assertEqual(by_class, [[("=~", SERVER_CODES)], [("=", SHED_CODES)], [("=~", CLIENT_CODES)]])
        for title, numerator in [("Server-error ratio", ("=~", SERVER_CODES)), ("Load shed ratio", ("=", SHED_CODES))]:
            # Of the calls that were not client errors, as the alerts count.
            self.assertEqual(code_matchers(self.panels[title]["targets"][0]["expr"]),
                             [numerator, ("!~", CLIENT_CODES)], title)
        self.assertEqual(code_matchers(self.panels["Client-error ratio"]["targets"][0]["expr"]),
                         [("=~", CLIENT_CODES)])
        self.assertEqual(code_matchers(self.panels["Client errors by code"]["targets"][0]["expr"]),
                         [("=~", CLIENT_CODES)])


# --- The in-cluster Prometheus config, run for real ---------------------------------

def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KubernetesScrapeConfig(unittest.TestCase):
    """deploy/k8s/prometheus/prometheus.yml with its pod discovery replaced by
    static targets that carry the labels Kubernetes discovery would give the
    rendered base Deployment's pods (Debian's Prometheus has no Kubernetes
    discovery): its relabelling must keep exactly the metrics port of running
    attnserve pods. It waits for what it can observe, with generous deadlines
    (a busy machine is slow), and times nothing."""

    def test_a_real_prometheus_keeps_only_the_metrics_port_of_running_pods(self):
        deployment = render(k8s_path("base"))[("Deployment", "attnserve")]
        pod = deployment["spec"]["template"]
        meta = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
                for k, v in pod["metadata"]["labels"].items()}
        meta.update({f"__meta_kubernetes_pod_annotation_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
                     for k, v in pod["metadata"]["annotations"].items()})
        meta.update(__meta_kubernetes_namespace="serving", __meta_kubernetes_pod_name="attnserve-0")
        server = Server(ARGS.server, "--compute_threads=1")
        work = tempfile.mkdtemp(prefix="attnserve-k8s-prom-")
        prometheus = None
        try:
            deadline = time.monotonic() + 120
            metrics_port = None
            while metrics_port is None and time.monotonic() < deadline:
                for line in list(server.log):
                    m = re.search(r"metrics on port (\d+)", line)
                    if m:
                        metrics_port = int(m.group(1))
                time.sleep(0.02)
            self.assertIsNotNone(metrics_port, "no 'metrics on port N' line")
            source = repo_path("deploy", "k8s", "prometheus", "prometheus.yml")
            config = load_yaml("deploy", "k8s", "prometheus", "prometheus.yml")
            job = [j for j in config["scrape_configs"] if j["job_name"] == "attnserve"][0]
            self.assertEqual(job.pop("kubernetes_sd_configs"), [{"role": "pod"}])

            def target(port, port_name, phase="Running", pod_name="attnserve-0"):
                labels = dict(meta, __meta_kubernetes_pod_container_port_name=port_name,
                              __meta_kubernetes_pod_phase=phase, __meta_kubernetes_pod_name=pod_name)
                return {"targets": [f"127.0.0.1:{port}"], "labels": labels}

            job["static_configs"] = [
                target(metrics_port, "metrics"),
                target(server.port, "grpc"),                                  # dropped: not metrics
                target(free_port(), "metrics", "Pending", "attnserve-1"),     # dropped: not running
            ]
            other = dict(target(free_port(), "metrics", pod_name="other-0"))
            other["labels"] = {k: ("other" if k.endswith("app_kubernetes_io_name") else v)
                               for k, v in other["labels"].items()}
            job["static_configs"].append(other)                               # dropped: not attnserve
            config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
            config["rule_files"] = [os.path.normpath(os.path.join(os.path.dirname(source), r))
                                    for r in config["rule_files"]]
            path = os.path.join(work, "prometheus.yml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            check = subprocess.run(["promtool", "check", "config", path], capture_output=True, text=True,
                                   timeout=300)
            self.assertEqual(check.returncode, 0, check.stdout + check.stderr)

            port = free_port()
            with open(os.path.join(work, "prometheus.log"), "w") as log:
                prometheus = subprocess.Popen(
                    ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={work}/data",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    stdout=subprocess.DEVNULL, stderr=log)
            deadline = time.monotonic() + 120
            active = None
            while time.monotonic() < deadline:
                if prometheus.poll() is not None:
                    with open(os.path.join(work, "prometheus.log")) as log:
                        self.fail(f"prometheus exited: {log.read()}")
                try:
                    reply = json.loads(http_get(f"http://127.0.0.1:{port}/api/v1/targets"))
                    active = reply["data"]["activeTargets"]
                    if active and all(t["health"] == "up" for t in active):
                        break
                except OSError:
                    pass
                time.sleep(0.25)
            self.assertIsNotNone(active, "prometheus never answered")
            self.assertEqual(len(active), 1, active)
            self.assertEqual(active[0]["scrapeUrl"], f"http://127.0.0.1:{metrics_port}/metrics")
            self.assertEqual(active[0]["health"], "up", active[0])
            self.assertEqual(active[0]["labels"]["job"], "attnserve")
            self.assertEqual(active[0]["labels"]["pod"], "attnserve-0")
            self.assertEqual(active[0]["labels"]["namespace"], "serving")
        finally:
            stop_process(prometheus)
            server.stop()
            shutil.rmtree(work, ignore_errors=True)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--server", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()

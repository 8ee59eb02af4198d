#!/usr/bin/python3
"""The deployment files, checked offline: yamllint over deploy/; the compose
file through docker-compose's own validation and against the files it mounts;
the Kubernetes manifests through kubectl (kustomize and a local parse, no
cluster) and through schema and consistency checks of our own (required
fields, labels and selectors, probe and container ports, the shutdown budget,
scrape configuration); the in-cluster Prometheus config run by a real
Prometheus against a real attnserve.

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

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from harness import Server, stop_process  # noqa: E402

ARGS = None
READY_SERVICES = ("attnserve.v1.AttentionService", "")
# Beyond the server's own budget: the 0.5 s flush after the drain, process exit.
SHUTDOWN_MARGIN_SECONDS = 2


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
    """The attnserve binary's defaults, from server/server_options.h."""
    with open(repo_path("server", "server_options.h")) as f:
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
                              capture_output=True, text=True, timeout=120)
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
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, DOCKER_HOST="unix:///nonexistent.sock"))
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def test_services_are_attnserve_prometheus_and_grafana_with_pinned_images(self):
        self.assertEqual(set(self.services), {"attnserve", "prometheus", "grafana"})
        for name, service in self.services.items():
            self.assertTrue(image_is_pinned(service["image"]), f"{name}: {service['image']}")
        build = self.services["attnserve"]["build"]
        context = os.path.normpath(os.path.join(self.dir, build["context"]))
        self.assertTrue(os.path.isfile(os.path.join(context, build.get("dockerfile", "Dockerfile"))))
        self.assertEqual(os.path.realpath(context), os.path.realpath(ARGS.repo))

    def test_attnserve_ports_match_its_flags_and_the_image(self):
        grpc, metrics, lame_duck, drain = server_settings(self.services["attnserve"].get("command"))
        exposed, _, _ = dockerfile_final_stage()
        self.assertLessEqual({grpc, metrics}, exposed)
        self.assertTrue(self.container_port("attnserve", grpc))
        self.assertTrue(self.container_port("attnserve", metrics))
        self.assertGreaterEqual(seconds(self.services["attnserve"]["stop_grace_period"]),
                                lame_duck + drain + SHUTDOWN_MARGIN_SECONDS)

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

class Kubernetes(unittest.TestCase):
    DIR = ("deploy", "k8s")

    @classmethod
    def setUpClass(cls):
        cls.dir = repo_path(*cls.DIR)
        cls.objects = {}  # (kind, name) -> object
        cls.files = {}    # (kind, name) -> file name
        for name in sorted(os.listdir(cls.dir)):
            if not name.endswith(".yaml") or name == "kustomization.yaml":
                continue
            with open(os.path.join(cls.dir, name)) as f:
                for doc in yaml.safe_load_all(f):
                    if doc:
                        key = (doc["kind"], doc["metadata"]["name"])
                        assert key not in cls.objects, f"{key} twice"
                        cls.objects[key] = doc
                        cls.files[key] = name
        cls.kustomization = load_yaml(*cls.DIR, "kustomization.yaml")
        cls.deployment = cls.one("Deployment")
        cls.pod = cls.deployment["spec"]["template"]
        cls.pod_labels = cls.pod["metadata"]["labels"]
        cls.container = cls.pod["spec"]["containers"][0]
        cls.ports = {p["name"]: p["containerPort"] for p in cls.container["ports"]}

    @classmethod
    def one(cls, kind):
        found = [o for (k, _), o in cls.objects.items() if k == kind]
        assert len(found) == 1, f"{len(found)} {kind}s"
        return found[0]

    def all(self, kind):
        return [o for (k, _), o in self.objects.items() if k == kind]

    def assertSelects(self, selector, what):
        labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
        self.assertTrue(labels, f"{what}: empty selector")
        for k, v in labels.items():
            self.assertEqual(self.pod_labels.get(k), v, f"{what}: {k}={v} does not select the pods")
        for expr in selector.get("matchExpressions", []) if "matchLabels" in selector else []:
            self.fail(f"{what}: matchExpressions not checked: {expr}")

    # kubectl, offline

    def kubectl(self, *args, stdin=None):
        work, env = kubectl_env()
        try:
            return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=120,
                                  env=env, input=stdin)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def test_kubectl_builds_the_kustomization_offline(self):
        done = self.kubectl("kustomize", self.dir)
        self.assertEqual(done.returncode, 0, done.stderr)
        built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout) if d}
        listed = {k for k, f in self.files.items() if f in self.kustomization["resources"]}
        self.assertEqual(built, listed)

    def test_kubectl_parses_every_manifest_without_a_cluster(self):
        files = [os.path.join(self.dir, f) for f in sorted(set(self.files.values()))]
        args = ["label", "--local", "-o", "json", "attnserve.dev/checked=yes"]
        for f in files:
            args += ["-f", f]
        done = self.kubectl(*args)
        self.assertEqual(done.returncode, 0, done.stderr)
        items, decoder, text = [], json.JSONDecoder(), done.stdout.strip()
        while text:  # one JSON object per manifest, one after another
            item, end = decoder.raw_decode(text)
            items.extend(item.get("items", [item]))
            text = text[end:].strip()
        for item in items:
            self.assertEqual(item["metadata"]["labels"]["attnserve.dev/checked"], "yes")
        self.assertEqual({(i["kind"], i["metadata"]["name"]) for i in items}, set(self.objects))

    # Our own schema and consistency checks

    def test_every_object_has_the_required_fields(self):
        required = {
            "Deployment": ["spec.selector.matchLabels", "spec.template.metadata.labels",
                           "spec.template.spec.containers"],
            "Service": ["spec.selector", "spec.ports"],
            "HorizontalPodAutoscaler": ["spec.scaleTargetRef", "spec.maxReplicas", "spec.metrics"],
            "PodDisruptionBudget": ["spec.selector.matchLabels"],
            "NetworkPolicy": ["spec.podSelector.matchLabels", "spec.ingress"],
            "PersistentVolumeClaim": ["spec.accessModes", "spec.resources.requests.storage"],
            "PodMonitor": ["spec.selector.matchLabels", "spec.podMetricsEndpoints"],
        }
        versions = {"Deployment": "apps/v1", "Service": "v1", "HorizontalPodAutoscaler": "autoscaling/v2",
                    "PodDisruptionBudget": "policy/v1", "NetworkPolicy": "networking.k8s.io/v1",
                    "PersistentVolumeClaim": "v1", "PodMonitor": "monitoring.coreos.com/v1"}
        self.assertEqual({k for k, _ in self.objects}, set(required))
        for (kind, name), obj in self.objects.items():
            self.assertEqual(obj["apiVersion"], versions[kind], f"{kind}/{name}")
            self.assertEqual(obj["metadata"]["labels"]["app.kubernetes.io/name"], "attnserve")
            self.assertRegex(name, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
            for path in required[kind]:
                node = obj
                for part in path.split("."):
                    self.assertIn(part, node, f"{kind}/{name}: {path}")
                    node = node[part]

    def test_kustomization_lists_every_manifest_but_the_operator_one(self):
        resources = self.kustomization["resources"]
        for r in resources:
            self.assertTrue(os.path.isfile(os.path.join(self.dir, r)), r)
        self.assertEqual(set(resources), set(self.files.values()) - {"podmonitor.yaml"})

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

    def test_model_repository_is_a_read_only_volume_at_models(self):
        mounts = {m["name"]: m for m in self.container["volumeMounts"]}
        self.assertEqual(mounts["models"]["mountPath"], "/models")
        self.assertTrue(mounts["models"]["readOnly"])
        volumes = {v["name"]: v for v in self.pod["spec"]["volumes"]}
        claim = volumes["models"]["persistentVolumeClaim"]
        self.assertTrue(claim["readOnly"])
        pvc = self.objects[("PersistentVolumeClaim", claim["claimName"])]
        self.assertEqual(pvc["spec"]["accessModes"], ["ReadOnlyMany"])

    def test_services_select_the_pods_a_headless_one_for_client_side_balancing(self):
        services = {s["metadata"]["name"]: s for s in self.all("Service")}
        headless = [s for s in services.values() if s["spec"].get("clusterIP") == "None"]
        cluster_ip = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
        self.assertEqual(len(headless), 1)
        self.assertEqual(len(cluster_ip), 1)
        self.assertEqual(cluster_ip[0]["spec"].get("type", "ClusterIP"), "ClusterIP")
        for name, s in services.items():
            self.assertSelects(s["spec"]["selector"], f"Service/{name}")
            for p in s["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                self.assertIn(target, list(self.ports) + list(self.ports.values()), f"Service/{name}")
                self.assertEqual(self.ports.get(target, target), self.ports["grpc"])
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

    def test_network_policy_lets_only_prometheus_reach_the_metrics_port(self):
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
        for sources in opened[self.ports["metrics"]]:
            self.assertTrue(sources, "the metrics port is open to every pod")
            for peer in sources:
                self.assertEqual(peer["podSelector"]["matchLabels"], {"app.kubernetes.io/name": "prometheus"})
        for rule in policy["ingress"]:
            self.assertTrue(rule.get("ports"), "an ingress rule without ports opens the metrics port too")

    def test_scrape_configuration_points_at_the_metrics_port(self):
        annotations = self.pod["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(int(annotations["prometheus.io/port"]), self.ports["metrics"])
        self.assertEqual(annotations["prometheus.io/path"], "/metrics")
        monitor = self.one("PodMonitor")["spec"]
        self.assertSelects(monitor["selector"], "PodMonitor")
        for endpoint in monitor["podMetricsEndpoints"]:
            self.assertEqual(endpoint["port"], "metrics")
            self.assertEqual(endpoint["path"], "/metrics")
        self.assertEqual(self.pod_labels[monitor["jobLabel"]], "attnserve")  # the rules' job


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
    Deployment's pods (Debian's Prometheus has no Kubernetes discovery): its
    relabelling must keep exactly the metrics port of running attnserve pods."""

    def test_a_real_prometheus_keeps_only_the_metrics_port_of_running_pods(self):
        started = time.monotonic()
        deployment = load_yaml("deploy", "k8s", "deployment.yaml")
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
            deadline = time.monotonic() + 30
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
                                   timeout=60)
            self.assertEqual(check.returncode, 0, check.stdout + check.stderr)

            port = free_port()
            with open(os.path.join(work, "prometheus.log"), "w") as log:
                prometheus = subprocess.Popen(
                    ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={work}/data",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    stdout=subprocess.DEVNULL, stderr=log)
            deadline = time.monotonic() + 30
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
        self.assertLess(time.monotonic() - started, 60)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--server", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()

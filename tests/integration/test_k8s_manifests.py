"""The Kubernetes manifests (infra/k8s): every overlay renders with `kubectl kustomize`,
validates offline against the Kubernetes schemas, and keeps the deployment's promises
(warm rollouts, drain, no root, limits, secrets by reference). No cluster is needed."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache

import pytest
import yaml

from consumers.inference.settings import InferenceSettings
from events import subjects, topology
from infra import nats_auth, redis_auth
from tests.conftest import REPO

K8S = REPO / "infra" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
#: Validated against the schemas of these Kubernetes versions (bundled with kubernetes-validate).
K8S_VERSIONS = ("1.30.0", "1.33.0")
#: Custom resources: no bundled schema; their fields are asserted below instead.
CRD_KINDS = {"ScaledObject", "PodMonitor", "ServiceMonitor"}
SECRET_ENV = re.compile(r"PASSWORD|API_KEYS|REDIS_URL|TOKEN|SECRET")

pytestmark = pytest.mark.timeout(120)


@cache
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not installed: these tests render infra/k8s with `kubectl kustomize` "
            "(kubectl >= 1.27, built-in kustomize). Install kubectl and run again."
        )
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs) -> dict[str, dict]:
    """Every pod template: Deployments and Jobs."""
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "Job")
    }


def container(docs, deployment: str) -> dict:
    [c] = of_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def config(docs) -> dict:
    return of_kind(docs, "ConfigMap")["arena-config"]["data"]


@pytest.fixture(params=OVERLAYS)
def docs(request):
    return render(request.param)


def test_there_are_cpu_and_gpu_overlays():
    assert {"cpu", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = render(overlay)
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {exc}")
        checked += 1
    assert checked >= 15


def test_every_role_of_the_topology_is_a_deployment_running_that_role(docs):
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == set(topology.role_names())
    images = set()
    for name in deployments:
        c = container(docs, name)
        assert c["args"] == [name]
        images.add(c["image"])
    assert len(images) == 1  # one image, the role is its argument
    assert of_kind(docs, "Service")["gateway"]["spec"]["selector"] == {"app.kubernetes.io/name": "gateway"}


def test_rollouts_never_take_a_pod_away_first_and_every_deployment_has_a_disruption_budget(docs):
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for name, d in of_kind(docs, "Deployment").items():
        strategy = d["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0, name
        assert pdbs[name]["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]


def test_inference_drains_within_its_grace_period(docs):
    spec = of_kind(docs, "Deployment")["inference"]["spec"]["template"]["spec"]
    c = container(docs, "inference")
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    assert pre_stop == 15  # the seed's
    drain = env_of(c).get("ARENA_DRAIN_GRACE_S", {}).get("value")
    drain_s = float(drain) if drain else InferenceSettings.model_fields["drain_grace_s"].default
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain_s


def test_probes_readiness_on_readyz_liveness_on_healthz_on_the_right_ports(docs):
    metrics_port = int(config(docs)["ARENA_METRICS_PORT"])
    for name in of_kind(docs, "Deployment"):
        c = container(docs, name)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        port = ports[c["readinessProbe"]["httpGet"]["port"]]
        assert port == (8000 if name == "gateway" else metrics_port), name
    startup = container(docs, "inference")["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # slow model loads


def test_the_model_cache_is_a_read_write_many_claim_mounted_read_only(docs):
    claims = of_kind(docs, "PersistentVolumeClaim")
    spec = of_kind(docs, "Deployment")["inference"]["spec"]["template"]["spec"]
    [volume] = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    claim = claims[volume["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    [mount] = [m for m in container(docs, "inference")["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert mount["mountPath"] == config(docs)["ARENA_MODELS_DIR"]


def test_no_container_runs_as_root_or_writes_its_root_filesystem(docs):
    for where, spec in pod_specs(docs).items():
        pod = spec.get("securityContext", {})
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = {**pod, **c.get("securityContext", {})}
            assert sc.get("runAsNonRoot") is True, where
            assert sc.get("runAsUser", 1) != 0, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), where


def test_every_container_has_requests_and_limits(docs):
    for where, spec in pod_specs(docs).items():
        for c in spec["containers"]:
            for key in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][key]), (where, key)


def test_only_the_gpu_overlay_asks_for_a_gpu():
    for overlay in OVERLAYS:
        resources = container(render(overlay), "inference")["resources"]
        wants = "nvidia.com/gpu" in resources["limits"]
        assert wants == (overlay == "gpu"), overlay
        if wants:
            assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    gpu_models = yaml.safe_load(of_kind(render("gpu"), "ConfigMap")["arena-models"]["data"]["models.yaml"])
    assert all(m.get("device", "cuda").startswith("cuda") for m in gpu_models["models"] if "path" in m)


def test_secrets_are_referenced_never_inlined_and_each_role_has_its_own_nats_user(docs):
    assert not of_kind(docs, "Secret"), "Secrets are created by the operator, not shipped in the manifests"
    assert not any(SECRET_ENV.search(k) for k in config(docs))
    for where, spec in pod_specs(docs).items():
        for c in spec["containers"]:
            env = env_of(c)
            for name, e in env.items():
                if SECRET_ENV.search(name):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (where, name)
            user = env["ARENA_NATS_USER"]["value"]
            assert user in nats_auth.users(), where
            ref = env["ARENA_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": nats_auth.SECRET_NAME, "key": user}, where
            if where.startswith("Deployment/"):
                assert user == c["args"][0], where  # a role runs as its own user
    assert container(docs, "gateway") and "ARENA_API_KEYS" in env_of(container(docs, "gateway"))


def test_upstream_keys_come_from_an_optional_secret_mounted_read_only_in_inference_alone(docs):
    """An upstream model's key (docs/upstream.md) is a file of the Secret
    arena-upstream-keys, named in the models config as `api_key_file`: mounted read-only
    where the worker's user can read it, in the inference pods only; optional, so the
    manifests apply without one."""
    specs = pod_specs(docs)
    mounting = {
        where
        for where, spec in specs.items()
        for v in spec.get("volumes", [])
        if v.get("secret", {}).get("secretName") == "arena-upstream-keys"
    }
    assert mounting == {"Deployment/inference"}
    spec = specs["Deployment/inference"]
    [volume] = [v for v in spec["volumes"] if v["name"] == "upstream-keys"]
    assert volume["secret"]["optional"] is True
    assert volume["secret"]["defaultMode"] & 0o040 and not volume["secret"]["defaultMode"] & 0o007  # group only
    [mount] = [m for m in container(docs, "inference")["volumeMounts"] if m["name"] == "upstream-keys"]
    assert mount == {"name": "upstream-keys", "mountPath": "/run/secrets/arena-upstream", "readOnly": True}


def test_each_role_that_uses_redis_connects_as_its_own_redis_user_and_no_other_gets_redis(docs):
    with_redis = set()
    for where, spec in pod_specs(docs).items():
        for c in spec["containers"]:
            if "REDIS_URL" not in env_of(c):
                continue
            ref = env_of(c)["REDIS_URL"]["valueFrom"]["secretKeyRef"]
            assert where.startswith("Deployment/") and ref == {"name": redis_auth.SECRET_NAME, "key": c["args"][0]}
            with_redis.add(c["args"][0])
    assert with_redis == set(redis_auth.with_keys()) == {"gateway", "delivery", "leaderboard"}
    secret = redis_auth.secret_manifest()
    assert with_redis < set(secret["stringData"]) and redis_auth.ACL_FILE_KEY in secret["stringData"]


def test_the_roles_leave_the_topology_to_the_operator_s_job(docs):
    assert config(docs)["ARENA_MANAGE_TOPOLOGY"] == "false"
    [job] = of_kind(docs, "Job").values()
    [c] = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["arena", "topology"]
    assert env_of(c)["ARENA_NATS_USER"]["value"] == nats_auth.OPERATOR


def test_prometheus_scrapes_every_process_on_a_port_it_listens_on(docs):
    for name, d in of_kind(docs, "Deployment").items():
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        ports = {p["containerPort"] for p in container(docs, name)["ports"]}
        assert int(annotations["prometheus.io/port"]) in ports, name


def test_the_pod_monitor_scrapes_every_deployment_and_carries_the_alert_rules(docs):
    monitoring = render("../monitoring")
    [monitor] = of_kind(monitoring, "PodMonitor").values()
    [selected] = monitor["spec"]["selector"]["matchExpressions"]
    assert set(selected["values"]) == set(of_kind(docs, "Deployment"))
    endpoints = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for name in of_kind(docs, "Deployment"):
        assert {p["name"] for p in container(docs, name)["ports"]} & endpoints, name
    [rule] = of_kind(monitoring, "PrometheusRule").values()
    assert (
        rule["spec"]["groups"] == yaml.safe_load((REPO / "infra" / "monitoring" / "alerts.yml").read_text())["groups"]
    )


def test_keda_scales_inference_and_filter_on_their_durable_s_lag(docs):
    scaled = of_kind(docs, "ScaledObject")
    assert set(scaled) == {"inference", "filter"}
    deployments = of_kind(docs, "Deployment")
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
        [trigger] = so["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "nats-jetstream"
        assert meta["stream"] == subjects.STREAM and meta["consumer"] == topology.role(name).durable
        assert meta["account"] == "$G" and int(meta["lagThreshold"]) > 0
        assert meta["natsServerMonitoringEndpoint"].endswith(":8222")


def test_the_gateway_scales_on_cpu(docs):
    hpa = of_kind(docs, "HorizontalPodAutoscaler")["gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"


def test_the_image_runs_as_a_user_without_weights_and_torch_pinned_as_the_project_pins_it():
    dockerfile = (K8S / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    pin = re.search(r'"torch==([\d.]+)"', pyproject).group(1)
    assert f"ARG TORCH_VERSION={pin}" in dockerfile
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)
    assert "ARG TORCH_INDEX=" in dockerfile  # CPU and CUDA variants
    assert "pip install -e ." in dockerfile  # the project's own files
    copied = re.findall(r"^COPY (?!--from)(\S+)", dockerfile, re.M)
    assert not any("model" in c or "shared" in c for c in copied), copied
    assert 'ENTRYPOINT ["arena", "run"]' in dockerfile

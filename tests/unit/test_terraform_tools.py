"""The tools over infra/: variable validation through `terraform plan`, `terraform fmt`, checkov (infra/check.sh)
and the Helm chart (rendered, and its settings file loaded by Tidal)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.terraform_hcl import (
    CHART,
    ROOT,
    TF,
    load_dir,
)


def _terraform() -> str:
    tf = shutil.which("terraform")
    if not tf:
        pytest.skip("terraform is not on PATH (install Terraform >= 1.9 to run this check)")
    return tf


def _plan_variables(tmp_path: Path, tfvars: str) -> subprocess.CompletedProcess:
    """`terraform plan` of variables.tf alone: needs no provider or registry, and evaluates every
    variable validation against the given tfvars."""
    tf = _terraform()
    shutil.copy(TF / "variables.tf", tmp_path / "variables.tf")
    (tmp_path / "terraform.tfvars").write_text(tfvars)
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    init = subprocess.run(
        [tf, "init", "-backend=false", "-input=false", "-no-color"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    return subprocess.run(
        [tf, "plan", "-input=false", "-no-color", "-lock=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )


# The example leaves the one secret variable out on purpose; the tests supply a throw-away client.
EXAMPLE = (
    TF / "terraform.tfvars.example"
).read_text() + '\ngateway_clients = [{ client_id = "test", key = "0123456789abcdef0123" }]\n'


def test_tfvars_example_passes_validation(tmp_path):
    plan = _plan_variables(tmp_path, EXAMPLE)
    assert plan.returncode == 0, plan.stdout + plan.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        (('update_strategy = "restart"', 'update_strategy = "hot-swap"'), "must be one of lora, restart, reload, nccl"),
        (
            ('instance_type   = "g6e.xlarge"\n  },\n]', 'instance_type   = "p5.48xlarge"\n  },\n]'),
            "must be one of fleet_node_group.instance_types",
        ),
        (('["203.0.113.0/24"]', '["0.0.0.0/0"]'), "must not contain 0.0.0.0/0"),
        (('tag        = "0.1.0"', 'tag        = "latest"'), "immutable tag"),
        (('name            = "tabfull"', 'name            = "tab"'), "must be unique"),
        (('key = "0123456789abcdef0123"', 'key = "short"'), "key at least 16 characters"),
        # the gateway: TLS unless plain HTTP is asked for, and never plain HTTP to the whole internet
        (
            ('gateway_certificate_arn = "arn:aws:acm:', 'gateway_certificate_arn = "" # "arn:aws:acm:'),
            "gateway_certificate_arn is empty",
        ),
        (
            (
                'gateway_certificate_arn = "arn:aws:acm:',
                'gateway_allow_plain_http = true\ngateway_certificate_arn = "" # "arn:aws:acm:',
            ),
            "contains 0.0.0.0/0 while the gateway serves plain HTTP",
        ),
        (('gateway_allowed_cidrs   = ["0.0.0.0/0"]', ""), '"gateway_allowed_cidrs" is not set, and has no default value'),
        (('[{ client_id = "test", key = "0123456789abcdef0123" }]', "[]"), "must list at least one API client"),
        (('flywheel = { loop = "chained" }', 'admin_token = "x"'), "tidal_settings may not set models"),
    ],
)
def test_bad_variables_are_refused_with_a_clear_message(tmp_path, change, message):
    old, new = change
    assert old in EXAMPLE
    plan = _plan_variables(tmp_path, EXAMPLE.replace(old, new, 1))
    assert plan.returncode != 0
    assert message in " ".join((plan.stdout + plan.stderr).split())


# ---- suppressions, format, checkov -------------------------------------------------------------


def test_every_checkov_suppression_is_justified():
    skips = []
    for f in TF.rglob("*.tf"):
        for line in f.read_text().splitlines():
            if "checkov:skip" in line:
                m = re.search(r"#checkov:skip=(CKV2?_[A-Z0-9]+_\d+):(.*)$", line)
                assert m, f"{f.name}: malformed suppression {line.strip()!r}"
                assert len(m.group(2).strip()) >= 30, f"{f.name}: {m.group(1)} needs a reason"
                skips.append(m.group(1))
    assert skips, "expected the documented suppressions"


def test_terraform_fmt():
    tf = _terraform()
    fmt = subprocess.run(
        [tf, "fmt", "-check", "-recursive", "-diff", str(TF)], capture_output=True, text=True, check=False, timeout=120
    )
    assert fmt.returncode == 0, "run `terraform fmt -recursive infra/terraform`:\n" + fmt.stdout


def _check_sh(root: Path) -> subprocess.CompletedProcess:
    run = subprocess.run(
        ["bash", str(root / "infra" / "check.sh"), "checkov"], capture_output=True, text=True, check=False, timeout=1200
    )
    out = run.stdout + run.stderr
    if run.returncode == 2 and ("could not install" in out or "to create the Checkov environment" in out):
        pytest.skip("the Checkov virtualenv could not be created here: " + out.strip().splitlines()[-1])
    return run


@pytest.mark.slow
def test_checkov_passes_and_catches_a_bad_bucket(tmp_path):
    run = _check_sh(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checkov: ok" in run.stderr
    # The same script on a copy with an unencrypted, unversioned bucket must fail.
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "infra", copy / "infra")
    (copy / "infra" / "terraform" / "bad.tf").write_text('resource "aws_s3_bucket" "bad" {\n  bucket = "tidal-bad"\n}\n')
    bad = _check_sh(copy)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "aws_s3_bucket.bad" in bad.stdout


# ---- Helm chart --------------------------------------------------------------------------------


def _chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_chart_settings_load_with_the_tidal_settings(tmp_path, monkeypatch):
    """The ConfigMap's tidal.yaml (values.settings + models + gateway address, as the template builds
    it) is accepted by tidal.settings, which refuses unknown keys."""
    from tidal.settings import load_settings

    values = _chart_values()
    settings = dict(values["settings"])
    settings["store"] = {**settings["store"], "url": "s3://tidal-logs"}
    settings["models"] = [{"name": m, "replicas": 2, "update_strategy": s} for m, s in (("tab", "lora"), ("tabfull", "restart"))]
    settings["gateway"] = {"host": "0.0.0.0", "port": values["gateway"]["port"]}
    path = tmp_path / "tidal.yaml"
    path.write_text(yaml.safe_dump(settings))
    for k in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TIDAL_CONFIG", str(path))
    loaded = load_settings()
    assert loaded.store.url == "s3://tidal-logs" and loaded.gateway.host == "0.0.0.0"
    assert [m.update_strategy for m in loaded.models] == ["lora", "restart"]
    assert loaded.mlflow.tracking_uri == "http://tidal-mlflow:80"


def test_chart_service_accounts_match_irsa_trust():
    irsa = load_dir(TF / "modules" / "irsa")
    chart_sas = {w: sa["name"] for w, sa in _chart_values()["serviceAccounts"].items()}
    trusted = irsa["locals"]["service_accounts"]
    for workload, name in chart_sas.items():
        assert trusted[workload] == name


def chart_settings(docs: dict, tmp_path, monkeypatch):
    """The settings Tidal loads from the rendered ConfigMap's tidal.yaml (no other TIDAL_ variable in force)."""
    from tidal.settings import load_settings

    path = tmp_path / "tidal.yaml"
    path.write_text(docs[("ConfigMap", "tidal-settings")]["data"]["tidal.yaml"])
    for k in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TIDAL_CONFIG", str(path))
    return load_settings()


def _helm() -> str:
    helm = shutil.which("helm")
    if not helm:
        pytest.skip("helm is not on PATH (install Helm 3.8+ to render the chart)")
    return helm


def test_chart_renders_gateway_and_fleet(tmp_path):
    helm = _helm()
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "image": {"repository": "registry.example/tidal", "tag": "0.1.0"},
                "gateway": {"existingSecret": "tidal-gateway"},
                "serviceAccounts": {
                    "gateway": {"name": "tidal-gateway", "roleArn": "arn:aws:iam::123456789012:role/tidal-gateway"}
                },
                "metrics": {"serviceMonitor": {"enabled": True}},
                "models": [
                    {"name": "tab", "replicas": 2, "updateStrategy": "lora", "model": "s3://ckpt/tab/1/", "gpus": 1},
                    {"name": "tabfull", "replicas": 1, "updateStrategy": "restart", "model": "s3://ckpt/tabfull/1/"},
                ],
            }
        )
    )
    out = subprocess.run(
        [helm, "template", "tidal", str(CHART), "-f", str(values)], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("StatefulSet", "tidal-gateway"),
        ("Service", "tidal-gateway"),
        ("HorizontalPodAutoscaler", "tidal-gateway"),
        ("ServiceMonitor", "tidal-gateway"),
        ("ConfigMap", "tidal-settings"),
        ("Deployment", "tidal-vllm-tab"),
        ("Deployment", "tidal-vllm-tabfull"),
    } <= kinds
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    sa = by_name[("ServiceAccount", "tidal-gateway")]
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith("role/tidal-gateway")
    gateway = by_name[("StatefulSet", "tidal-gateway")]["spec"]
    assert [v["metadata"]["name"] for v in gateway["volumeClaimTemplates"]] == ["data"]
    assert "data" not in {v["name"] for v in gateway["template"]["spec"]["volumes"]}  # not an emptyDir any more
    assert by_name[("HorizontalPodAutoscaler", "tidal-gateway")]["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    for dep in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        for c in dep["spec"]["template"]["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
            assert c["resources"]["requests"] and c["resources"]["limits"]
            assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    fleet = by_name[("Deployment", "tidal-vllm-tab")]["spec"]["template"]["spec"]
    vllm = fleet["containers"][0]
    assert vllm["command"][-1] == "vllm.entrypoints.openai.api_server"
    assert (
        "--model=s3://ckpt/tab/1/" in vllm["args"]
        and "--served-model-name=tab" in vllm["args"]
        and "--enable-lora" in vllm["args"]
    )
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert fleet["nodeSelector"]["tidal.dev/pool"] == "fleet"
    assert {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in fleet["tolerations"]
    settings = yaml.safe_load(by_name[("ConfigMap", "tidal-settings")]["data"]["tidal.yaml"])
    assert [m["update_strategy"] for m in settings["models"]] == ["lora", "restart"]
    bad = values.read_text().replace("updateStrategy: restart", "updateStrategy: hot-swap")
    values.write_text(bad)
    refused = subprocess.run(
        [helm, "template", "tidal", str(CHART), "-f", str(values)], capture_output=True, text=True, check=False, timeout=120
    )
    assert refused.returncode != 0 and "must be one of lora, restart, reload, nccl" in refused.stderr


def test_chart_renders_the_fleet_supervisor(tmp_path, monkeypatch):
    """supervisor.enabled: the supervisor's Deployment, Service and Role instead of the static engines, and a
    settings file that the supervisor accepts with fleet.runtime 'kubernetes'."""

    helm = _helm()
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "image": {"repository": "registry.example/tidal", "tag": "0.1.0"},
                "gateway": {"existingSecret": "tidal-gateway"},
                "supervisor": {"enabled": True},
                "metrics": {
                    "serviceMonitor": {"enabled": True},
                    "prometheusRule": {"enabled": True},
                    "grafanaDashboard": {"enabled": True},
                },
                "settings": {"store": {"url": "s3://tidal-checkpoints"}},
                "models": [{"name": "tab", "replicas": 2, "updateStrategy": "lora", "gpus": 2, "instanceType": "g6e.12xlarge"}],
            }
        )
    )
    out = subprocess.run(
        [helm, "template", "tidal", str(CHART), "-f", str(values), "--namespace", "tidal"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    assert {
        ("Deployment", "tidal-fleet-supervisor"),
        ("Service", "tidal-fleet-supervisor"),
        ("Role", "tidal-fleet-supervisor"),
        ("RoleBinding", "tidal-fleet-supervisor"),
    } <= set(docs) and ("Deployment", "tidal-vllm-tab") not in docs
    # monitoring: both scrapes, the rules promtool tests, the dashboard whose queries a real Prometheus answers
    monitor = docs[("ServiceMonitor", "tidal-fleet-supervisor")]["spec"]["endpoints"][0]
    assert (monitor["port"], monitor["path"], monitor["relabelings"][0]["replacement"]) == ("admin", "/metrics", "tidal-fleet")
    rules = yaml.safe_load((ROOT / "infra" / "monitoring" / "rules.yml").read_text())
    assert docs[("PrometheusRule", "tidal")]["spec"]["groups"] == rules["groups"]
    dashboard = docs[("ConfigMap", "tidal-grafana-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tidal.json"]) == json.loads(
        (ROOT / "infra" / "monitoring" / "dashboard.json").read_text()
    )
    assert docs[("Role", "tidal-fleet-supervisor")]["rules"] == yaml.safe_load(
        (CHART / "files" / "fleet-supervisor-rules.yaml").read_text()
    )
    assert docs[("RoleBinding", "tidal-fleet-supervisor")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "tidal-fleet", "namespace": "tidal"}
    ]
    sup = docs[("Deployment", "tidal-fleet-supervisor")]["spec"]
    assert sup["replicas"] == 1 and sup["strategy"]["type"] == "Recreate"
    pod = sup["template"]["spec"]
    assert pod["serviceAccountName"] == "tidal-fleet" and pod["automountServiceAccountToken"] is True
    [c] = pod["containers"]
    assert c["command"] == ["python", "-m", "serving.supervisor"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert {e["name"]: e.get("value") for e in c["env"]}["TIDAL_FLEET__HOST"] == "0.0.0.0"
    k8s = chart_settings(docs, tmp_path, monkeypatch).fleet
    assert k8s.runtime == "kubernetes" and k8s.kubernetes.image.startswith("vllm/vllm-openai:")
    assert k8s.kubernetes.weights_image == "registry.example/tidal:0.1.0" and k8s.kubernetes.namespace == "tidal"
    assert k8s.kubernetes.gpus_for("tab") == 2 and k8s.kubernetes.models["tab"].instance_type == "g6e.12xlarge"


def test_chart_renders_the_capacity_scheduler(tmp_path, monkeypatch):
    """capacity.enabled: the scheduler's Deployment, Service and ServiceMonitor, a settings file in tidal mode that
    points lease holders at its Service, and a refusal without the pool's unit and size."""

    helm = _helm()
    values = {
        "image": {"repository": "registry.example/tidal", "tag": "0.1.0"},
        "gateway": {"existingSecret": "tidal-gateway"},
        "supervisor": {"enabled": True},
        "capacity": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "settings": {"store": {"url": "s3://tidal-checkpoints"}, "capacity": {"unit": "gpu", "total_units": 16}},
        "models": [{"name": "tab", "replicas": 2, "updateStrategy": "lora", "gpus": 1}],
    }

    def render(v: dict) -> subprocess.CompletedProcess:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(v))
        return subprocess.run(
            [helm, "template", "tidal", str(CHART), "-f", str(path), "--namespace", "tidal"],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )

    out = render(values)
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    dep = docs[("Deployment", "tidal-capacity")]["spec"]
    assert dep["replicas"] == 1 and dep["strategy"]["type"] == "Recreate"
    pod = dep["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["priorityClassName"] == "tidal-serving"
    [c] = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["command"] == ["python", "-m", "capacity.scheduler"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert (env["TIDAL_CAPACITY__HOST"], env["TIDAL_GATEWAY__HOST"], env["TIDAL_GATEWAY__PORT"]) == (
        "0.0.0.0",
        "tidal-gateway",
        "80",
    )
    assert docs[("Service", "tidal-capacity")]["spec"]["ports"][0]["port"] == 8095
    monitor = docs[("ServiceMonitor", "tidal-capacity")]["spec"]["endpoints"][0]
    assert (monitor["port"], monitor["relabelings"][0]["replacement"]) == ("api", "tidal-capacity")
    cap = chart_settings(docs, tmp_path, monkeypatch).capacity
    assert (cap.mode, cap.host, cap.port, cap.unit, cap.total_units) == ("tidal", "tidal-capacity", 8095, "gpu", 16)

    refused = render({**values, "settings": {"store": {"url": "s3://tidal-checkpoints"}}})
    assert refused.returncode != 0 and "settings.capacity.unit" in refused.stderr
    refused = render({**values, "supervisor": {"enabled": False}})
    assert refused.returncode != 0 and "capacity.enabled needs supervisor.enabled" in refused.stderr

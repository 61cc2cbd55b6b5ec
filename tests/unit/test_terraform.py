"""Structural checks of infra/terraform (parsed with python-hcl2) and of the Tidal Helm chart.

The properties are the ones a security review of `terraform apply` would look for: encrypted,
versioned, private buckets with lifecycle rules; no wildcard IAM grants; tainted GPU pools; exact
module pins; RDS private and encrypted; variable validation that refuses bad input. Each checker is
also run on a small bad configuration, so a checker that stopped seeing anything would fail here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.terraform_hcl import (
    BUCKETS,
    CHART,
    ROOT,
    STRATEGIES,
    TF,
    _merge,
    all_dirs,
    allow_actions,
    bucket_findings,
    load_dir,
    parse_text,
    policy_statements,
    reachable_literals,
    refs,
    wildcard_grants,
)

# ---- the checkers can fail ---------------------------------------------------------------------


def _module_from(text: str) -> dict:
    merged = {
        "resource": {},
        "data": {},
        "module": {},
        "variable": {},
        "locals": {},
        "terraform": [],
        "output": {},
        "provider": [],
    }
    _merge(merged, parse_text(text))
    return merged


def test_checkers_flag_bad_configurations():
    wildcard = _module_from("""
locals { admin = ["s3:GetObject", "s3:*"] }
data "aws_iam_policy_document" "p" {
  statement {
    actions   = local.admin
    resources = ["arn:aws:s3:::b/*"]
  }
}
data "aws_iam_policy_document" "q" {
  statement {
    effect    = "Allow"
    actions   = ["*"]
    resources = ["*"]
  }
}""")
    assert sorted(wildcard_grants(wildcard)) == ["p: s3:*", "q: *"]

    bare_bucket = _module_from("""
resource "aws_s3_bucket" "b" { bucket = "x" }
resource "aws_s3_bucket_public_access_block" "b" {
  bucket                  = aws_s3_bucket.b.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = false
  restrict_public_buckets = true
}""")
    found = " ".join(bucket_findings(bare_bucket))
    for what in ("SSE-KMS", "versioning", "public access block", "lifecycle", "TLS"):
        assert what in found


# ---- references (what `terraform validate` would catch without providers) ----------------------

_CALL_META = {"source", "version", "depends_on", "providers", "count", "for_each"}


def _code(path: Path) -> str:
    """The module's HCL without comments, so names mentioned in prose are not taken for references."""
    text = "\n".join(f.read_text() for f in sorted(path.glob("*.tf")))
    return re.sub(r"(?m)^\s*#.*$|\s#[^\"\n]*$", "", text)


@pytest.mark.parametrize("module_dir", all_dirs(), ids=lambda p: p.name)
def test_references_resolve(module_dir):
    mod, code = load_dir(module_dir), _code(module_dir)
    assert refs(code, "var") <= set(mod["variable"]), "undeclared variables"
    assert refs(code, "local") <= set(mod["locals"]), "undeclared locals"
    for name, call in mod["module"].items():
        if not call["source"].startswith("./"):
            continue
        child_dir = module_dir / call["source"]
        child = load_dir(child_dir)
        args = set(call) - _CALL_META
        assert args <= set(child["variable"]), f"module {name}: unknown arguments {args - set(child['variable'])}"
        required = {v for v, spec in child["variable"].items() if "default" not in spec}
        assert required <= args, f"module {name}: missing arguments {required - args}"
        used_outputs = set(re.findall(rf"\bmodule\.{name}\.(\w+)", code))
        assert used_outputs <= set(child["output"]), f"module {name}: no outputs {used_outputs - set(child['output'])}"
        assert child_dir.resolve().parent == (TF / "modules").resolve()


# ---- S3 ----------------------------------------------------------------------------------------


def test_storage_creates_the_four_buckets():
    storage = load_dir(TF / "modules" / "storage")
    assert set(storage["resource"]["aws_s3_bucket"]) == {"this"}
    assert storage["resource"]["aws_s3_bucket"]["this"]["for_each"] == "${local.buckets}"
    assert reachable_literals(storage["locals"]["buckets"], storage["locals"]) == BUCKETS


@pytest.mark.parametrize("module_dir", all_dirs(), ids=lambda p: p.name)
def test_every_bucket_is_encrypted_versioned_private_and_aged(module_dir):
    assert bucket_findings(load_dir(module_dir)) == []


def test_logs_bucket_ages_out_and_kms_key_rotates():
    storage = load_dir(TF / "modules" / "storage")
    rule = storage["resource"]["aws_s3_bucket_lifecycle_configuration"]["this"]["rule"][0]
    dynamic = {label: body for d in rule.get("dynamic", []) for label, body in d.items()}
    for action in ("transition", "expiration"):
        assert '"logs"' in dynamic[action]["for_each"], f"{action} must apply to the logs bucket"
    key = storage["resource"]["aws_kms_key"]["storage"]
    assert key["enable_key_rotation"] is True and "policy" in key


# ---- IAM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("module_dir", all_dirs(), ids=lambda p: p.name)
def test_no_iam_statement_grants_wildcard_actions(module_dir):
    assert wildcard_grants(load_dir(module_dir)) == []


def test_irsa_grants_are_least_privilege_per_workload():
    irsa = load_dir(TF / "modules" / "irsa")
    loc = irsa["locals"]
    # The reachable actions really are the policy's (guards against a resolver that sees nothing).
    assert {"s3:GetObject", "s3:PutObject", "s3:ListBucket", "kms:Decrypt", "kms:GenerateDataKey"} <= allow_actions(irsa)

    def actions(workload: str, bucket: str) -> set[str]:
        grant = loc["grants"][workload].get(bucket)
        return set() if grant is None else reachable_literals(grant, loc)

    assert set(loc["grants"]) == {"gateway", "trainer", "mlflow", "flows", "fleet"}
    assert set(loc["grants"]["gateway"]) == {"logs"}
    assert "s3:GetObject" not in actions("gateway", "logs") and "s3:PutObject" in actions("gateway", "logs")
    assert set(loc["grants"]["trainer"]) == {"datasets", "checkpoints"}
    assert "s3:PutObject" not in actions("trainer", "datasets")
    assert {"s3:GetObject", "s3:PutObject"} <= actions("trainer", "checkpoints")
    assert set(loc["grants"]["mlflow"]) == {"mlflow-artifacts"}
    assert set(loc["grants"]["flows"]) == {"logs", "datasets", "checkpoints"}
    assert "s3:PutObject" not in actions("flows", "logs") and "s3:PutObject" in actions("flows", "datasets")
    assert loc["grants"]["flows"]["logs"]["write_prefixes"] == ["quarantine/"]  # its only writes beside the logs
    assert set(loc["grants"]["fleet"]) == {"checkpoints"} and "s3:PutObject" not in actions("fleet", "checkpoints")
    # Only MLflow may delete (garbage collection of deleted runs).
    deleters = {w for w in loc["grants"] for b in loc["grants"][w] if "s3:DeleteObject" in actions(w, b)}
    assert deleters == {"mlflow"}


def test_irsa_resources_are_scoped_and_trust_one_service_account():
    irsa = load_dir(TF / "modules" / "irsa")
    access = irsa["data"]["aws_iam_policy_document"]["access"]
    for _, _, resources, _ in policy_statements(access, irsa["locals"]):
        if isinstance(resources, str):  # a for-expression: one object prefix of the statement's bucket each
            assert resources.startswith("${[for ") and '"${var.bucket_arns[statement.key]}/${p}*"' in resources
            continue
        assert isinstance(resources, list) and resources and "*" not in resources
        assert all("var.bucket_arns[statement.key]" in r or r == "${var.kms_key_arn}" for r in resources), resources
    trust = irsa["data"]["aws_iam_policy_document"]["assume"]["statement"][0]
    assert trust["actions"] == ["sts:AssumeRoleWithWebIdentity"]
    conditions = {c["variable"]: c for c in trust["condition"]}
    sub = next(c for v, c in conditions.items() if v.endswith(":sub"))
    assert sub["test"] == "StringEquals" and sub["values"] == ["system:serviceaccount:${var.namespace}:${each.value}"]
    assert any(v.endswith(":aud") and c["values"] == ["sts.amazonaws.com"] for v, c in conditions.items())


# ---- EKS ---------------------------------------------------------------------------------------


def test_gpu_node_groups_are_tainted_and_labelled():
    cluster = load_dir(TF / "modules" / "cluster")
    loc = cluster["locals"]
    taint = loc["gpu_taint"]["gpu"]
    assert (taint["key"], taint["value"], taint["effect"]) == ("nvidia.com/gpu", "true", "NO_SCHEDULE")
    for pool in ("fleet", "training"):
        p = loc["pools"][pool]
        assert p["taints"] == "${local.gpu_taint}", f"{pool} pool must carry the GPU taint"
        assert p["labels"]["tidal.dev/pool"] == pool
        assert "NVIDIA" in p["ami_type"]
    assert loc["pools"]["cpu"]["taints"] == {}
    # The node groups handed to the EKS module take taints and labels from the pools.
    assert re.search(r"\btaints\s*=\s*p\.taints\b", loc["node_groups"])
    assert re.search(r"\blabels\s*=\s*p\.labels\b", loc["node_groups"])
    assert re.search(r"instance_types\s*=\s*var\.node_groups\[pool\]\.instance_types", loc["node_groups"])
    assert cluster["module"]["eks"]["eks_managed_node_groups"] == "${local.node_groups}"


# ---- pins --------------------------------------------------------------------------------------


@pytest.mark.parametrize("module_dir", all_dirs(), ids=lambda p: p.name)
def test_registry_modules_have_exact_version_pins(module_dir):
    for name, mod in load_dir(module_dir)["module"].items():
        if mod["source"].startswith(("./", "../")):
            assert "version" not in mod
            continue
        assert re.fullmatch(r"\d+\.\d+\.\d+", mod.get("version", "")), f"module {name}: pin an exact version"


PROVIDER_PREFIX = {"aws": "aws_", "helm": "helm_", "kubernetes": "kubernetes_", "random": "random_"}


@pytest.mark.parametrize("module_dir", all_dirs(), ids=lambda p: p.name)
def test_every_provider_has_a_version_constraint(module_dir):
    mod = load_dir(module_dir)
    declared = {}
    for block in mod["terraform"]:
        assert block.get("required_version"), "terraform.required_version missing"
        for rp in block.get("required_providers", []):
            declared.update(rp)
    for name, spec in declared.items():
        assert spec.get("source", "").startswith("hashicorp/"), name
        assert re.match(r"^(~>|>=|=)\s*\d", spec.get("version", "")), f"provider {name} needs a version constraint"
    used = {
        p
        for p, prefix in PROVIDER_PREFIX.items()
        for kind in ("resource", "data")
        for rtype in mod[kind]
        if rtype.startswith(prefix)
    }
    assert used <= set(declared), f"providers used without required_providers: {used - set(declared)}"
    if module_dir == TF:
        assert {"aws", "helm", "kubernetes"} <= set(declared)
        assert all(spec["version"].startswith("~>") for spec in declared.values())


def test_helm_releases_pin_chart_versions():
    platform = load_dir(TF / "modules" / "platform")
    charts = platform["locals"]["charts"]
    assert {c["chart"] for c in charts.values()} >= {"prefect-server", "prefect-worker", "mlflow", "kube-prometheus-stack"}
    for name, c in charts.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", c["version"]), f"chart {name}: pin an exact version"
    for name, rel in platform["resource"]["helm_release"].items():
        if name == "tidal":
            assert rel["chart"].endswith("/helm/tidal")
        else:
            assert re.fullmatch(r"\$\{local\.charts\.\w+\.version\}", rel["version"]), name


def test_the_tidal_release_runs_the_supervisor_with_the_settings_variable_merged_last():
    """`terraform apply` ends with a gateway that serves: the supervisor creates the engines (the static ones need a
    model_uri of a version that does not exist yet), and var.tidal_settings reaches the settings ConfigMap."""
    platform = load_dir(TF / "modules" / "platform")
    first, last = platform["resource"]["helm_release"]["tidal"]["values"]  # Helm merges the later over the earlier
    assert "supervisor = {enabled = true}" in first
    assert last == "${yamlencode({settings = var.tidal_settings})}"
    root = load_dir(TF)
    assert root["module"]["platform"]["tidal_settings"] == "${var.tidal_settings}"
    assert "model_uri" not in (TF / "terraform.tfvars.example").read_text().split("models = [", 1)[1].split("]", 1)[0]


# ---- RDS ---------------------------------------------------------------------------------------


def test_rds_is_private_encrypted_and_protected():
    db = load_dir(TF / "modules" / "database")
    instances = db["resource"]["aws_db_instance"]
    assert instances
    for name, inst in instances.items():
        assert inst["publicly_accessible"] is False, name
        assert inst["storage_encrypted"] is True and "aws_kms_key." in inst["kms_key_id"], name
        assert inst["deletion_protection"] == "${var.deletion_protection}"
        assert inst["multi_az"] == "${var.multi_az}"
        assert inst["backup_retention_period"] == "${var.backup_retention_days}"
        assert inst["skip_final_snapshot"] is False
        assert "password" in inst and "random_password." in inst["password"]
    sg = db["resource"]["aws_security_group"]["this"]
    assert "egress" not in sg
    for rule in sg["ingress"]:
        assert rule["from_port"] == rule["to_port"] == 5432
        assert "cidr_blocks" not in rule and rule["security_groups"] == ["${var.client_security_group_id}"]
    root = load_dir(TF)
    assert root["module"]["database"]["client_security_group_id"] == "${module.cluster.node_security_group_id}"
    secret = db["resource"]["aws_secretsmanager_secret"]["master"]
    assert "aws_kms_key." in secret["kms_key_id"]


# ---- variables ---------------------------------------------------------------------------------


def test_update_strategy_is_validated():
    variables = load_dir(TF)["variable"]
    checks = variables["models"]["validation"]
    strategy = [v for v in checks if "update_strategy" in v["condition"]]
    assert strategy, "variable models needs a validation of update_strategy"
    assert set(re.findall(r'"([^"]+)"', strategy[0]["condition"])) == STRATEGIES
    assert all(s in strategy[0]["error_message"] for s in STRATEGIES)


# ---- in-cluster network ------------------------------------------------------------------------


def _components(selector: dict, local_values: dict) -> set[str] | None:
    """The components a pod selector picks (the literals of its component matchers), None = any pod."""
    labels = selector.get("match_labels", {})
    found = set()
    if isinstance(labels, dict) and "app.kubernetes.io/component" in labels:
        found.add(labels["app.kubernetes.io/component"])
    elif isinstance(labels, str):  # an expression, e.g. merge(local.tidal_labels, { "app.kubernetes.io/component" = "x" })
        found |= set(re.findall(r'"?app\.kubernetes\.io/component"?\s*[=:]\s*"([^"]+)"', labels))
    for m in selector.get("match_expressions", []):
        if m["key"] == "app.kubernetes.io/component" and m["operator"] == "In":
            found |= reachable_literals(m["values"], local_values)
    return found or None


def ingress_sources(policy: dict, local_values: dict) -> set[str]:
    """Who an ingress policy lets in: component names, or 'ANY' for a rule without `from`, an ip_block or a
    namespace selector (every pod of a namespace, or addresses outside the cluster)."""
    out = set()
    for rule in policy["spec"][0].get("ingress", []):
        if not rule.get("from"):
            out.add("ANY")
        for peer in rule.get("from", []):
            if "namespace_selector" in peer and "pod_selector" not in peer:
                labels = peer["namespace_selector"][0].get("match_labels")
                monitoring = labels == "${local.monitoring_peer}" and "var.monitoring_namespace" in str(
                    local_values["monitoring_peer"]
                )
                out.add("monitoring" if monitoring else "ANY")  # Prometheus's namespace, or every pod of some
                continue
            if "ip_block" in peer or "namespace_selector" in peer or "pod_selector" not in peer:
                out.add("ANY")
                continue
            out |= _components(peer["pod_selector"][0], local_values) or {"ANY"}
    return out


def test_the_ingress_checker_sees_an_open_policy():
    bad = _module_from("""
resource "kubernetes_network_policy_v1" "engines" {
  metadata { name = "x" }
  spec {
    pod_selector { match_labels = { "app.kubernetes.io/component" = "engine" } }
    policy_types = ["Ingress"]
    ingress {
      from {
        ip_block { cidr = "0.0.0.0/0" }
      }
    }
    ingress {
      ports {
        port = 8000
      }
    }
  }
}""")
    assert ingress_sources(bad["resource"]["kubernetes_network_policy_v1"]["engines"], {}) == {"ANY"}


def test_only_the_gateway_and_the_supervisor_reach_the_engines():
    """The engines' API is unauthenticated and includes admin endpoints (runtime LoRA loading, collective_rpc):
    without a NetworkPolicy, any pod of the cluster could load weights into a serving engine."""
    import yaml

    from serving.runtime.k8s_manifest import selector

    platform = load_dir(TF / "modules" / "platform")
    policies, local_values = platform["resource"]["kubernetes_network_policy_v1"], platform["locals"]
    engines = policies["engines"]
    selected = _components(engines["spec"][0]["pod_selector"][0], local_values)
    assert "engine" in selected, selected  # the supervisor's engines
    assert '"vllm-${m.name}"' in local_values["engine_components"]  # the chart's static ones, one per model
    assert engines["spec"][0]["policy_types"] == ["Ingress"]
    assert ingress_sources(engines, local_values) == {"gateway", "fleet-supervisor"}
    assert ingress_sources(policies["fleet_supervisor"], local_values) == {"gateway", "flow-run", "monitoring"}
    assert ingress_sources(policies["pushgateway"], local_values) == {"trainer", "flow-run", "monitoring"}
    assert _components(policies["pushgateway"]["spec"][0]["pod_selector"][0], local_values) == {"pushgateway"}
    # the selectors name the labels the pods carry
    assert selector("tidal", "tab", 1)["app.kubernetes.io/component"] == "engine"
    templates = CHART / "templates"
    assert '"component" "gateway"' in (templates / "gateway-statefulset.yaml").read_text()
    assert '"component" "fleet-supervisor"' in (templates / "fleet-supervisor.yaml").read_text()
    assert '"component" "pushgateway"' in (templates / "pushgateway.yaml").read_text()
    assert '"app.kubernetes.io/component": "trainer"' in (ROOT / "training" / "launch" / "k8s_manifest.py").read_text()
    assert 'printf "vllm-%s" .name' in (templates / "vllm-deployment.yaml").read_text()
    pool = (ROOT / "infra" / "prefect" / "kubernetes-work-pool.json").read_text()
    assert '"app.kubernetes.io/component": "flow-run"' in pool
    # and the ports are the ones the pods listen on
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(local_values["engine_port"]) == values["vllm"]["port"]
    assert int(local_values["supervisor_port"]) == values["settings"]["fleet"]["admin_port"]
    from serving.kube_settings import KubernetesFleetSettings

    k8s = KubernetesFleetSettings.model_fields
    assert (int(local_values["engine_port"]), int(local_values["weights_port"])) == (
        k8s["port"].default,
        k8s["weights_port"].default,
    )
    assert int(local_values["gateway_pod_port"]) == values["gateway"]["port"]


def test_the_gateway_keeps_its_log_and_routes_on_a_persistent_volume():
    """The WAL (records not uploaded yet) and the route table lived on an emptyDir: a rescheduled pod lost both."""
    text = (CHART / "templates" / "gateway-statefulset.yaml").read_text()
    assert "kind: StatefulSet" in text and "volumeClaimTemplates:" in text
    volumes = text.split("volumes:", 1)[1].split("volumeClaimTemplates:", 1)[0]
    assert "name: data" not in volumes  # the data volume is the claim, not an emptyDir
    assert "kind: StatefulSet" in (CHART / "templates" / "gateway-hpa.yaml").read_text()
    tidal = load_dir(TF / "modules" / "platform")["variable"]["gateway"]["type"]
    assert "storage" in tidal

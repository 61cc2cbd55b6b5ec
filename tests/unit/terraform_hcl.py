"""Parsing and checking helpers for the infra/terraform tests (python-hcl2 on the real files)."""

from __future__ import annotations

import re
from pathlib import Path

import hcl2

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "infra" / "terraform"
CHART = ROOT / "infra" / "helm" / "tidal"
MODULES = sorted(p for p in (TF / "modules").iterdir() if p.is_dir())
STRATEGIES = {"lora", "restart", "reload", "nccl"}
BUCKETS = {"logs", "datasets", "checkpoints", "mlflow-artifacts"}

# ---- parsing helpers ---------------------------------------------------------------------------

_META = {"__comments__", "__inline_comments__", "__is_block__", "__start_line__", "__end_line__"}


def _unquote(v):
    if isinstance(v, str) and len(v) >= 2 and v[0] == '"' and v[-1] == '"':
        return v[1:-1]
    return v


def _clean(obj):
    """hcl2 output without quote marks around labels and literals, and without comment metadata."""
    if isinstance(obj, dict):
        return {_unquote(k): _clean(v) for k, v in obj.items() if k not in _META}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return _unquote(obj)


def parse_text(text: str) -> dict:
    return _clean(hcl2.loads(text))


def load_dir(path: Path) -> dict:
    """Every .tf file of one module merged: resource/data as {type: {name: body}}, the rest as lists."""
    merged: dict = {
        "resource": {},
        "data": {},
        "module": {},
        "variable": {},
        "locals": {},
        "terraform": [],
        "output": {},
        "provider": [],
    }
    for f in sorted(path.glob("*.tf")):
        _merge(merged, parse_text(f.read_text()))
    return merged


def _merge(merged: dict, doc: dict) -> None:
    for kind in ("resource", "data"):
        for item in doc.get(kind, []):
            for rtype, named in item.items():
                for name, body in named.items():
                    merged[kind].setdefault(rtype, {})[name] = body
    for kind in ("module", "variable", "output"):
        for item in doc.get(kind, []):
            merged[kind].update(item)
    for item in doc.get("locals", []):
        merged["locals"].update(item)
    merged["terraform"] += doc.get("terraform", [])
    merged["provider"] += doc.get("provider", [])


def all_dirs() -> list[Path]:
    return [TF, *MODULES]


def is_expr(v) -> bool:
    return isinstance(v, str) and "${" in v


def refs(expr: str, prefix: str) -> set[str]:
    """Names referenced as <prefix>.NAME in an expression."""
    return set(re.findall(rf"\b{re.escape(prefix)}\.([A-Za-z0-9_-]+)", expr))


def reachable_literals(value, local_values: dict, context: dict[str, object] | None = None, _seen=None) -> set[str]:
    """Every string literal a value can evaluate to: its own literals plus those of the locals (and of
    the for_each behind each./statement. references) it refers to. A superset of what Terraform
    computes, so "no wildcard among these" is a sound check."""
    seen = _seen if _seen is not None else set()
    context = context or {}
    out: set[str] = set()
    if isinstance(value, dict):
        for v in value.values():
            out |= reachable_literals(v, local_values, context, seen)
    elif isinstance(value, list):
        for v in value:
            out |= reachable_literals(v, local_values, context, seen)
    elif isinstance(value, str):
        if not is_expr(value):
            return {value}
        out |= set(re.findall(r'"([^"$]*)"', value))
        for name in refs(value, "local"):
            if name not in seen and name in local_values:
                seen.add(name)
                out |= reachable_literals(local_values[name], local_values, context, seen)
        for iterator, source in context.items():
            if re.search(rf"\b{iterator}\.value\b", value):
                key = f"{iterator}.value"
                if key not in seen:
                    seen.add(key)
                    out |= reachable_literals(source, local_values, context, seen)
    return out


def policy_statements(doc_body: dict, local_values: dict):
    """(effect, actions, resources, conditions) of each statement of an aws_iam_policy_document:
    actions resolved to every literal they can take (dynamic statements included), resources as
    written."""
    ctx = {"each": doc_body.get("for_each", "")}
    for st in doc_body.get("statement", []):
        yield (
            st.get("effect", "Allow"),
            reachable_literals(st.get("actions", []), local_values, ctx),
            st.get("resources", []),
            st.get("condition", []),
        )
    for dyn in doc_body.get("dynamic", []):
        for label, body in dyn.items():
            if label != "statement":
                continue
            dctx = {**ctx, "statement": body.get("for_each", "")}
            for st in body.get("content", []):
                yield (
                    st.get("effect", "Allow"),
                    reachable_literals(st.get("actions", []), local_values, dctx),
                    st.get("resources", []),
                    st.get("condition", []),
                )


ACTION = re.compile(r"^(\*|[a-z0-9-]+:[A-Za-z0-9*]+)$")


def wildcard_grants(module: dict) -> list[str]:
    """Allow statements whose actions include "*" or "service:*". A wildcard in a Deny only narrows
    access (the buckets' deny-non-TLS policy names s3:* on purpose), so Deny is not a grant."""
    bad = []
    for name, body in module["data"].get("aws_iam_policy_document", {}).items():
        for effect, actions, _, _ in policy_statements(body, module["locals"]):
            if effect == "Allow":
                bad += [f"{name}: {a}" for a in actions if ACTION.match(a) and (a == "*" or a.endswith(":*"))]
    return bad


def allow_actions(module: dict) -> set[str]:
    acts: set[str] = set()
    for body in module["data"].get("aws_iam_policy_document", {}).values():
        for effect, actions, _, _ in policy_statements(body, module["locals"]):
            if effect == "Allow":
                acts |= {a for a in actions if ACTION.match(a)}
    return acts


def bucket_findings(module: dict) -> list[str]:
    """What each aws_s3_bucket lacks among encryption, versioning, public access block, lifecycle
    and a TLS-only policy. A companion covers a bucket when it names it and iterates the same set."""
    problems = []
    res = module["resource"]
    for bname, bucket in res.get("aws_s3_bucket", {}).items():
        each = bucket.get("for_each")

        def companions(rtype, bname=bname, each=each):
            return [
                body
                for body in res.get(rtype, {}).values()
                if f"aws_s3_bucket.{bname}" in str(body.get("bucket", "")) and body.get("for_each") == each
            ]

        sse = companions("aws_s3_bucket_server_side_encryption_configuration")
        if not any(
            r.get("apply_server_side_encryption_by_default", [{}])[0].get("sse_algorithm") == "aws:kms"
            and "aws_kms_key." in str(r["apply_server_side_encryption_by_default"][0].get("kms_master_key_id", ""))
            for c in sse
            for r in c.get("rule", [])
        ):
            problems.append(f"{bname}: no SSE-KMS default encryption with a customer-managed key")
        if not any(
            v.get("status") == "Enabled"
            for c in companions("aws_s3_bucket_versioning")
            for v in c.get("versioning_configuration", [])
        ):
            problems.append(f"{bname}: versioning not enabled")
        flags = ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets")
        if not any(all(c.get(f) is True for f in flags) for c in companions("aws_s3_bucket_public_access_block")):
            problems.append(f"{bname}: public access block missing or not all four true")
        lifecycle = [r for c in companions("aws_s3_bucket_lifecycle_configuration") for r in c.get("rule", [])]
        if not lifecycle or not all(
            r.get("status") == "Enabled" and r.get("noncurrent_version_expiration") and r.get("abort_incomplete_multipart_upload")
            for r in lifecycle
        ):
            problems.append(f"{bname}: lifecycle must expire noncurrent versions and abort stale multipart uploads")
        tls = False
        for pol in companions("aws_s3_bucket_policy"):
            for doc in refs(str(pol.get("policy", "")), "data.aws_iam_policy_document"):
                body = module["data"]["aws_iam_policy_document"][doc]
                for effect, _, _, conds in policy_statements(body, module["locals"]):
                    tls |= effect == "Deny" and any(
                        c.get("variable") == "aws:SecureTransport" and c.get("values") == ["false"] for c in conds
                    )
        if not tls:
            problems.append(f"{bname}: no bucket policy denying requests without TLS")
    return problems

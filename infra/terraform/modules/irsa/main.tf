locals {
  # The issuer host path (oidc.eks.<region>.amazonaws.com/id/<id>) is the prefix of the token's
  # claim keys in trust conditions.
  oidc_issuer = element(split(":oidc-provider/", var.oidc_provider_arn), 1)

  # Workload → the Kubernetes service account it runs as. Names are the Helm chart's.
  service_accounts = {
    gateway = "tidal-gateway"
    trainer = "tidal-trainer"
    mlflow  = "tidal-mlflow"
    flows   = "tidal-flows"
    fleet   = "tidal-fleet"
  }

  read  = ["s3:GetObject"]
  write = ["s3:PutObject", "s3:AbortMultipartUpload"]
  list  = ["s3:ListBucket", "s3:GetBucketLocation"]

  # Least privilege per workload (design: Processes). Object actions go to "<bucket>/*", listing to
  # the bucket. Tidal's object store never deletes (keys are overwritten, versioning keeps the old
  # ones); only MLflow deletes artifacts of runs it garbage-collects.
  grants = {
    # The gateway's log sink uploads WAL segments (logs/ and the upload-time quarantine/).
    gateway = {
      logs = { objects = local.write, bucket = local.list }
    }
    # PPO reads a reward dataset and the champion's checkpoint, writes its own state and the candidate.
    trainer = {
      datasets    = { objects = local.read, bucket = local.list }
      checkpoints = { objects = concat(local.read, local.write), bucket = local.list }
    }
    # MLflow serves artifacts by proxy (--serve-artifacts), so only its server touches the bucket.
    mlflow = {
      mlflow-artifacts = { objects = concat(local.read, local.write, ["s3:DeleteObject"]), bucket = local.list }
    }
    # Collect reads new log partitions and writes reward datasets, watermarks and reports, and its
    # quarantine (kept beside the logs, so only under quarantine/); train publishes candidates.
    flows = {
      logs        = { objects = local.read, bucket = local.list, write_prefixes = ["quarantine/"] }
      datasets    = { objects = concat(local.read, local.write), bucket = local.list }
      checkpoints = { objects = concat(local.read, local.write), bucket = local.list }
    }
    # vLLM pods load a version's weights from its checkpoint (design: Versions) and write nothing.
    fleet = {
      checkpoints = { objects = local.read, bucket = local.list }
    }
  }
}

data "aws_iam_policy_document" "assume" {
  for_each = local.service_accounts

  statement {
    effect  = "Allow"
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${each.value}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  for_each = local.service_accounts

  name                 = "${var.name_prefix}-${each.key}"
  description          = "Tidal ${each.key}: assumed by service account ${var.namespace}/${each.value}"
  assume_role_policy   = data.aws_iam_policy_document.assume[each.key].json
  max_session_duration = 3600
  tags                 = var.tags
}

data "aws_iam_policy_document" "access" {
  for_each = local.grants

  dynamic "statement" {
    for_each = each.value
    content {
      sid       = "Objects${replace(title(replace(statement.key, "-", " ")), " ", "")}"
      effect    = "Allow"
      actions   = statement.value.objects
      resources = ["${var.bucket_arns[statement.key]}/*"]
    }
  }

  dynamic "statement" {
    for_each = each.value
    content {
      sid       = "Bucket${replace(title(replace(statement.key, "-", " ")), " ", "")}"
      effect    = "Allow"
      actions   = statement.value.bucket
      resources = [var.bucket_arns[statement.key]]
    }
  }

  # Writes limited to some prefixes of a bucket the workload otherwise only reads.
  dynamic "statement" {
    for_each = { for b, g in each.value : b => g.write_prefixes if length(lookup(g, "write_prefixes", [])) > 0 }
    content {
      sid       = "Write${replace(title(replace(statement.key, "-", " ")), " ", "")}Prefixes"
      effect    = "Allow"
      actions   = local.write
      resources = [for p in statement.value : "${var.bucket_arns[statement.key]}/${p}*"]
    }
  }

  # SSE-KMS: reading needs Decrypt, writing needs GenerateDataKey (and Decrypt for multipart).
  statement {
    sid       = "BucketKey"
    effect    = "Allow"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]
  }
}

resource "aws_iam_role_policy" "access" {
  for_each = local.grants

  name   = "${var.name_prefix}-${each.key}-s3"
  role   = aws_iam_role.this[each.key].id
  policy = data.aws_iam_policy_document.access[each.key].json
}

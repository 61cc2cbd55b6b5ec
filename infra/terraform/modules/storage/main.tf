locals {
  # Bucket by purpose; the object-store layout (design: Records) puts logs/, datasets/ and
  # quarantine/, checkpoints/ and training/ state each under its own bucket, and MLflow keeps its
  # run artifacts apart.
  buckets = toset(["logs", "datasets", "checkpoints", "mlflow-artifacts"])

  # Account and region make the global bucket names unique without random suffixes.
  bucket_names = {
    for b in local.buckets :
    b => "${var.name_prefix}-${data.aws_caller_identity.current.account_id}-${data.aws_region.current.region}-${b}"
  }
}

data "aws_region" "current" {}

resource "aws_s3_bucket" "this" {
  for_each = local.buckets

  #checkov:skip=CKV_AWS_18:Server access logs need a separate SSE-S3 target bucket; object-level access is audited with CloudTrail S3 data events, enabled per account.
  #checkov:skip=CKV_AWS_144:Single-region platform; versioning with a noncurrent-version window covers overwrites and deletes. Add replication where compliance asks for a second region.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: the collect flow reads new log partitions on its schedule from its watermark.
  bucket        = local.bucket_names[each.key]
  force_destroy = var.force_destroy
  tags          = merge(var.tags, { "tidal.dev/bucket" = each.key })
}

resource "aws_s3_bucket_ownership_controls" "this" {
  for_each = local.buckets

  bucket = aws_s3_bucket.this[each.key].id
  rule {
    # ACLs off: access is decided by IAM and bucket policies only.
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  for_each = local.buckets

  bucket                  = aws_s3_bucket.this[each.key].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  for_each = local.buckets

  bucket = aws_s3_bucket.this[each.key].id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.storage.arn
    }
    # S3 Bucket Keys cut KMS requests (and their cost) for the many small Parquet parts of logs/.
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_versioning" "this" {
  for_each = local.buckets

  bucket = aws_s3_bucket.this[each.key].id
  versioning_configuration {
    status = "Enabled"
  }
}

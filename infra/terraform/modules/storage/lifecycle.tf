# Logs are read by the collect flow within hours of landing, then only for audits or re-collects:
# they cool down and expire. Datasets, checkpoints and MLflow artifacts are lineage of registered
# versions and never expire; only their overwritten versions do. One rule per bucket: S3 refuses
# overlapping rules that share an action type.
resource "aws_s3_bucket_lifecycle_configuration" "this" {
  for_each = local.buckets

  bucket = aws_s3_bucket.this[each.key].id

  rule {
    id     = "tidal-${each.key}"
    status = "Enabled"
    filter {}

    dynamic "transition" {
      for_each = each.key == "logs" ? [var.logs_transition_days] : []
      content {
        days          = transition.value
        storage_class = "STANDARD_IA"
      }
    }

    dynamic "expiration" {
      for_each = each.key == "logs" ? [var.logs_expiration_days] : []
      content {
        days = expiration.value
      }
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }

    # A trainer or uploader killed mid-upload leaves parts that cost money and are never read.
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  # Versioning must exist before rules on noncurrent versions are accepted.
  depends_on = [aws_s3_bucket_versioning.this]
}

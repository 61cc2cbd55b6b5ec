output "bucket_names" {
  description = "Bucket name by purpose: logs, datasets, checkpoints, mlflow-artifacts."
  value       = { for k, b in aws_s3_bucket.this : k => b.id }
}

output "bucket_arns" {
  description = "Bucket ARN by purpose."
  value       = { for k, b in aws_s3_bucket.this : k => b.arn }
}

output "kms_key_arn" {
  description = "KMS key of the buckets; readers need kms:Decrypt, writers kms:GenerateDataKey on it."
  value       = aws_kms_key.storage.arn
}

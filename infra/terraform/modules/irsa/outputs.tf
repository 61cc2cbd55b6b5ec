output "role_arns" {
  description = "IAM role ARN by workload (gateway, trainer, mlflow, flows, fleet), for service account annotations."
  value       = { for k, r in aws_iam_role.this : k => r.arn }
}

output "service_accounts" {
  description = "Service account name by workload, as trusted by the roles."
  value       = local.service_accounts
}

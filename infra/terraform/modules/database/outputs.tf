output "endpoints" {
  description = "Host name of each database instance."
  value       = { for k, db in aws_db_instance.this : k => db.address }
}

output "port" {
  description = "PostgreSQL port."
  value       = 5432
}

output "credentials" {
  description = "Username and password of each database (for the Kubernetes secrets of its service)."
  sensitive   = true
  value = {
    for k in var.databases : k => {
      username = k
      password = random_password.master[k].result
    }
  }
}

output "secret_arns" {
  description = "Secrets Manager secret of each database's credentials."
  value       = { for k, s in aws_secretsmanager_secret.master : k => s.arn }
}

# A password Terraform knows, not RDS-managed rotation: the Prefect and MLflow charts read it from
# Kubernetes secrets written at apply time, and a rotation behind their back would lock them out.
# Rotate with `terraform apply -replace='module.database.random_password.master["<db>"]'`.
resource "random_password" "master" {
  for_each = var.databases

  length = 32
  # Letters and digits only: the password is embedded in connection URLs without escaping.
  special = false
}

resource "aws_secretsmanager_secret" "master" {
  for_each = var.databases

  #checkov:skip=CKV2_AWS_57:Automatic rotation would invalidate the connection strings the Prefect and MLflow pods read; rotate through terraform (see comment above).
  name        = "${var.name_prefix}/database/${each.key}"
  description = "Tidal ${each.key} Postgres credentials (source of truth for operators; pods get a copy as a Kubernetes secret)"
  kms_key_id  = aws_kms_key.db.arn
  tags        = var.tags
}

resource "aws_secretsmanager_secret_version" "master" {
  for_each = var.databases

  secret_id = aws_secretsmanager_secret.master[each.key].id
  secret_string = jsonencode({
    engine   = "postgres"
    host     = aws_db_instance.this[each.key].address
    port     = aws_db_instance.this[each.key].port
    dbname   = each.key
    username = each.key
    password = random_password.master[each.key].result
  })
}

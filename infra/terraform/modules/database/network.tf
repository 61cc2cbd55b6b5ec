resource "aws_db_subnet_group" "this" {
  name       = "${var.name_prefix}-db"
  subnet_ids = var.subnet_ids
  tags       = var.tags
}

# No egress rules: the database never opens connections. Terraform removes the default allow-all.
resource "aws_security_group" "this" {
  name        = "${var.name_prefix}-db"
  description = "Tidal Postgres: accepts connections from the EKS nodes only"
  vpc_id      = var.vpc_id
  tags        = var.tags

  ingress {
    description     = "PostgreSQL from pods on the EKS nodes (Prefect server, MLflow)"
    from_port       = 5432
    to_port         = 5432
    protocol        = "tcp"
    security_groups = [var.client_security_group_id]
  }
}

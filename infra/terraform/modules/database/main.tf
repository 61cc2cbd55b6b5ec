locals {
  family = "postgres${split(".", var.engine_version)[0]}"
}

resource "aws_kms_key" "db" {
  description             = "tidal-database: storage, Performance Insights and secrets of the Tidal databases"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

resource "aws_kms_alias" "db" {
  name          = "alias/${var.name_prefix}-database"
  target_key_id = aws_kms_key.db.key_id
}

resource "aws_db_parameter_group" "this" {
  # A prefix, not a name: create_before_destroy needs the replacement to have a different name.
  name_prefix = "${var.name_prefix}-${local.family}-"
  family      = local.family
  tags        = var.tags

  # Clients must use TLS (both psycopg2 and asyncpg default to sslmode=prefer, so they comply).
  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }

  # Slow statements (over 1 s) and schema changes land in the exported postgresql log.
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }

  parameter {
    name  = "log_statement"
    value = "ddl"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_db_instance" "this" {
  for_each = var.databases

  identifier     = "${var.name_prefix}-${each.key}"
  engine         = "postgres"
  engine_version = var.engine_version
  instance_class = var.instance_class

  db_name  = each.key
  username = each.key
  password = random_password.master[each.key].result

  allocated_storage     = var.allocated_storage_gib
  max_allocated_storage = var.allocated_storage_gib * 5
  storage_type          = "gp3"
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.db.arn

  db_subnet_group_name   = aws_db_subnet_group.this.name
  vpc_security_group_ids = [aws_security_group.this.id]
  publicly_accessible    = false
  multi_az               = var.multi_az
  parameter_group_name   = aws_db_parameter_group.this.name

  iam_database_authentication_enabled = true
  auto_minor_version_upgrade          = true
  deletion_protection                 = var.deletion_protection

  backup_retention_period   = var.backup_retention_days
  copy_tags_to_snapshot     = true
  skip_final_snapshot       = false
  final_snapshot_identifier = "${var.name_prefix}-${each.key}-final"

  enabled_cloudwatch_logs_exports       = ["postgresql", "upgrade"]
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = aws_kms_key.db.arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 60
  monitoring_role_arn                   = aws_iam_role.monitoring.arn

  tags = merge(var.tags, { "tidal.dev/database" = each.key })
}

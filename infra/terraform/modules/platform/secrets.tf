# Secrets the charts read. Their values also sit in the Terraform state: keep the state in an
# encrypted, access-controlled backend (see infra/README.md).

resource "random_password" "admin_token" {
  length  = 48
  special = false
}

resource "random_password" "request_id_secret" {
  length  = 48
  special = false
}

resource "random_password" "grafana_admin" {
  length  = 32
  special = false
}

resource "kubernetes_secret_v1" "gateway" {
  metadata {
    name      = "tidal-gateway"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  data = {
    # The fleet and route admin API token, and the HMAC key of request ids: shared by every gateway
    # pod, so feedback for a request signed by one pod verifies on another.
    "admin-token"       = random_password.admin_token.result
    "request-id-secret" = random_password.request_id_secret.result
    "clients"           = jsonencode(var.gateway_clients)
  }
}

# Database credentials of Prefect and MLflow; each chart composes its connection URL from them.
resource "kubernetes_secret_v1" "database" {
  for_each = toset(["prefect", "mlflow"])

  metadata {
    name      = "tidal-${each.key}-db"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  data = {
    username = var.database_credentials[each.key].username
    password = var.database_credentials[each.key].password
  }
}

resource "kubernetes_secret_v1" "grafana_admin" {
  metadata {
    name      = "tidal-grafana-admin"
    namespace = kubernetes_namespace_v1.monitoring.metadata[0].name
  }
  data = {
    "admin-user"     = "admin"
    "admin-password" = random_password.grafana_admin.result
  }
}

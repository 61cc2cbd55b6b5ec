# Prefect server on RDS Postgres. Its UI has no authentication: it stays on a ClusterIP service and
# is reached with `kubectl port-forward` (the UI's API URL below is that forward).
resource "helm_release" "prefect_server" {
  name       = "tidal-prefect-server"
  namespace  = kubernetes_namespace_v1.tidal.metadata[0].name
  repository = local.charts.prefect_server.repository
  chart      = local.charts.prefect_server.chart
  version    = local.charts.prefect_server.version
  timeout    = var.helm_timeout_s

  values = [yamlencode({
    fullnameOverride = "tidal-prefect-server"
    global = {
      prefect = { image = { prefectTag = "${local.prefect_version}-python3.11" } }
    }
    server = {
      uiConfig     = { prefectUiApiUrl = "http://localhost:4200/api" }
      nodeSelector = local.cpu_pool
      resources = {
        requests = { cpu = "500m", memory = "1Gi" }
        limits   = { cpu = "2", memory = "2Gi" }
      }
    }
    postgresql = { enabled = false }
    secret     = { create = false }
    externalDatabase = {
      existingSecret    = kubernetes_secret_v1.database["prefect"].metadata[0].name
      usernameSecretKey = "username"
      passwordSecretKey = "password"
      driver            = "postgresql+asyncpg"
      host              = var.databases["prefect"]
      port              = "5432"
      name              = "prefect"
    }
    service = { type = "ClusterIP", port = 4200 }
  })]
}

# Kubernetes work pool: every flow run is a Job in the Tidal namespace. Deployments choose the
# service account of their runs (tidal-flows, tidal-trainer) through job variables.
resource "helm_release" "prefect_worker" {
  name       = "tidal-prefect-worker"
  namespace  = kubernetes_namespace_v1.tidal.metadata[0].name
  repository = local.charts.prefect_worker.repository
  chart      = local.charts.prefect_worker.chart
  version    = local.charts.prefect_worker.version
  timeout    = var.helm_timeout_s

  values = [yamlencode({
    fullnameOverride = "tidal-prefect-worker"
    worker = {
      image = { prefectTag = "${local.prefect_version}-python3.11-kubernetes" }
      config = {
        workPool     = "tidal-kubernetes"
        type         = "kubernetes"
        jobNamespace = var.namespace
      }
      apiConfig                 = "selfHostedServer"
      selfHostedServerApiConfig = { apiUrl = "http://${local.prefect_host}:4200/api" }
      nodeSelector              = local.cpu_pool
    }
  })]

  depends_on = [helm_release.prefect_server]
}

# MLflow tracking server and registry on RDS Postgres, serving artifacts from S3 by proxy so only
# its own IRSA role touches the artifact bucket.
resource "helm_release" "mlflow" {
  name       = "tidal-mlflow"
  namespace  = kubernetes_namespace_v1.tidal.metadata[0].name
  repository = local.charts.mlflow.repository
  chart      = local.charts.mlflow.chart
  version    = local.charts.mlflow.version
  timeout    = var.helm_timeout_s

  values = [yamlencode({
    fullnameOverride = "tidal-mlflow"
    serviceAccount = {
      create      = true
      name        = "tidal-mlflow"
      annotations = { "eks.amazonaws.com/role-arn" = var.role_arns["mlflow"] }
    }
    backendStore = {
      databaseMigration       = true
      databaseConnectionCheck = true
      postgres = {
        enabled  = true
        host     = var.databases["mlflow"]
        port     = 5432
        database = "mlflow"
        driver   = "psycopg2"
      }
      existingDatabaseSecret = {
        name        = kubernetes_secret_v1.database["mlflow"].metadata[0].name
        usernameKey = "username"
        passwordKey = "password"
      }
    }
    artifactRoot = {
      proxiedArtifactStorage = true
      s3 = {
        enabled = true
        bucket  = var.bucket_names["mlflow-artifacts"]
      }
    }
    # MLflow 3's host-header check (DNS-rebinding protection): the in-cluster names and a local
    # port-forward.
    serverAllowedHosts = [
      "tidal-mlflow",
      "tidal-mlflow.${var.namespace}",
      "tidal-mlflow.${var.namespace}.svc",
      local.mlflow_host,
      "localhost",
      "localhost:*",
      "127.0.0.1:*",
    ]
    extraEnvVars = { AWS_DEFAULT_REGION = var.region }
    nodeSelector = local.cpu_pool
    resources = {
      requests = { cpu = "500m", memory = "1Gi" }
      limits   = { cpu = "2", memory = "2Gi" }
    }
  })]
}

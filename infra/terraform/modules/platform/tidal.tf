locals {
  # The gateway's load balancer: an NLB by the AWS cloud provider, TLS terminated there when a
  # certificate is given.
  gateway_service_annotations = merge(
    { "service.beta.kubernetes.io/aws-load-balancer-type" = "nlb" },
    var.gateway.certificate_arn == "" ? {} : {
      "service.beta.kubernetes.io/aws-load-balancer-ssl-cert"  = var.gateway.certificate_arn
      "service.beta.kubernetes.io/aws-load-balancer-ssl-ports" = "443"
    },
  )
  gateway_port = var.gateway.certificate_arn == "" ? 80 : 443
}

# The Tidal chart from this repository: gateway, fleet supervisor (which creates the engines), settings, service
# accounts. The second values document is var.tidal_settings: Helm merges it over the first, key by key.
resource "helm_release" "tidal" {
  name      = "tidal"
  namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  chart     = "${path.module}/../../../helm/tidal"
  timeout   = var.helm_timeout_s

  values = [yamlencode({
    image = var.tidal_image
    serviceAccounts = {
      gateway = { name = "tidal-gateway", roleArn = var.role_arns["gateway"] }
      flows   = { name = "tidal-flows", roleArn = var.role_arns["flows"] }
      trainer = { name = "tidal-trainer", roleArn = var.role_arns["trainer"] }
      fleet   = { name = "tidal-fleet", roleArn = var.role_arns["fleet"] }
    }
    gateway = {
      existingSecret = kubernetes_secret_v1.gateway.metadata[0].name
      autoscaling = {
        minReplicas                    = var.gateway.min_replicas
        maxReplicas                    = var.gateway.max_replicas
        targetCPUUtilizationPercentage = 70
      }
      service = {
        type                     = "LoadBalancer"
        port                     = local.gateway_port
        annotations              = local.gateway_service_annotations
        loadBalancerSourceRanges = var.gateway.allowed_cidrs
      }
      persistence = { size = var.gateway.storage.size, storageClass = var.gateway.storage.storage_class }
    }
    # the supervisor serves each model's registry version (serve_alias) on engine Deployments it creates; the
    # chart's static per-model engines are not rendered
    supervisor = { enabled = true }
    # scrapes of the gateway, the supervisor and the trainers' Pushgateway, Tidal's alert rules and its Grafana dashboard
    metrics = {
      serviceMonitor   = { enabled = true }
      prometheusRule   = { enabled = true }
      grafanaDashboard = { enabled = true }
      pushgateway      = { enabled = true } # the trainers push their runs (settings.prometheus.pushgateway_url)
    }
    settings = {
      data_dir = "/var/lib/tidal"
      # One bucket per kind of data (IRSA grants follow it); keys keep their area prefix in each.
      store = {
        url       = "s3://${var.bucket_names["datasets"]}" # datasets, state, reports
        s3_region = var.region
        routes = {
          logs               = "s3://${var.bucket_names["logs"]}"
          quarantine         = "s3://${var.bucket_names["logs"]}"
          checkpoints        = "s3://${var.bucket_names["checkpoints"]}"
          training           = "s3://${var.bucket_names["checkpoints"]}"
          "mlflow-artifacts" = "s3://${var.bucket_names["mlflow-artifacts"]}"
        }
      }
      prefect = { host = local.prefect_host, port = 4200 }
      mlflow  = { host = local.mlflow_host, port = 80 }
      fleet   = { host = "tidal-fleet-supervisor.${var.namespace}.svc.cluster.local", admin_port = 8090 }
      collect = { max_model_len = 4096 } # the engines' context: longer rows would be quarantined
      engine = {
        flavor        = "cuda"
        dtype         = "bfloat16"
        max_model_len = 4096
        enforce_eager = false
        max_lora_rank = 8
        max_loras     = 4
      }
    }
    vllm = { image = merge(var.vllm_image, { pullPolicy = "IfNotPresent" }) }
    models = [for m in var.models : {
      name            = m.name
      replicas        = m.replicas
      updateStrategy  = m.update_strategy
      model           = m.model_uri
      servedModelName = coalesce(m.served_model_name, m.name)
      gpus            = m.gpus
      instanceType    = m.instance_type
    }]
  }), yamlencode({ settings = var.tidal_settings })]

  # The ServiceMonitor kind comes with kube-prometheus-stack; GPUs with the device plugin.
  depends_on = [
    helm_release.kube_prometheus_stack,
    helm_release.nvidia_device_plugin,
    helm_release.mlflow,
    helm_release.prefect_server,
  ]
}

data "kubernetes_service_v1" "gateway" {
  metadata {
    name      = "tidal-gateway"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  depends_on = [helm_release.tidal]
}

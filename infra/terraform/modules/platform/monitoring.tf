# Prometheus, Grafana and Alertmanager. The selectors below make Prometheus pick up every
# ServiceMonitor/PodMonitor in the cluster, including the Tidal chart's for the gateway's /metrics.
resource "helm_release" "kube_prometheus_stack" {
  name       = "tidal-monitoring"
  namespace  = kubernetes_namespace_v1.monitoring.metadata[0].name
  repository = local.charts.kube_prometheus_stack.repository
  chart      = local.charts.kube_prometheus_stack.chart
  version    = local.charts.kube_prometheus_stack.version
  timeout    = var.helm_timeout_s

  values = [yamlencode({
    fullnameOverride = "tidal-monitoring"
    prometheus = {
      prometheusSpec = {
        serviceMonitorSelectorNilUsesHelmValues = false
        podMonitorSelectorNilUsesHelmValues     = false
        ruleSelectorNilUsesHelmValues           = false # the Tidal chart's PrometheusRule (infra/monitoring/rules.yml)
        retention                               = var.prometheus_retention
        nodeSelector                            = local.cpu_pool
      }
    }
    alertmanager = {
      alertmanagerSpec = { nodeSelector = local.cpu_pool }
    }
    prometheusOperator = {
      nodeSelector = local.cpu_pool
    }
    kube-state-metrics = {
      nodeSelector = local.cpu_pool
    }
    grafana = {
      nodeSelector = local.cpu_pool
      # Not the chart's well-known default password. The secret's keys are the chart's defaults
      # (admin-user, admin-password).
      admin = { existingSecret = kubernetes_secret_v1.grafana_admin.metadata[0].name }
      # the Tidal chart's dashboard ConfigMap (label grafana_dashboard=1) lives in the Tidal namespace
      sidecar = { dashboards = { enabled = true, label = "grafana_dashboard", searchNamespace = "ALL" } }
    }
  })]
}

# Advertises nvidia.com/gpu on the GPU nodes. Its default tolerations include the nvidia.com/gpu
# taint, and its node affinity matches the nvidia.com/gpu.present label the GPU pools carry.
resource "helm_release" "nvidia_device_plugin" {
  name       = "tidal-nvidia-device-plugin"
  namespace  = "kube-system"
  repository = local.charts.nvidia_device_plugin.repository
  chart      = local.charts.nvidia_device_plugin.chart
  version    = local.charts.nvidia_device_plugin.version
  timeout    = var.helm_timeout_s
}

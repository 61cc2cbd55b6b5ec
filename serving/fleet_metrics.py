"""The fleet supervisor's Prometheus metrics (GET /metrics), read from its status at each scrape.

    fleet_ready                              1 once every configured replica started and was verified
    fleet_replicas{model, state}             replicas per state (every state, 0 included: a panel stays continuous)
    fleet_desired_replicas{model}
    fleet_serving_version{model}             what the gateway serves while the model has no routes
    fleet_replica_restarts_total{model, replica}

Restarts are counted since the supervisor started (a counter: `increase()` over them survives its restarts);
infra/monitoring/rules.yml alerts on a replica that keeps restarting.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.fleet_replies import FleetState, ReplicaState

STATES = get_args(ReplicaState)


class _FleetCollector(Collector):
    def __init__(self, state: FleetState, ready: bool):
        self.state, self.ready = state, ready

    def collect(self):
        ready = GaugeMetricFamily("fleet_ready", "Every configured replica started and was verified (0/1)")
        ready.add_metric([], float(self.ready))
        replicas = GaugeMetricFamily("fleet_replicas", "Replicas per state", labels=["model", "state"])
        desired = GaugeMetricFamily("fleet_desired_replicas", "Replicas asked for", labels=["model"])
        serving = GaugeMetricFamily("fleet_serving_version", "Version served while the model has no routes", labels=["model"])
        restarts = CounterMetricFamily(
            "fleet_replica_restarts", "Engine restarts since the supervisor started", labels=["model", "replica"]
        )
        for model, group in self.state.models.items():
            for s in STATES:
                replicas.add_metric([model, s], float(sum(r.state == s for r in group.replicas)))
            desired.add_metric([model], float(group.desired_replicas))
            serving.add_metric([model], float(group.serving_version))
            for r in group.replicas:
                restarts.add_metric([model, r.name], float(r.restarts))
        yield from (ready, replicas, desired, serving, restarts)


def render(state: FleetState, ready: bool) -> bytes:
    registry = CollectorRegistry()
    registry.register(_FleetCollector(state, ready))
    return generate_latest(registry)

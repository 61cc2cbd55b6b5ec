"""The capacity scheduler: serving's off-peak capacity lent to training as leases, taken back before the peak.

    settings.py   the pool and the scheduler's own settings (`capacity:`); each model's bounds are in
                  tidal/model_settings.py (`models[].capacity`)
    forecast.py   demand per model: a recent average blended with the same time of the previous day
    plan.py       one decision: replicas per model, then what is left granted as leases, or revoked
    leases.py     the lease book: grants, revocations, releases, each an event with its reason

A peer of the fleet supervisor, never a dependency of serving: it scales the fleet through the supervisor's API,
and serving goes on as it was when the scheduler is down.
"""

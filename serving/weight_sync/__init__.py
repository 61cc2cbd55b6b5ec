"""Weight-update strategies: one interface (base.WeightSync), one module per strategy."""

from serving.weight_sync.base import StrategyUnavailable, WeightSync


def strategy_for(name: str) -> WeightSync:
    from serving.weight_sync.lora import LoraSync
    from serving.weight_sync.nccl import NcclSync
    from serving.weight_sync.reload import ReloadSync
    from serving.weight_sync.restart import RestartSync

    table = {"lora": LoraSync, "restart": RestartSync, "reload": ReloadSync, "nccl": NcclSync}
    if name not in table:
        raise StrategyUnavailable(f"unknown update strategy {name!r}; expected one of {sorted(table)}")
    return table[name]()


__all__ = ["StrategyUnavailable", "WeightSync", "strategy_for"]

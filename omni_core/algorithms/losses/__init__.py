"""The registered policy losses, one module each (the `PolicyLoss` contract of `omni_core.algorithms.loss_contract`).

`omni_core.algorithms.names.LOSS_MODULES` maps each name a user types to its module; the package itself imports
nothing, so listing the names stays light.
"""

"""The registered policy losses, one module each (the `PolicyLoss` contract of `omni_core.algorithms.loss_contract`).

`omni_core.config.algorithm_names.LOSSES` maps each name a user types to its module and its own keys; the package itself imports
nothing, so listing the names stays light.
"""

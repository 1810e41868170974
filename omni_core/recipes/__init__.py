"""Recipes: complete experiments built on the library, each a package of its own (its data, models, stages, the
config of its RL run, and any reward it adds). The core never imports a recipe: a recipe adds itself (a reward it
defines registers with `omni_core.rewards.plugins` when its module is imported), and the Prefect layer runs it."""

"""Ray-side workers: the training actor (policy + optimizer) and the rollout workers (agent loop)."""

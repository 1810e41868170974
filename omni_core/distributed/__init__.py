"""Ray and torch.distributed, in one place: a run's cluster (start or join, `ray_cluster`; the token-auth check,
`ray_auth`), its placement group and actor options (`worker_pool`), the shared-storage probe of a multi-node run
(`shared_storage`), the actors' logs brought to the controller (`worker_logs`), stopping an epoch from the flow
process (`run_control`), and the training ranks' process group and sharding (`process_group`, `fsdp2`).

The package itself imports nothing: import the submodules.
"""

"""Rollout, one module each: the per-request sampling choices (`sampling_params`, plain Python), a rollout
request (`request`), the `Trajectory` record and TQ row schema (`trajectory`, torch only) and the batched
SDE sampler (`sampler`, needs the diffusers-backed `FlowPolicy`).

Import from the submodules; the package itself imports nothing, so the light ones stay light.
"""

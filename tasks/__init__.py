"""OmniFlow's Prefect tasks (`omniflow.tasks`): one module per stage of verl-omni's main_diffusion_v1."""

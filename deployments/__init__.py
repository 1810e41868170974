"""OmniFlow's Prefect deployments (`omniflow.deployments`): schedules and parameters of the main job."""

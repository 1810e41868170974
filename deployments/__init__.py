"""OmniFlow's Prefect deployments (`omniflow.deployments`): defined once in `definitions`, served by `serve`,
registered on work pools by `deploy`."""

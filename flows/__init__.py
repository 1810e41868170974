"""OmniFlow's Prefect flows (`omniflow.flows`): the main_diffusion_v1 entry and flows that nest it.

Importing this package is cheap: the flow modules import Prefect, Ray and torch; the package does not.
"""

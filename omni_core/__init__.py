"""OmniFlow's core library: config, validation, models, SDE sampler, algorithms, rewards, trainers.

Plain Python + torch; it never imports prefect or the Prefect layer (``omniflow.*``), so it can be used
as a library on its own.
"""

__version__ = "0.1.0"

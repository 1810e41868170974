"""The built-in reward names, known without importing the reward code (torch, PIL).

`omni_core.rewards.registry.REWARD_FUNCTIONS` has exactly these keys (a test holds the two equal);
validation reads them from here so that `omniflow validate` stays light.
"""

BUILTIN_REWARD_NAMES = ("jpeg_compressibility", "jpeg_incompressibility")

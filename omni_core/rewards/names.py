"""The reward names users type, known without importing the reward code (torch, PIL, transformers).

`BUILTIN_REWARD_NAMES`: rewards that need no weights; `omni_core.rewards.registry.REWARD_FUNCTIONS` has exactly
these keys (a test holds the two equal). Rewards added from outside the core (a recipe's) are not here:
`omni_core.rewards.plugins` knows their names. `MODEL_REWARD_NAMES`: rewards computed by a model loaded from a local
folder (`omni_core.rewards.model_rewards`). `PACKAGED_REWARD_NAMES`: rewards computed by a model shipped inside an
installed package (no model_path, nothing downloaded). Validation reads them from here so that `omniflow validate`
stays light.
"""

BUILTIN_REWARD_NAMES = ("jpeg_compressibility", "jpeg_incompressibility")

# Model rewards (transformers CLIP models loaded with from_pretrained(model_path)).
MODEL_REWARD_NAMES = ("pickscore", "clip_score", "aesthetic")

# Rewards whose model ships in an installed package: name -> the module whose `ocr_term`-style `term(spec)` builds it.
PACKAGED_REWARDS = {"ocr": "omni_core.rewards.ocr"}  # PP-OCRv4 in the rapidocr-onnxruntime wheel
PACKAGED_REWARD_NAMES = tuple(PACKAGED_REWARDS)

# verl-omni's data_source names (its data-preparation scripts write them) -> the reward that scores them here.
DATA_SOURCE_REWARDS = {"flow_grpo/ocr": "ocr"}

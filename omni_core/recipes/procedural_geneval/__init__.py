"""The procedural GenEval recipe (GenEval at toy scale): templated scene prompts and PIL renders with designed
biases (`scenes`, `data`), a rule-based verifier that is also the reward `procedural_geneval` (`verifier`), a
pixel-space SD3 model (`model`), supervised pre-training and the matched control (`supervised`), evaluation and the
report (`evaluation`, `report`), the stages a pipeline runs (`stages`) and its Flow-GRPO run (`rl.yaml`).

Importing the package registers the verifier's reward (the flow `omniflow procedural-geneval` runs it all).
"""

from omni_core.recipes.procedural_geneval import verifier as _verifier  # noqa: F401  (registers the reward)

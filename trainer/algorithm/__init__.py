"""The algorithm: policy losses, proximal references, advantages, batch collation, the PPO-EWMA
proximal model and the loss config.

Invariants: pure functions over tensors, plus the EWMA model (an fp32 copy of the weights that the
learner updates after each applied step); no Ray, no DeepSpeed, no collectives (global counts such
as the loss denominator come in as arguments); imports nothing from :mod:`trainer.learner` or
:mod:`trainer.driver`.
"""

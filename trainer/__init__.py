"""vintage learner side, in three sub-packages that import only downward:

* :mod:`trainer.algorithm` - the math: losses, proximal references, advantages, batches, the EWMA
  model and the loss config; pure tensor code, no Ray, no DeepSpeed, no collectives.
* :mod:`trainer.learner` - the DeepSpeed learner: one rank per Ray actor, checkpoints, the CPU
  comm op, the LoRA settings; imports ``trainer.algorithm``.
* :mod:`trainer.driver` - the job: its loop, old-logit routes, worker pool, trajectory buffer, config,
  HTTP status server, metrics log, agent runner, environment defaults and the loopback guard;
  imports both.
"""

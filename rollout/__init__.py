"""vintage rollout: engines, the rollout worker, the agent loop and environments.

* :mod:`rollout.engine` - ``GenerationEngine`` (token-level ``add/step/abort`` + versioned
  ``update_weights``), ``VllmEngine`` (vLLM in-process), ``TransformersEngine`` (CPU fallback),
  ``EngineConfig`` and ``make_engine``.
* :mod:`rollout.worker` - ``RolloutWorkerCore`` (plain class: ``submit/poll/update_weights/status``);
  :mod:`rollout.worker_actor` - its ``RolloutWorker`` Ray actor.
* :mod:`rollout.agent` - token-in/token-out ``Episode`` bookkeeping and the chat-template renderer.
* :mod:`rollout.envs` - the environment contract, ``load_env("pkg.mod:Attr")`` and built-ins
  (``reasoning_gym_env:ReasoningGymEnv``, ``retail:RetailEnv``, ``scripted:ScriptedEnv``).
"""

"""Example agents written against the OpenAI API, trained through the gateway (``[agent] path``).

* :mod:`rollout.agents.retail` - the retail store-support episode of :mod:`rollout.envs.retail`
  driven by an ``openai.AsyncOpenAI`` client.
"""

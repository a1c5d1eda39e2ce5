"""Example agents written against the OpenAI API, trained through the gateway (``[agent] path``).

* :mod:`rollout.agents.retail` - the retail store-support episode of :mod:`rollout.envs.retail`
  driven by an ``openai.AsyncOpenAI`` client.
* :mod:`rollout.agents.calculator` - sums numbers with a ``calculator`` tool that waits a set time
  (``asyncio.sleep``) per call: the agent of the latency benchmark (``vintage bench latency``).
"""

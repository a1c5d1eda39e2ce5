"""The job's settings: the pydantic models and their validation (``schema``, its sections' building
blocks in ``base`` and the agent's sections in ``agent``) and the generated configuration reference
(``reference``). Imports no other room of the driver."""

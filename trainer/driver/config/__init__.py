"""The job's settings: the pydantic models and their validation (``schema``) and the generated
configuration reference (``reference``). Imports no other room of the driver."""

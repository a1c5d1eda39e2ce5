"""vintage learner side: losses, EWMA, DeepSpeed learner, controller, HTTP API, CLI."""

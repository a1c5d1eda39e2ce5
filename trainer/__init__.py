"""vintage learner side: the driver (job, routes, buffer, pool, config, HTTP API, metrics), the DeepSpeed
learner and checkpoints, and the pure algorithm code (losses, proximal references, advantages, EWMA, batches)."""

"""Overrides (``--set`` items) of a short job on the tiny random model, shared by the job tests."""

TINY_JOB = [
    'model.path="tiny"',
    "env.eval_prompts=2",
    "rollout.num_workers=1",
    "rollout.max_num_seqs=16",
    "rollout.sampling.max_tokens=12",
    "rollout.sampling.n=4",
    "rollout.sampling.temperature=1.0",
    "controller.batch_groups=2",
    "controller.max_staleness=1",
    "learner.lr=1e-4",
    "learner.micro_batch_size=8",
    "server.port=0",
    "logging.trackers=[]",
    "logging.plots=false",
    "ray.num_cpus=6",
]

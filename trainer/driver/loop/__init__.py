"""The job itself: ``job`` (``run_job`` and the loop, read top to bottom), ``assembly`` (starts the
parts), ``parts`` (``Job``: the operations of one iteration), ``report`` (a step's metrics, the
status fields, the summary) and ``eval_env`` (``vintage eval env``). The top room: it may import
every other, and none imports it."""

"""vintage benchmarks: speed, memory and method comparisons (``make bench``, ``make bench-methods``)."""

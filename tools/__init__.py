"""Developer tools that run from a checkout (outside the wheel): the benchmarks, the vocabulary builder."""

"""Runtime: where forwards run (backends, the compute thread, batching, threads), the capacity plan, the guard."""

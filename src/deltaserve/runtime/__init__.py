"""Runtime: where forwards run (backends, the engine loop that owns generation), the capacity plan, the guard."""

"""The model: configuration, layers, hooks, rotary positions and the products they run."""

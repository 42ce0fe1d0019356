"""The simulated world: NPU chip model, simulated engine, cluster simulator (paper §4). Not built
yet: see the open issues."""

"""What the operator sees: the registry of stages and models (heartbeats), and the metrics."""

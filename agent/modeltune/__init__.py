"""``edge-agent model tune``: a model's instances, threads and batching searched live on this
device against its latency objective, the best written to its config.yaml."""

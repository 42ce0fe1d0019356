"""vPod backends: simulated, Cloud TPU (google-cloud-tpu + SSH + vLLM), static hosts. Not built
yet."""

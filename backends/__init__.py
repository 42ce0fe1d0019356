"""vPod backends: the interface (:mod:`backends.base`) and its implementations. Built: the
simulated backend (:mod:`backends.sim`: a fake cloud on 127.0.0.1 with simulated vLLM engine
servers). Later: Cloud TPU (google-cloud-tpu + SSH + vLLM), static hosts."""

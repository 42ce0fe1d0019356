"""The simulated backend: a fake cloud on 127.0.0.1 whose vPods serve vLLM's OpenAI HTTP surface
around the simulated engines (design §3).

* :mod:`backends.sim.cloud` - the sim cloud process (``python -m backends.sim.cloud``):
  management API, quotas, Table 3's delays (time-scaled), one engine server per vPod;
* :mod:`backends.sim.engine_server` - one vPod's engine server (real time, chip-model pace);
* :mod:`backends.sim.client` - :class:`SimBackend`, the :class:`backends.base.Backend` that talks
  to the cloud, and :class:`CloudProcess`, which starts one as a child process;
* :mod:`backends.sim.text` - the deterministic synthetic output.
"""

from .client import CloudProcess, SimBackend

__all__ = ["SimBackend", "CloudProcess"]

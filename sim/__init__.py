"""The simulated world (paper §4).

* :mod:`sim.chip` / :mod:`sim.hardware` - the per-operator NPU chip model (ground truth of the
  roofline, clock of every simulated engine);
* :mod:`sim.stepcost` - the chip model tabulated for fast, vectorised step costs;
* :mod:`sim.engine` - a vLLM-like simulated engine in virtual or real time (the reference), and
  :mod:`sim.fastengine` - its prefill and decode modes, event-driven, for long traces;
* :mod:`sim.lifecycle` - what acting on a vPod costs (Table 3);
* :mod:`sim.validate` - roofline vs chip model (Figs. 9-11), ``dse verify`` and the verified
  default database; :mod:`sim.plausibility` - against public TPU serving measurements;
* :mod:`sim.traces` - workload traces and synthesisers.

``sim`` is driven from above (the cluster simulator in :mod:`orchestrator.cluster`, the
simulated backend) and imports only :mod:`dse`.
"""

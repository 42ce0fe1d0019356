"""The simulated world (paper §4).

* :mod:`sim.chip` / :mod:`sim.hardware` - the per-operator NPU chip model (ground truth of the
  roofline, clock of every simulated engine);
* :mod:`sim.stepcost` - the chip model tabulated for fast, vectorised step costs;
* :mod:`sim.engine` - a vLLM-like simulated engine in virtual or real time;
* :mod:`sim.validate` - roofline vs chip model (Figs. 9-11); :mod:`sim.plausibility` - against
  public TPU serving measurements;
* :mod:`sim.traces` - workload traces and synthesisers; :mod:`sim.cluster` - the trace-driven
  cluster simulator running the production policy and routing; :mod:`sim.report` - its plots.
"""

"""The control plane: one pure policy, two drivers.

* :mod:`orchestrator.policy` (the pure autoscaling policy, §3.4), :mod:`orchestrator.baselines`
  and :mod:`orchestrator.registry` (the policies by name), :mod:`orchestrator.window` (the
  observation window both drivers fill);
* the wall-clock driver: :mod:`orchestrator.controller` (observe, plan, actuate through a
  backend), its state in :mod:`orchestrator.state`, and :mod:`orchestrator.service` (the
  ``serve`` process: gateway + controller + backend);
* the virtual-clock driver: :mod:`orchestrator.cluster` (the trace-driven cluster simulator);
* the ``orchestrator`` command line: :mod:`orchestrator.cli`.
"""

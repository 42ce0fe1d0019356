"""The control plane: :mod:`orchestrator.policy` (the pure autoscaling policy, §3.4) and the
``orchestrator`` CLI (:mod:`orchestrator.cli`); the asyncio controller is a later issue."""

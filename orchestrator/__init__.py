"""The control plane and the ``orchestrator`` CLI (see :mod:`orchestrator.cli`)."""

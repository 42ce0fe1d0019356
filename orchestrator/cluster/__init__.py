"""The trace-driven cluster simulator: the policy's virtual-clock driver (paper §4-5).

``simulator`` runs the loop (observe, plan, act, route), ``fleet`` the simulated vPods and
their life cycle, ``accounting`` the per-phase, per-minute and per-request report and the
Ideal oracle, ``report`` the plots.
"""

from .accounting import (Migration, PhaseReport, SimResult, ideal_at_load_report, ideal_report,
                         ratios_vs_base)
from .fleet import Fleet, SimVPod
from .simulator import ClusterConfig, ClusterSim, Confusion

__all__ = ["ClusterConfig", "ClusterSim", "Confusion", "Fleet", "Migration", "PhaseReport", "SimResult",
           "SimVPod", "ideal_at_load_report", "ideal_report", "ratios_vs_base"]

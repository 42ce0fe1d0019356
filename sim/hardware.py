"""Micro-architectural parameters of the simulated chips (what the roofline does not need).

The chip model in :mod:`sim.chip` executes operators on the units of one chip: systolic arrays
(SA, the MXUs), the vector unit (VU), on-chip SRAM, HBM and the ICI links. The catalog
(:mod:`dse.catalog`) gives peak FLOP/s, bandwidths, SRAM size, array width and Table 2's peak
efficiencies; this module adds the unit counts, the clock they imply, achieved-bandwidth factors,
per-op overheads and the per-component energies, calibrated so a chip running flat out reproduces
Table 2 exactly.

Unit counts (Cloud TPU system architecture docs): v4 and v5p have 2 TensorCores with 4 MXUs each,
v5e 1 TensorCore with 4 MXUs, v6e 1 TensorCore with 4 MXUs of 256x256 (the catalog's systolic
width). The clock follows from peak bf16 FLOP/s = MXUs x width^2 x 2 x clock: 1.05 GHz (v4),
1.50 GHz (v5e), 1.75 GHz (v5p), 1.75 GHz (v6e), matching the published v4 (1050 MHz) and v5p
(1750 MHz) clocks. The VU of a TensorCore does 8 sublanes x 128 lanes x 2 FLOP (FMA) per cycle.

Modelling assumptions (not vendor figures; each is one named constant below): achieved HBM
bandwidth 90 % of peak for streaming kernels plus a 1 us DMA start per op, achieved ICI link
bandwidth 85 %, 70 % compute/memory overlap inside an op, 2 us launch per kernel, SRAM access
1 pJ/bit, VU 4x the SA energy per FLOP. The host's time per engine step belongs to the serving
stack, not the chip: :mod:`dse.stacks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dse.catalog import ChipSpec
from dse.errors import NeuScaleError

HBM_EFFICIENCY = 0.90          # achieved / peak HBM bandwidth, streaming
HBM_OP_LATENCY_S = 1e-6        # DMA start per operator
ICI_EFFICIENCY = 0.85          # achieved / peak link bandwidth
OVERLAP = 0.70                 # share of the shorter of compute/memory hidden under the longer
KERNEL_LAUNCH_S = 2e-6         # per operator (XLA TPU executes fused kernels back to back)
COLLECTIVE_LAUNCH_S = 5e-6     # per collective (synchronisation of the group)
SRAM_J_PER_BYTE = 1e-12 * 8    # 1 pJ/bit
VU_ENERGY_FACTOR = 4.0         # VU J/FLOP relative to SA J/FLOP
VU_FLOP_PER_CYCLE_PER_CORE = 8 * 128 * 2

# (TensorCores, MXUs per TensorCore) per chip version (Cloud TPU system architecture docs)
UNITS = {"v4": (2, 4), "v5e": (1, 4), "v5p": (2, 4), "v6e": (1, 4)}


@dataclass(frozen=True)
class Hardware:
    chip: ChipSpec
    tensorcores: int
    mxus: int
    clock_hz: float
    vu_flops_per_s: float
    hbm_bw_eff_bytes_per_s: float
    ici_link_eff_bytes_per_s: float
    e_sa_j_per_flop: float
    e_vu_j_per_flop: float
    e_hbm_j_per_byte: float
    e_sram_j_per_byte: float
    e_ici_j_per_byte: float
    static_power_w: float

    @property
    def width(self) -> int:
        return self.chip.systolic_width

    @property
    def sram_bytes(self) -> float:
        return self.chip.sram_bytes

    @property
    def sa_flops_per_s(self) -> float:
        return self.chip.peak_flops_per_s


def hardware(chip: ChipSpec) -> Hardware:
    """Unit counts, clock and calibrated per-component energies of ``chip``.

    Calibration (Table 2 at both ends of the energy roofline, as :mod:`dse.catalog`):
    a large matmul at full SA utilisation moves ~2/width bytes of SRAM per FLOP, so
    ``1/max_flop_per_j = e_sa + e_sram * 2/width + static/peak``; a pure HBM stream passes every
    byte through SRAM once, so ``1/max_hbm_bytes_per_j = e_hbm + e_sram + static/BW``.
    """
    tc, mxu_per_tc = UNITS.get(chip.name, (1, 4))
    mxus = tc * mxu_per_tc
    clock = chip.peak_flops_per_s / (mxus * chip.systolic_width ** 2 * 2)
    e_sa = (1 / chip.max_flop_per_j - chip.static_power_w / chip.peak_flops_per_s
            - SRAM_J_PER_BYTE * 2 / chip.systolic_width)
    e_hbm = (1 / chip.max_hbm_bytes_per_j - chip.static_power_w / chip.hbm_bw_bytes_per_s
             - SRAM_J_PER_BYTE)
    if e_sa <= 0 or e_hbm <= 0:
        raise NeuScaleError(
            f"chip {chip.name}: its static power ({chip.static_power_w:g} W) and the SRAM "
            f"energy leave nothing of its max TFLOP/J or max HBM GB/J (Table 2) for the "
            "compute or memory themselves: lower static_power_w or check those two figures")
    return Hardware(
        chip=chip, tensorcores=tc, mxus=mxus, clock_hz=clock,
        vu_flops_per_s=tc * VU_FLOP_PER_CYCLE_PER_CORE * clock,
        hbm_bw_eff_bytes_per_s=HBM_EFFICIENCY * chip.hbm_bw_bytes_per_s,
        ici_link_eff_bytes_per_s=ICI_EFFICIENCY * chip.ici_link_bw_bytes_per_s,
        e_sa_j_per_flop=e_sa, e_vu_j_per_flop=VU_ENERGY_FACTOR * e_sa,
        e_hbm_j_per_byte=e_hbm, e_sram_j_per_byte=SRAM_J_PER_BYTE,
        e_ici_j_per_byte=chip.ici_j_per_byte, static_power_w=chip.static_power_w)

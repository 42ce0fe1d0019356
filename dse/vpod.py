"""The vPod abstraction (paper §3.2, Fig. 6): a homogeneous slice of ICI-connected chips.

* :class:`VChipConfig` - the chip-level parameters a vPod exposes (memory capacities, peak
  FLOP/s, HBM and ICI bandwidth) plus the version it maps to.
* :class:`ICITopology` - the pod shape: a 2D or 3D torus extent, a power of two per dimension
  (paper Fig. 7: aligned with physical pods, minimises fragmentation), within the chip's pod.
* :class:`VPodConfig` - version + topology + chip count.

All three are frozen dataclasses: hashable, ordered, and round-trip through ``to_json``/``from_json``
and a compact string form ``"v5p:2x2x1"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Mapping

from .catalog import Catalog, ChipSpec, default_catalog
from .errors import NeuScaleError


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True, order=True)
class VChipConfig:
    version: str
    peak_flops_per_s: float
    hbm_bytes: float
    hbm_bw_bytes_per_s: float
    sram_bytes: float
    ici_link_bw_bytes_per_s: float
    ici_links_per_chip: int
    systolic_width: int

    @classmethod
    def from_chip(cls, chip: ChipSpec) -> "VChipConfig":
        return cls(chip.name, chip.peak_flops_per_s, chip.hbm_bytes, chip.hbm_bw_bytes_per_s,
                   chip.sram_bytes, chip.ici_link_bw_bytes_per_s, chip.ici_links_per_chip,
                   chip.systolic_width)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True, order=True)
class ICITopology:
    """Torus extent per dimension, e.g. ``(2, 2, 1)``; the length is the torus dimensionality."""

    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        dims = tuple(self.dims)
        object.__setattr__(self, "dims", dims)
        if len(dims) not in (2, 3):
            raise NeuScaleError(f"topology {self!s} must have 2 or 3 dimensions (got {len(dims)})")
        bad = [d for d in dims if not is_pow2(d)]
        if bad:
            raise NeuScaleError(f"topology {self!s}: every dimension must be a power of two "
                                f"(1, 2, 4, 8, 16); {bad} is not")

    @classmethod
    def parse(cls, text: str) -> "ICITopology":
        try:
            dims = tuple(int(p) for p in str(text).lower().strip().split("x"))
        except ValueError:
            raise NeuScaleError(f"topology {text!r} is not of the form AxB or AxBxC "
                                "(e.g. 2x4 or 2x2x1)") from None
        return cls(dims)

    @property
    def num_chips(self) -> int:
        return math.prod(self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def for_chip(self, chip: ChipSpec) -> "ICITopology":
        """Validate against a chip; a 2D shape on a 3D chip is padded with a trailing 1."""
        dims = self.dims
        if len(dims) == 2 and chip.torus_dims == 3:
            dims = dims + (1,)
        if len(dims) != chip.torus_dims:
            raise NeuScaleError(f"topology {self!s} is {len(dims)}D but {chip.name} has a "
                                f"{chip.torus_dims}D torus")
        too_long = [d for d in dims if d > chip.max_dim_chips]
        if too_long:
            raise NeuScaleError(f"topology {self!s}: {chip.name} dimensions are at most "
                                f"{chip.max_dim_chips} chips (got {max(too_long)})")
        if self.num_chips > chip.max_chips_per_pod:
            raise NeuScaleError(f"topology {self!s} has {self.num_chips} chips; a {chip.name} pod "
                                f"holds at most {chip.max_chips_per_pod}")
        return ICITopology(dims)

    def has_wraparound(self, chip: ChipSpec) -> bool:
        """Torus wrap-around links exist only for large enough slices (see catalog ``_WRAP``)."""
        return all(d >= chip.wrap_min_dim for d in self.dims)

    def __str__(self) -> str:
        return "x".join(str(d) for d in self.dims)


@dataclass(frozen=True, order=True)
class VPodConfig:
    """A vPod: chip version, ICI topology and chip count (Fig. 6)."""

    version: str
    topology: ICITopology
    num_chips: int = field(default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.topology, ICITopology):
            object.__setattr__(self, "topology", ICITopology.parse(str(self.topology)))
        n = self.topology.num_chips
        if self.num_chips in (0, None):
            object.__setattr__(self, "num_chips", n)
        elif self.num_chips != n:
            raise NeuScaleError(f"vPod {self.version}:{self.topology} has {n} chips, "
                                f"not num_chips={self.num_chips}")

    @classmethod
    def make(cls, chip: ChipSpec | str, topology: ICITopology | str,
             catalog: Catalog | None = None) -> "VPodConfig":
        if isinstance(chip, str):
            chip = (catalog or default_catalog()).get(chip)
        topo = topology if isinstance(topology, ICITopology) else ICITopology.parse(topology)
        return cls(chip.name, topo.for_chip(chip))

    @classmethod
    def parse(cls, text: str, catalog: Catalog | None = None) -> "VPodConfig":
        version, sep, topo = str(text).partition(":")
        if not sep:
            raise NeuScaleError(f"vPod {text!r} is not of the form CHIP:TOPOLOGY (e.g. v5p:2x2x1)")
        return cls.make(version, topo, catalog)

    def chip(self, catalog: Catalog | None = None) -> ChipSpec:
        return (catalog or default_catalog()).get(self.version)

    def vchip(self, catalog: Catalog | None = None) -> VChipConfig:
        return VChipConfig.from_chip(self.chip(catalog))

    def accelerator_type(self, catalog: Catalog | None = None) -> str:
        return self.chip(catalog).accelerator_type(self.num_chips)

    def num_hosts(self, catalog: Catalog | None = None) -> int:
        return max(1, math.ceil(self.num_chips / self.chip(catalog).chips_per_host))

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "topology": str(self.topology),
                "num_chips": self.num_chips}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "VPodConfig":
        return cls(d["version"], ICITopology.parse(d["topology"]), int(d["num_chips"]))

    def __str__(self) -> str:
        return f"{self.version}:{self.topology}"


def enumerate_topologies(chip: ChipSpec, max_chips: int = 1024) -> list[ICITopology]:
    """Distinct pod shapes (up to permutation) of ``chip`` with at most ``max_chips`` chips.

    Shapes are listed with non-increasing extents (e.g. 4x2x1): a permutation of the same extents
    is the same vPod for the cost model. Shapes smaller than the smallest slice Cloud TPU sells
    (v4/v5p: 4 chips) are included: a host's chips can be split between several engines, as the
    paper's NPU-C_1x1 vPod (Fig. 5) is.
    """
    limit = min(max_chips, chip.max_chips_per_pod)
    exps = range(int(math.log2(chip.max_dim_chips)) + 1)
    out = []

    def rec(prefix: tuple[int, ...], max_e: int) -> None:
        if len(prefix) == chip.torus_dims:
            dims = tuple(2 ** e for e in prefix)
            if math.prod(dims) <= limit:
                out.append(ICITopology(dims))
            return
        for e in exps:
            if e <= max_e:
                rec(prefix + (e,), e)

    rec((), max(exps))
    out.sort(key=lambda t: (t.num_chips, t.dims))
    return out


def compact_topology(chip: ChipSpec, num_chips: int) -> ICITopology:
    """The most cube-like power-of-two shape of ``num_chips`` chips of ``chip``."""
    if not is_pow2(num_chips):
        raise NeuScaleError(f"{num_chips} chips is not a power of two")
    dims = [1] * chip.torus_dims
    k = 0
    while math.prod(dims) < num_chips:
        dims[k % len(dims)] *= 2
        k += 1
    return ICITopology(tuple(sorted(dims, reverse=True))).for_chip(chip)


class VPodState(StrEnum):
    """A vPod's life cycle, the same words for the policy, the drivers and the backends."""
    STARTING = "starting"     # ordered: being created, engine loading (capacity on its way)
    READY = "ready"           # serving
    DRAINING = "draining"     # being deleted: takes no new requests, finishes what it has
    RELEASED = "released"     # gone (its chips are free again)

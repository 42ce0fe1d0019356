"""Chip catalog: the four Cloud TPU generations of paper Table 2 (NPU-A/B/C/D) and user chips.

All quantities are SI (FLOP/s, bytes, bytes/s, W, J) and every number carries its source.

Energy model (paper Fig. 8b). A chip's energy for a piece of work is

    E = flops * e_flop_j + hbm_bytes * e_hbm_j_per_byte + ici_bytes * e_ici_j_per_byte
        + static_power_w * time_s

Table 2's "Max TFLOP/J" and "Max HBM GB/J" are the paper's *modelled* peak efficiencies (marked
"*" there: inferred, not disclosed). We take them as the efficiency of a chip running flat out on
the respective unit with everything else idle, static power included:

    1 / max_flop_per_j  = e_flop_j         + static_power_w / peak_flops_per_s
    1 / max_bytes_per_j = e_hbm_j_per_byte + static_power_w / hbm_bw_bytes_per_s

so the catalog reproduces Table 2 exactly at both ends of the energy roofline and the curve in
between follows from the two per-unit energies. Two equations, three unknowns: we fix the HBM
access energy at 3.9 pJ/bit (HBM2-class DRAM access + I/O energy, O'Connor et al., "Fine-Grained
DRAM", MICRO 2017, Table 1 / Fig. 1) and derive static power from it; e_flop follows. The derived
static powers (63-92 W per chip) are estimates; for scale, Cloud TPU's v4 documentation gives
192 W maximum chip power, so v4's derived 71 W static is 37 % of its maximum.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .errors import NeuScaleError
from .files import MiB, read_text

TERA = 1e12
GIGA = 1e9

# HBM2/HBM2E access energy: 3.9 pJ/bit (O'Connor et al., MICRO 2017). Used only to split Table 2's
# HBM-roofline power into a dynamic and a static part (see module docstring).
HBM_ACCESS_J_PER_BYTE = 3.9e-12 * 8
# ICI link energy: ~4 pJ/bit for short-reach electrical/optical SerDes. An assumption (order of
# magnitude of published SerDes energies), not a vendor figure; the paper does not give one.
ICI_J_PER_BYTE_DEFAULT = 4e-12 * 8
# ICI per-hop (per ring step) latency including synchronisation: 1 us. An assumption of the
# order of published TPU ICI latencies, not a vendor figure.
ICI_HOP_LATENCY_S_DEFAULT = 1e-6


@dataclass(frozen=True)
class ChipSpec:
    """One chip version. Field names carry units; all values SI."""

    name: str                       # Cloud TPU version name: v4, v5e, v5p, v6e
    aliases: tuple[str, ...]        # paper names (NPU-A, ...) and other spellings
    release_year: int
    process_node_nm: int
    peak_flops_per_s: float         # bf16 dense
    max_flop_per_j: float           # Table 2 "Max TFLOP/Joule" (modelled)
    systolic_width: int             # systolic array width (elements)
    sram_bytes: float               # on-chip SRAM (CMEM/VMEM) capacity
    hbm_bw_bytes_per_s: float
    hbm_bytes: float
    hbm_type: str
    max_hbm_bytes_per_j: float      # Table 2 "Max HBM GB/Joule" (modelled)
    ici_link_bw_bytes_per_s: float  # per link, per direction
    ici_links_per_chip: int
    torus_dims: int                 # 2 or 3
    dcn_bw_bytes_per_s: float       # data-centre network bandwidth per chip
    max_chips_per_pod: int
    max_dim_chips: int              # largest power-of-two extent of one torus dimension
    wrap_min_dim: int               # a slice has torus wrap-around links iff every dim >= this
    chips_per_host: int
    accelerator_prefix: str         # Cloud TPU accelerator-type prefix (v4, v5litepod, v5p, v6e)
    accelerator_count_unit: str     # "cores" (v4/v5p: N = TensorCores = 2/chip) or "chips"
    price_usd_per_chip_hour: float  # on-demand, us-central
    static_power_w: float           # idle/static power per chip (see module docstring)
    ici_j_per_byte: float = ICI_J_PER_BYTE_DEFAULT
    ici_hop_latency_s: float = ICI_HOP_LATENCY_S_DEFAULT
    min_slice_chips: int = 1        # smallest slice Cloud TPU sells of this version
    # highest chip power measured on real workloads, where one is published (None: none is):
    # no step is modelled to draw more (see :meth:`power_capped_j`)
    measured_max_power_w: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived per-unit energies (Fig. 8b) -------------------------------------------------
    @property
    def e_flop_j(self) -> float:
        return 1.0 / self.max_flop_per_j - self.static_power_w / self.peak_flops_per_s

    @property
    def e_hbm_j_per_byte(self) -> float:
        return 1.0 / self.max_hbm_bytes_per_j - self.static_power_w / self.hbm_bw_bytes_per_s

    def power_capped_j(self, energy_j, num_chips, seconds):
        """``energy_j`` of ``num_chips`` over ``seconds``, bounded by the measured maximum
        power where one is published (numpy-friendly). The per-unit energies come from Table
        2's *modelled* peak efficiencies; where a measured maximum exists it wins: a step that
        would draw more is priced at that power (its time is the model's)."""
        if self.measured_max_power_w is None:
            return energy_j
        cap = self.measured_max_power_w * num_chips * seconds
        return np.minimum(energy_j, cap) if isinstance(energy_j, np.ndarray) or \
            isinstance(cap, np.ndarray) else min(energy_j, cap)

    @property
    def all_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def vpod_usd(self, num_chips, seconds):
        """Dollars of ``num_chips`` of these chips held for ``seconds`` at the on-demand price
        (numpy-friendly: either argument may be an array). The one place a vPod is priced."""
        return num_chips * self.price_usd_per_chip_hour / 3600.0 * seconds

    def accelerator_type(self, num_chips: int) -> str:
        """Cloud TPU accelerator-type name for a slice of ``num_chips`` (e.g. v5p-8 = 4 chips)."""
        per_chip = 2 if self.accelerator_count_unit == "cores" else 1
        return f"{self.accelerator_prefix}-{num_chips * per_chip}"

    def validate(self) -> None:
        """Refuse a chip with a field of the wrong type or range (the message names each)."""
        problems = _field_problems({f.name: getattr(self, f.name) for f in fields(self)})
        if not problems:
            if not (math.isfinite(self.e_flop_j) and self.e_flop_j > 0):
                problems.append(
                    f"static_power_w={self.static_power_w} W exceeds the chip's power at peak "
                    f"compute ({self.peak_flops_per_s / self.max_flop_per_j:.1f} W): lower it")
            if not (math.isfinite(self.e_hbm_j_per_byte) and self.e_hbm_j_per_byte > 0):
                problems.append(
                    f"static_power_w={self.static_power_w} W exceeds the chip's power at peak "
                    f"HBM bandwidth ({self.hbm_bw_bytes_per_s / self.max_hbm_bytes_per_j:.1f} W): "
                    "lower it")
        if problems:
            raise NeuScaleError(f"chip {self.name!r}: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["sources"] = dict(self.sources)
        return d


# A chip name or alias: it is typed on command lines (``--chips a,b``, ``CHIP:TOPOLOGY``) and
# becomes part of cache file names, so no commas, colons, slashes or spaces.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_NAME_RULE = "1-64 letters, digits, '.', '_', '+' or '-', starting with a letter or digit"
_POSITIVE_NUMBERS = (
    "peak_flops_per_s", "max_flop_per_j", "sram_bytes", "hbm_bw_bytes_per_s", "hbm_bytes",
    "max_hbm_bytes_per_j", "ici_link_bw_bytes_per_s", "dcn_bw_bytes_per_s",
    "price_usd_per_chip_hour", "ici_j_per_byte", "ici_hop_latency_s",
)
# integer fields and their upper bounds (far above any real chip; max_dim_chips also bounds the
# topology enumeration, which walks every power of two up to it)
_POSITIVE_INTS = {
    "release_year": 9999, "process_node_nm": 1 << 16, "systolic_width": 1 << 16,
    "ici_links_per_chip": 1 << 10, "max_chips_per_pod": 1 << 30, "max_dim_chips": 1 << 16,
    "wrap_min_dim": 1 << 16, "chips_per_host": 1 << 16, "min_slice_chips": 1 << 30,
}


def _show(v: Any) -> str:
    """A field value as the user wrote it (JSON spelling), shortened."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field_problems(v: Mapping[str, Any]) -> list[str]:
    """What is wrong with the ChipSpec field values ``v`` (aliases a tuple), one phrase each."""
    out = []
    name = v.get("name")
    if not (isinstance(name, str) and _NAME_RE.fullmatch(name)):
        out.append(f"name must be {_NAME_RULE} (got {_show(name)})")
    aliases = v.get("aliases")
    if not isinstance(aliases, tuple):
        out.append(f"aliases must be a list of names (or one name), not {_show(aliases)}")
    else:
        bad = [a for a in aliases if not (isinstance(a, str) and _NAME_RE.fullmatch(a))]
        if bad:
            out.append(f"each alias must be {_NAME_RULE} (got {_show(bad[0])})")
    for k in _POSITIVE_NUMBERS:
        x = v.get(k)
        if not (_is_number(x) and math.isfinite(x) and x > 0):
            out.append(f"{k} must be a positive number (got {_show(x)})")
    x = v.get("static_power_w")
    if not (_is_number(x) and math.isfinite(x) and x >= 0):
        out.append(f"static_power_w must be a number >= 0 (got {_show(x)})")
    x = v.get("measured_max_power_w")
    if x is not None and not (_is_number(x) and math.isfinite(x) and x > 0):
        out.append(f"measured_max_power_w must be a positive number or null (got {_show(x)})")
    elif x is not None and _is_number(v.get("static_power_w")) and x <= v["static_power_w"]:
        out.append(f"measured_max_power_w ({x:g} W) must exceed static_power_w "
                   f"({v['static_power_w']:g} W)")
    x = v.get("torus_dims")
    if not (isinstance(x, int) and not isinstance(x, bool) and x in (2, 3)):
        out.append(f"torus_dims must be 2 or 3 (got {_show(x)})")
    for k, hi in _POSITIVE_INTS.items():
        x = v.get(k)
        if not (isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= hi):
            out.append(f"{k} must be a positive integer of at most {hi:,} (got {_show(x)})")
        elif k == "max_dim_chips" and x & (x - 1):
            out.append(f"max_dim_chips must be a power of two (got {x})")
    for k in ("hbm_type", "accelerator_prefix"):
        x = v.get(k)
        if not (isinstance(x, str) and x.strip() and len(x) <= 64):
            out.append(f"{k} must be a non-empty string of at most 64 characters "
                       f"(got {_show(x)})")
    if v.get("accelerator_count_unit") not in ("cores", "chips") or \
            not isinstance(v.get("accelerator_count_unit"), str):
        out.append(f"accelerator_count_unit must be 'cores' or 'chips' "
                   f"(got {_show(v.get('accelerator_count_unit'))})")
    src = v.get("sources")
    if not (isinstance(src, Mapping)
            and all(isinstance(a, str) and isinstance(b, str) for a, b in src.items())):
        out.append(f"sources must map topics to source strings (got {_show(src)})")
    return out


def static_power_from_table2(hbm_bw_bytes_per_s: float, max_hbm_bytes_per_j: float) -> float:
    """Static power implied by Table 2's HBM roofline and the HBM access energy (docstring)."""
    return hbm_bw_bytes_per_s / max_hbm_bytes_per_j - HBM_ACCESS_J_PER_BYTE * hbm_bw_bytes_per_s


_T2 = "paper Table 2"
_PRICE = "Cloud TPU pricing page, on-demand, us-central (USD per chip-hour)"
_HOST = "Cloud TPU system architecture docs (chips per host VM)"
_ACC = "Cloud TPU docs, accelerator types (v4/v5p count TensorCores, 2 per chip; v5e/v6e count chips)"
# Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer...", ISCA 2023: measured
# chip power min/mean/max 90/170/192 W. v5e, v5p, v6e: Google publishes no per-chip power.
_V4_POWER = "Jouppi et al., ISCA 2023: TPU v4 measured power min/mean/max 90/170/192 W per chip"
_WRAP = ("Cloud TPU docs: v4/v5p slices made of whole 4x4x4 cubes get wrap-around (torus) links; "
         "v5e/v6e only the full 16x16 pod")


def _builtin(**kw: Any) -> ChipSpec:
    kw.setdefault("static_power_w",
                  static_power_from_table2(kw["hbm_bw_bytes_per_s"], kw["max_hbm_bytes_per_j"]))
    return ChipSpec(**kw)


BUILTIN_CHIPS: tuple[ChipSpec, ...] = (
    _builtin(
        name="v4", aliases=("NPU-A", "tpu-v4", "tpuv4"),
        release_year=2021, process_node_nm=7,                       # Table 2
        peak_flops_per_s=275 * TERA,                                # Table 2: 275 TFLOPS bf16
        max_flop_per_j=1.07 * TERA,                                 # Table 2 (modelled, "*")
        systolic_width=128,                                         # Table 2
        sram_bytes=128e6,                                           # Table 2: 128 MB
        hbm_bw_bytes_per_s=1200 * GIGA,                             # Table 2: 1200 GB/s
        hbm_bytes=32e9, hbm_type="HBM2",                            # Table 2: 32 GB
        max_hbm_bytes_per_j=11.06 * GIGA,                           # Table 2 (modelled, "*")
        ici_link_bw_bytes_per_s=50 * GIGA, ici_links_per_chip=6,    # Table 2
        torus_dims=3,                                               # Table 2: 3D
        dcn_bw_bytes_per_s=5 * GIGA / 8,                            # Table 2: 5 Gbps/chip
        max_chips_per_pod=4096,                                     # Table 2
        max_dim_chips=16,                                           # 16x16x16 pod (4096 chips)
        wrap_min_dim=4,                                             # _WRAP
        chips_per_host=4,                                           # _HOST
        accelerator_prefix="v4", accelerator_count_unit="cores",    # _ACC (v4-8 = 4 chips)
        min_slice_chips=4,                                          # _ACC: smallest is v4-8
        price_usd_per_chip_hour=3.22,                               # _PRICE
        measured_max_power_w=192.0,                                 # _V4_POWER
        sources={"specs": _T2, "price": _PRICE, "host": _HOST, "naming": _ACC, "wrap": _WRAP,
                 "power": _V4_POWER},
    ),
    _builtin(
        name="v5e", aliases=("NPU-B", "v5litepod", "tpu-v5e", "tpuv5e", "tpu-v5-lite-podslice"),
        release_year=2023, process_node_nm=7,                       # Table 2 ("*" inferred)
        peak_flops_per_s=197 * TERA,                                # Table 2: 197 TFLOPS bf16
        max_flop_per_j=0.72 * TERA,                                 # Table 2 (modelled)
        systolic_width=128,                                         # Table 2
        sram_bytes=64e6,                                            # Table 2: 64 MB (inferred)
        hbm_bw_bytes_per_s=819 * GIGA,                              # Table 2: 819 GB/s
        hbm_bytes=16e9, hbm_type="HBM2E",                           # Table 2: 16 GB
        max_hbm_bytes_per_j=6.94 * GIGA,                            # Table 2 (modelled)
        ici_link_bw_bytes_per_s=50 * GIGA, ici_links_per_chip=4,    # Table 2
        torus_dims=2,                                               # Table 2: 2D
        dcn_bw_bytes_per_s=50 * GIGA / 8,                           # Table 2: 50 Gbps/chip
        max_chips_per_pod=256,                                      # Table 2
        max_dim_chips=16,                                           # 16x16 pod
        wrap_min_dim=16,                                            # _WRAP
        chips_per_host=8,                                           # _HOST
        accelerator_prefix="v5litepod", accelerator_count_unit="chips",  # _ACC
        price_usd_per_chip_hour=1.20,                               # _PRICE
        sources={"specs": _T2, "price": _PRICE, "host": _HOST, "naming": _ACC, "wrap": _WRAP},
    ),
    _builtin(
        name="v5p", aliases=("NPU-C", "tpu-v5p", "tpuv5p"),
        release_year=2023, process_node_nm=7,                       # Table 2 ("*" inferred)
        peak_flops_per_s=459 * TERA,                                # Table 2: 459 TFLOPS bf16
        max_flop_per_j=1.16 * TERA,                                 # Table 2 (modelled)
        systolic_width=128,                                         # Table 2
        sram_bytes=128e6,                                           # Table 2 (inferred)
        hbm_bw_bytes_per_s=2765 * GIGA,                             # Table 2: 2765 GB/s
        hbm_bytes=95e9, hbm_type="HBM2E",                           # Table 2: 95 GB
        max_hbm_bytes_per_j=18.51 * GIGA,                           # Table 2 (modelled)
        ici_link_bw_bytes_per_s=100 * GIGA, ici_links_per_chip=6,   # Table 2
        torus_dims=3,                                               # Table 2: 3D
        dcn_bw_bytes_per_s=50 * GIGA / 8,                           # Table 2: 50 Gbps/chip
        max_chips_per_pod=6144,                                     # Table 2 (16x16x24)
        max_dim_chips=16,                                           # largest power of two <= 24
        wrap_min_dim=4,                                             # _WRAP
        chips_per_host=4,                                           # _HOST
        accelerator_prefix="v5p", accelerator_count_unit="cores",   # _ACC (v5p-8 = 4 chips)
        min_slice_chips=4,                                          # _ACC: smallest is v5p-8
        price_usd_per_chip_hour=4.20,                               # _PRICE
        sources={"specs": _T2, "price": _PRICE, "host": _HOST, "naming": _ACC, "wrap": _WRAP},
    ),
    _builtin(
        name="v6e", aliases=("NPU-D", "trillium", "tpu-v6e", "tpuv6e"),
        release_year=2024, process_node_nm=4,                       # Table 2 ("*" inferred)
        peak_flops_per_s=918 * TERA,                                # Table 2: 918 TFLOPS bf16
        max_flop_per_j=3.50 * TERA,                                 # Table 2 (modelled)
        systolic_width=256,                                         # Table 2
        sram_bytes=128e6,                                           # Table 2 (inferred)
        hbm_bw_bytes_per_s=1640 * GIGA,                             # Table 2: 1640 GB/s
        hbm_bytes=32e9, hbm_type="HBM2E",                           # Table 2: 32 GB
        max_hbm_bytes_per_j=13.52 * GIGA,                           # Table 2 (modelled)
        ici_link_bw_bytes_per_s=112 * GIGA, ici_links_per_chip=4,   # Table 2
        torus_dims=2,                                               # Table 2: 2D
        dcn_bw_bytes_per_s=100 * GIGA / 8,                          # Table 2: 100 Gbps/chip
        max_chips_per_pod=256,                                      # Table 2
        max_dim_chips=16,                                           # 16x16 pod
        wrap_min_dim=16,                                            # _WRAP
        chips_per_host=8,                                           # _HOST
        accelerator_prefix="v6e", accelerator_count_unit="chips",   # _ACC
        price_usd_per_chip_hour=2.70,                               # _PRICE
        sources={"specs": _T2, "price": _PRICE, "host": _HOST, "naming": _ACC, "wrap": _WRAP},
    ),
)


class Catalog:
    """A set of chips addressable by name or alias (case-insensitive)."""

    def __init__(self, chips: Iterable[ChipSpec] = BUILTIN_CHIPS):
        self._chips: dict[str, ChipSpec] = {}
        self._names: dict[str, str] = {}
        for c in chips:
            self.add(c)

    def add(self, chip: ChipSpec, replace: bool = False) -> None:
        """Add ``chip``. Every name and alias must be new to the catalog; with ``replace`` the
        chip instead takes the place (and the position) of the catalog's chip of the same name,
        whose aliases go with it."""
        chip.validate()
        owner = self._names.get(chip.name.lower())
        if replace:
            if owner is None:
                raise NeuScaleError(
                    f"chip {chip.name!r} says override: true, but there is no chip of that name "
                    f"to replace (known: {', '.join(self.names())}); drop override to add it "
                    "as a new chip")
            if owner.lower() != chip.name.lower():
                raise NeuScaleError(
                    f"chip {chip.name!r} says override: true, but {chip.name!r} is an alias of "
                    f"chip {owner!r}: name the chip {owner!r} to replace it")
        elif owner is not None:
            if owner.lower() == chip.name.lower():
                raise NeuScaleError(
                    f"chip {chip.name!r} is already in the catalog: give the new chip another "
                    "name, or add `override: true` to its entry to replace the existing one")
            raise NeuScaleError(f"chip name {chip.name!r} is already used by chip {owner!r}")
        for n in chip.aliases:
            other = self._names.get(n.lower())
            if other is not None and other != owner:
                raise NeuScaleError(f"chip {chip.name!r}: alias {n!r} is already used by chip "
                                    f"{other!r}; remove it from aliases")
        if owner is None:
            self._chips[chip.name] = chip
        else:
            self._chips = {(chip.name if k == owner else k): (chip if k == owner else c)
                           for k, c in self._chips.items()}
            self._names = {n: k for n, k in self._names.items() if k != owner}
        for n in chip.all_names:
            self._names[n.lower()] = chip.name

    def get(self, name: str) -> ChipSpec:
        key = self._names.get(str(name).strip().lower())
        if key is None:
            raise NeuScaleError(
                f"unknown chip {name!r}; known chips: {', '.join(self.names())} "
                "(add one with --chip-file FILE.json|yaml)")
        return self._chips[key]

    def resolve(self, names: Iterable[str] | str | None) -> list[ChipSpec]:
        if names is None:
            return list(self._chips.values())
        if isinstance(names, str):
            names = [n for n in names.split(",") if n.strip()]
        out: list[ChipSpec] = []
        for n in names:
            c = self.get(n)
            if c not in out:
                out.append(c)
        if not out:
            raise NeuScaleError("no chips selected; pass e.g. --chips v4,v5e,v5p,v6e")
        return out

    def names(self) -> list[str]:
        return list(self._chips)

    def __iter__(self):
        return iter(self._chips.values())

    def __len__(self) -> int:
        return len(self._chips)

    def fingerprint(self) -> str:
        blob = json.dumps([c.to_json() for c in self], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_CHIP_FIELDS = {f.name for f in fields(ChipSpec)}
# fields a chip file may leave out: derived (static_power_w) or with a default
_OPTIONAL_FIELDS = {"static_power_w", "aliases", "sources"} | {
    f.name for f in fields(ChipSpec) if f.default is not MISSING}
MAX_CHIP_FILE_BYTES = 16 * MiB


def _chip_entry(d: Any, origin: str) -> tuple[ChipSpec, bool]:
    """A chip and its ``override`` flag from one chip-file entry (see :func:`load_chip_file`)."""
    if not isinstance(d, Mapping):
        raise NeuScaleError(f"{origin}: a chip entry must be an object of ChipSpec fields, "
                            f"not {_show(d)}")
    keys = [k for k in d if not isinstance(k, str)]
    if keys:
        raise NeuScaleError(f"{origin}: chip field names must be strings (got {_show(keys[0])})")
    name = d.get("name")
    label = f"chip {name!r}" if isinstance(name, str) and name else "chip entry"
    unknown = set(d) - _CHIP_FIELDS - {"override"}
    if unknown:
        raise NeuScaleError(f"{origin}: {label}: unknown chip field(s) {sorted(unknown)}; "
                            f"valid fields: {sorted(_CHIP_FIELDS | {'override'})}")
    missing = _CHIP_FIELDS - _OPTIONAL_FIELDS - set(d)
    if missing:
        raise NeuScaleError(f"{origin}: {label} is missing field(s) {sorted(missing)}")
    override = d.get("override", False)
    if not isinstance(override, bool):
        raise NeuScaleError(f"{origin}: {label}: override must be true or false "
                            f"(got {_show(override)})")
    kw = {k: v for k, v in d.items() if k != "override"}
    aliases = kw.get("aliases")
    if aliases is None:
        kw["aliases"] = ()
    elif isinstance(aliases, str):
        kw["aliases"] = (aliases,)            # one alias, not a string of one-letter aliases
    elif isinstance(aliases, list):
        kw["aliases"] = tuple(aliases)
    if kw.get("sources") is None:
        kw["sources"] = {"specs": origin}
    elif isinstance(kw["sources"], Mapping):
        kw["sources"] = dict(kw["sources"])
    derive = kw.get("static_power_w") is None
    vals = {f.name: f.default for f in fields(ChipSpec) if f.default is not MISSING}
    vals.update(kw)
    if derive:
        vals["static_power_w"] = 0.0          # derived below, once the rest is known valid
    problems = _field_problems(vals)
    if problems:
        raise NeuScaleError(f"{origin}: {label}: " + "; ".join(problems))
    if derive:
        del vals["static_power_w"]
    chip = _builtin(**vals)
    try:
        chip.validate()
    except NeuScaleError as e:
        raise NeuScaleError(f"{origin}: {e}") from None
    return chip, override


def chip_from_mapping(d: Mapping[str, Any], origin: str = "chip file") -> ChipSpec:
    """Build a chip from a mapping whose keys are ChipSpec fields (``static_power_w``,
    ``aliases``, ``sources`` and the fields with defaults optional; ``aliases`` a list of names
    or one name). Every field is checked for type and range; a bad one raises
    :class:`NeuScaleError` naming it."""
    return _chip_entry(d, origin)[0]


def _load_entries(path: str | Path) -> list[tuple[ChipSpec, bool]]:
    p = Path(path)
    yaml_file = p.suffix.lower() in (".yaml", ".yml")
    try:
        text = read_text(p, "chip file", MAX_CHIP_FILE_BYTES)
    except ValueError as e:
        if isinstance(e, NeuScaleError):
            raise
        raise NeuScaleError(f"cannot read chip file {str(p)!r}: {e}") from None
    try:
        if yaml_file:
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error becomes one message
        raise NeuScaleError(f"chip file {str(p)!r} is not valid "
                            f"{'YAML' if yaml_file else 'JSON'}: {e}") from None
    shape = "a chip object, a list of them or {\"chips\": [...]}"
    if isinstance(data, Mapping) and "chips" in data:
        extra = [k for k in data if k != "chips"]
        if extra:
            raise NeuScaleError(f"chip file {str(p)!r}: unexpected key {_show(extra[0])} beside "
                                f"'chips'; a chip file holds {shape}")
        data = data["chips"]
        if not isinstance(data, list):
            raise NeuScaleError(f"chip file {str(p)!r}: 'chips' must be a list of chip objects")
    items = data if isinstance(data, list) else [data]
    if not items:
        raise NeuScaleError(f"chip file {str(p)!r} holds no chips")
    if not all(isinstance(i, Mapping) for i in items):
        raise NeuScaleError(f"chip file {str(p)!r} must hold {shape}")
    out: list[tuple[ChipSpec, bool]] = []
    seen: set[str] = set()
    for i, item in enumerate(items, 1):
        entry = _chip_entry(item, str(p) if len(items) == 1 else f"{p} (entry {i})")
        if entry[0].name.lower() in seen:
            raise NeuScaleError(f"chip file {str(p)!r} defines chip {entry[0].name!r} twice; "
                                "keep one entry")
        seen.add(entry[0].name.lower())
        out.append(entry)
    return out


def load_chip_file(path: str | Path) -> list[ChipSpec]:
    """Read one chip or a list of chips (``{"chips": [...]}`` also accepted) from JSON or YAML
    (a regular UTF-8 file of at most 16 MiB). An entry may carry ``override: true`` (see
    :func:`default_catalog`)."""
    return [chip for chip, _ in _load_entries(path)]


def default_catalog(extra_files: Iterable[str | Path] = ()) -> Catalog:
    """The built-in chips plus those of ``extra_files`` (``--chip-file``), in order.

    A chip file adds new chips: a name or alias that the catalog already has (a built-in's, or
    one from an earlier file) is refused, and so is a chip defined twice. To replace a chip -
    e.g. a v6e at another price - give the entry the chip's name and ``override: true``: it
    takes the built-in's place (its aliases are the entry's, the old ones go).
    """
    cat = Catalog()
    seen: dict[str, str] = {}
    for f in extra_files:
        for chip, override in _load_entries(f):
            where = seen.get(chip.name.lower())
            if where is not None:
                raise NeuScaleError(f"chip {chip.name!r} is defined twice, in {where!r} and in "
                                    f"{str(f)!r}; keep one")
            seen[chip.name.lower()] = str(f)
            try:
                cat.add(chip, replace=override)
            except NeuScaleError as e:
                raise NeuScaleError(f"{f}: {e}") from None
    return cat

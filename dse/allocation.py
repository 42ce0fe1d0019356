"""An allocation named by its parts (model, chip version, chip count or pod shape, TP/PP/EP),
as a user types it: checked and completed into what the cost models take."""

from __future__ import annotations

from .catalog import Catalog, ChipSpec
from .costmodel import Parallelism, validate_parallelism
from .errors import NeuScaleError
from .models import ModelArch, load_model
from .vpod import ICITopology, compact_topology, is_pow2


def parse_allocation(catalog: Catalog, model: str | ModelArch, chip_name: str,
                     num_chips: int | None, topology: str | None, tp: int, pp: int = 1,
                     ep: int = 1, attn: str = "dp"
                     ) -> tuple[ModelArch, ChipSpec, ICITopology, Parallelism]:
    """(arch, chip, topology, parallelism): the topology defaults to the most compact shape of
    tp*pp*ep chips; a given chip count or shape must hold exactly tp*pp*ep chips; ``attn``
    the MoE stage layout (:class:`dse.parallel.Parallelism`)."""
    arch = model if isinstance(model, ModelArch) else load_model(model)
    chip = catalog.get(chip_name)
    par = Parallelism(tp, pp, ep, attn)
    validate_parallelism(arch, par)
    n = num_chips or par.chips
    if n != par.chips:
        raise NeuScaleError(f"{n} chips does not equal tp*pp*ep = {par.chips}")
    if topology:
        topo = ICITopology.parse(topology).for_chip(chip)
    elif not is_pow2(n):
        raise NeuScaleError(f"tp*pp*ep = {n} chips is not a power of two")
    else:
        topo = compact_topology(chip, n)
    if topo.num_chips != par.chips:
        raise NeuScaleError(f"{par} uses {par.chips} chips but topology {topo} has "
                            f"{topo.num_chips}")
    return arch, chip, topo, par

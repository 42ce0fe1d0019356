"""Chip model, second pass: TP all-reduces overlap the matmuls that feed them (part 3), and the
model's power is bounded by the measured maximum where one is published (part 5)."""
import dataclasses

import numpy as np
import pytest

from dse.builder import DSE, Candidate
from dse.catalog import default_catalog
from dse.costmodel import Parallelism
from dse.errors import NeuScaleError
from dse.models import load_model
from dse.vpod import ICITopology
from sim.chip import ChipModel, exposed_collective_s
from sim.hardware import COLLECTIVE_LAUNCH_S

CAT = default_catalog()


def test_exposed_collective_formula():
    assert exposed_collective_s(8.0, 0.0, 8) == 8.0           # nothing to hide under
    assert exposed_collective_s(8.0, 100.0, 8) == 1.0         # all but the first piece
    assert exposed_collective_s(8.0, 4.0, 8) == 4.0           # the matmul is too short
    assert exposed_collective_s(8.0, 4.0, 1) == 8.0


@pytest.mark.parametrize("phase,batch,seq", [("prefill", 1, 4096), ("decode", 64, 2048)])
def test_allreduce_hides_under_its_matmul_but_not_its_latency(phase, batch, seq):
    cm = ChipModel.of(load_model("llama3-70b"), CAT, "v6e", "2x4", 8)
    ops = {o.name: o for o in cm.step(phase, batch, seq).ops}
    t = batch * (seq if phase == "prefill" else 1)
    full = cm._collective("x", cm._ar, 8, t * cm.d.hidden * 2).time_s
    fixed = cm._ar.alpha_s + COLLECTIVE_LAUNCH_S
    for coll, mm in (("attn_allreduce", "o_proj"), ("mlp_allreduce", "down_proj")):
        got = ops[coll].time_s
        assert got == pytest.approx(fixed + exposed_collective_s(full - fixed, ops[mm].time_s, 8))
        assert fixed + (full - fixed) / 8 <= got + 1e-15 and got < full
        assert ops[coll].ici_bytes > 0            # the bytes (and their energy) all move


def test_roofline_overlap_shortens_tp_prefill_and_leaves_tp1_alone():
    arch = load_model("llama3-70b")
    dse = DSE(arch, CAT)
    chip = CAT.get("v6e")
    topo = ICITopology.parse("2x4").for_chip(chip)
    par = Parallelism(8)
    dse.ensure_fits([par], workers=1, progress=False)
    from dse import costmodel
    oc = dse.on_chip(chip, par, "prefill", np.asarray([1]), np.asarray([4096]))
    colls = costmodel.collectives(topo, chip, par)
    st = oc.stages[0]
    with_ov, _ = costmodel._ici(st, colls, 8)
    without, _ = costmodel._ici(st, colls, 1)
    assert 0 < with_ov < without
    assert 0 < st.pair_frac < 0.5                 # o_proj + down_proj of a Llama layer: ~35 %


def test_v4_power_is_bounded_by_its_measured_maximum():
    v4 = CAT.get("v4")
    assert v4.measured_max_power_w == 192.0 and "ISCA 2023" in v4.sources["power"]
    # the modelled peak-compute power of Table 2's efficiency is above the measurement
    assert v4.peak_flops_per_s / v4.max_flop_per_j > 192.0
    arch = load_model("llama3-8b")
    dse = DSE(arch, CAT)
    for chip_name, capped in (("v4", True), ("v5p", False)):
        chip = CAT.get(chip_name)
        topo = ICITopology.parse("2x2x1").for_chip(chip)
        par = Parallelism(4)
        dse.ensure_fits([par], workers=1, progress=False)
        r = dse.evaluate(Candidate(chip, topo, par), "prefill", np.asarray([8]),
                         np.asarray([4096]))
        watts = float(r.energy_j[0, 0] / r.cycle_s[0, 0] / 4)
        if capped:
            assert watts == pytest.approx(192.0)              # the roofline hits the cap
        else:
            assert watts > 192.0                              # no measurement: not bounded
        cm = ChipModel.of(arch, CAT, chip_name, "2x2x1", 4)
        for ph, b, s in (("prefill", 8, 4096), ("decode", 64, 1024)):
            x = cm.step(ph, b, s)
            assert x.energy_j / x.cycle_s / 4 <= (192.0 + 1e-9 if capped else 1e9)


def test_step_tables_respect_the_cap():
    from sim.stepcost import StepCostTable
    arch = load_model("llama3-8b")
    t = StepCostTable(ChipModel.of(arch, CAT, "v4", "2x2x1", 4))
    p = np.array([8192.0, 16384.0, 512.0])
    lat, e = t.step(p, p * p / 2, np.zeros(3), np.zeros(3))
    assert np.all(e / lat / 4 <= 192.0 + 1e-9)
    lat1, e1 = t.step1(16384.0, 16384.0 ** 2 / 2, 0.0, 0.0)
    assert e1 / lat1 / 4 <= 192.0 + 1e-9


def test_a_chip_file_measured_power_is_checked(tmp_path):
    from dse.catalog import load_chip_file
    spec = CAT.get("v6e").to_json()
    spec.update(name="v6e-x", aliases=[], measured_max_power_w=10.0)
    import json
    f = tmp_path / "c.json"
    f.write_text(json.dumps(spec))
    with pytest.raises(NeuScaleError, match="measured_max_power_w"):
        load_chip_file(f)
    spec["measured_max_power_w"] = "hot"
    f.write_text(json.dumps(spec))
    with pytest.raises(NeuScaleError, match="measured_max_power_w"):
        load_chip_file(f)
    c = dataclasses.replace(CAT.get("v6e"), measured_max_power_w=150.0)
    assert c.power_capped_j(1000.0, 2, 1.0) == 300.0 and c.power_capped_j(10.0, 2, 1.0) == 10.0

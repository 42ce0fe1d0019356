import json

import pytest

from dse import NeuScaleError, default_catalog, enumerate_topologies, load_chip_file
from dse.catalog import Catalog, chip_from_mapping
from dse.vpod import ICITopology, VChipConfig, VPodConfig


def test_table2_values_and_aliases():
    cat = default_catalog()
    assert cat.names() == ["v4", "v5e", "v5p", "v6e"]
    for alias, name in [("NPU-A", "v4"), ("npu-b", "v5e"), ("NPU-C", "v5p"), ("NPU-D", "v6e"),
                        ("trillium", "v6e"), ("v5litepod", "v5e")]:
        assert cat.get(alias).name == name
    v5p = cat.get("v5p")
    assert v5p.peak_flops_per_s == 459e12 and v5p.hbm_bytes == 95e9
    assert v5p.hbm_bw_bytes_per_s == 2765e9 and v5p.torus_dims == 3
    assert cat.get("v6e").systolic_width == 256 and cat.get("v5e").ici_links_per_chip == 4
    assert [c.price_usd_per_chip_hour for c in cat] == [3.22, 1.20, 4.20, 2.70]
    assert [c.chips_per_host for c in cat] == [4, 8, 4, 8]


def test_energy_calibration_reproduces_table2_at_both_roofline_ends():
    """A chip running flat out on one unit (static power included) gets Table 2's peak."""
    for c in default_catalog():
        p_compute = c.e_flop_j * c.peak_flops_per_s + c.static_power_w
        p_memory = c.e_hbm_j_per_byte * c.hbm_bw_bytes_per_s + c.static_power_w
        assert c.peak_flops_per_s / p_compute == pytest.approx(c.max_flop_per_j, rel=1e-12)
        assert c.hbm_bw_bytes_per_s / p_memory == pytest.approx(c.max_hbm_bytes_per_j, rel=1e-12)
        assert 0 < c.static_power_w < min(p_compute, p_memory)


def test_accelerator_type_naming():
    cat = default_catalog()
    assert cat.get("v5p").accelerator_type(4) == "v5p-8"       # TensorCores
    assert cat.get("v4").accelerator_type(32) == "v4-64"
    assert cat.get("v5e").accelerator_type(8) == "v5litepod-8"  # chips
    assert cat.get("v6e").accelerator_type(256) == "v6e-256"
    assert VPodConfig.parse("v5p:2x2x1").accelerator_type() == "v5p-8"


def test_unknown_chip_names_known_ones():
    with pytest.raises(NeuScaleError, match="unknown chip 'v9'.*v4, v5e, v5p, v6e"):
        default_catalog().get("v9")


def _spec(**over):
    d = default_catalog().get("v6e").to_json()
    d.pop("static_power_w")
    d.update({"name": "npu-x", "aliases": ["NPU-X"], **over})
    return d


def test_user_chip_from_json_and_yaml(tmp_path):
    j = tmp_path / "chip.json"
    j.write_text(json.dumps(_spec(price_usd_per_chip_hour=1.5)))
    cat = default_catalog([j])
    assert cat.get("NPU-X").price_usd_per_chip_hour == 1.5
    assert cat.get("npu-x").static_power_w > 0  # derived like the built-in chips
    y = tmp_path / "chips.yaml"
    import yaml
    y.write_text(yaml.safe_dump({"chips": [_spec(name="npu-y", aliases=[])]}))
    assert default_catalog([y]).get("npu-y").hbm_bytes == 32e9


@pytest.mark.parametrize("over,msg", [
    ({"torus_dims": 4}, "torus_dims must be 2 or 3"),
    ({"peak_flops_per_s": -1}, "peak_flops_per_s must be a positive number"),
    ({"static_power_w": 500.0}, "exceeds the chip's power"),
    ({"bogus": 1}, "unknown chip field"),
])
def test_bad_user_chip_names_the_problem(tmp_path, over, msg):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(_spec(**over)))
    with pytest.raises(NeuScaleError, match=msg):
        default_catalog([f])


def test_chip_file_errors(tmp_path):
    with pytest.raises(NeuScaleError, match="no chip file at"):
        load_chip_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(NeuScaleError, match="not valid JSON"):
        load_chip_file(bad)
    d = _spec()
    del d["hbm_bytes"]
    with pytest.raises(NeuScaleError, match="missing field.*hbm_bytes"):
        chip_from_mapping(d)
    cat = Catalog()
    with pytest.raises(NeuScaleError, match="already used"):
        cat.add(chip_from_mapping(_spec(aliases=["NPU-C"])))


def test_topology_validation():
    v5e, v4 = default_catalog().get("v5e"), default_catalog().get("v4")
    with pytest.raises(NeuScaleError, match="power of two"):
        ICITopology.parse("3x2")
    with pytest.raises(NeuScaleError, match="form AxB"):
        ICITopology.parse("2by2")
    with pytest.raises(NeuScaleError, match="3D but v5e has a 2D torus"):
        ICITopology.parse("2x2x2").for_chip(v5e)
    with pytest.raises(NeuScaleError, match="at most 16 chips"):
        ICITopology.parse("32x1").for_chip(v5e)
    assert ICITopology.parse("2x2").for_chip(v4).dims == (2, 2, 1)
    assert ICITopology.parse("4x4x4").has_wraparound(v4)
    assert not ICITopology.parse("4x4x2").has_wraparound(v4)
    assert ICITopology.parse("16x16").has_wraparound(v5e)
    assert not ICITopology.parse("8x16").has_wraparound(v5e)


def test_vpod_value_semantics():
    a = VPodConfig.parse("v5p:2x2x1")
    b = VPodConfig.make("NPU-C", "2x2x1")
    assert a == b and hash(a) == hash(b) and a.num_chips == 4
    assert VPodConfig.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert sorted([VPodConfig.parse("v6e:2x2"), VPodConfig.parse("v5e:4x4"), a])[0].version == "v5e"
    assert str(a) == "v5p:2x2x1" and a.num_hosts() == 1
    assert VPodConfig.parse("v6e:4x4").num_hosts() == 2
    assert a.vchip() == VChipConfig.from_chip(default_catalog().get("v5p"))
    with pytest.raises(NeuScaleError, match="has 4 chips, not num_chips=8"):
        VPodConfig("v5p", ICITopology((2, 2, 1)), 8)
    with pytest.raises(NeuScaleError, match="CHIP:TOPOLOGY"):
        VPodConfig.parse("v5p")


def test_enumerated_topologies_are_valid_and_distinct():
    for chip in default_catalog():
        topos = enumerate_topologies(chip)
        assert len(set(topos)) == len(topos)
        assert all(t.num_chips <= 1024 and t.ndim == chip.torus_dims for t in topos)
        assert all(list(t.dims) == sorted(t.dims, reverse=True) for t in topos)
        counts = {t.num_chips for t in topos}
        assert counts == {2 ** k for k in range(11 if chip.torus_dims == 3 else 9)}


def test_vpod_usd_is_chips_times_price_times_time():
    import numpy as np
    v5p = default_catalog().get("v5p")
    assert v5p.vpod_usd(8, 3600.0) == pytest.approx(8 * 4.20)
    np.testing.assert_allclose(v5p.vpod_usd(np.array([1, 4]), np.array([[1.0], [2.0]])),
                               4.20 / 3600 * np.array([[1, 4], [2, 8]]), rtol=1e-15)

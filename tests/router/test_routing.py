import numpy as np
import pytest

from dse import SEQ_BUCKETS, NeuScaleError
from router.routing import (RoutingTable, bucket_indices, crossed_bucket, free_slot_first,
                            handing_over, least_loaded, make_before_break, should_migrate)


def table():
    # buckets 0-7 (<= 1024) -> A, 8-15 (<= 4096) -> B, 16+ -> C; only some buckets given
    return RoutingTable.build({3: "A", 7: "A", 11: "B", 15: "B", 20: "C"})


def test_build_fills_gaps_from_nearest_bucket():
    t = table()
    assert t.group_for_length(1) == "A" and t.group_for_length(1024) == "A"
    assert t.group_for_length(1025) == "A"      # bucket 8: nearest given is 7
    assert t.group_for_length(3000) == "B" and t.group_for_length(1 << 20) == "C"
    assert t.best_len == {"A": 1024, "B": 4096, "C": SEQ_BUCKETS[20]}
    with pytest.raises(NeuScaleError):
        RoutingTable.build({})


def test_bucket_boundaries_and_vectorised_buckets():
    t = table()
    assert t.next_boundary(1) == 129 and t.next_boundary(128) == 129
    assert t.next_boundary(129) == 257                 # 129 is in the bucket <= 256
    assert t.next_boundary(SEQ_BUCKETS[-1]) == SEQ_BUCKETS[-1] + 1
    assert t.next_boundary(SEQ_BUCKETS[-1] + 1) is None
    lengths = np.array([1, 128, 129, 5000, 10 ** 9])
    assert bucket_indices(t.edges, lengths).tolist() == [t.bucket(x) for x in lengths]


def test_least_loaded_and_reprediction():
    loads = {"a": 3, "b": 1, "c": 1}
    assert least_loaded(loads, loads.__getitem__) == "b"       # ties: the first
    assert least_loaded(["x", "yy", "z"], len) == "x"
    with pytest.raises(NeuScaleError):
        least_loaded([], len)
    t = table()
    assert crossed_bucket(t, 127, 129) and not crossed_bucket(t, 129, 200)


def test_free_slot_first_prefers_a_vpod_with_room_over_a_lighter_full_one():
    held = {"a": 1.0, "b": 0.5, "c": 0.9}          # a full, b and c with a slot free
    load = {"a": 0.1, "b": 3.0, "c": 2.0}
    assert least_loaded(held, load.__getitem__) == "a"
    assert free_slot_first(held, held.__getitem__, load.__getitem__) == "c"
    full = {"a": 1.0, "b": 1.5}                     # none free: the least load
    assert free_slot_first(full, full.__getitem__, load.__getitem__) == "a"
    with pytest.raises(NeuScaleError):
        free_slot_first([], len, len)


def test_migrate_past_twice_the_best_fit_length():
    t = table()
    assert should_migrate(t, "A", 2000, 2000) is None           # < 2 x 1024
    assert should_migrate(t, "A", 2049, 2049) == "B"
    assert should_migrate(t, "A", 1500, 5000) == "B"             # the new estimate decides
    assert should_migrate(t, "B", 9000, 9000) == "C"
    assert should_migrate(t, "C", 10 ** 6, 10 ** 6) is None      # nothing longer


def test_make_before_break_keeps_buckets_on_running_groups_until_the_new_one_is_ready():
    edges = (128, 256, 512, 1024)
    old = RoutingTable.build({0: "a", 1: "a", 2: "b", 3: "b"}, edges)   # a <= 256, b <= 1024
    new = RoutingTable.build({0: "c", 1: "b", 2: "b", 3: "d"}, edges)   # c, d new; a merged
    up = {"a", "b"}
    eff = make_before_break(new, old, up.__contains__)
    # bucket 0: c is starting, a is running and was sized for it -> stays on a
    # bucket 1: b is running -> switches now; bucket 3: d starting, b running and sized -> b
    assert eff.groups == ("a", "b", "b", "b")
    assert eff.best_len["a"] == 256 and eff.best_len["c"] == 128
    up |= {"c", "d"}
    assert make_before_break(new, eff, up.__contains__) is new      # all ready: the plan
    assert make_before_break(new, None, up.__contains__) is new
    # an old group sized for shorter sequences does not take a longer bucket
    short = RoutingTable.build({0: "a"}, edges)                        # a serves all, best 128
    grown = RoutingTable.build({0: "a", 3: "d"}, edges)
    eff = make_before_break(grown, short, {"a"}.__contains__)
    assert eff.groups[3] == "d"


def test_handing_over_names_groups_that_still_serve_buckets_planned_elsewhere():
    """A re-choice gives the short bucket to a new group that is still starting: the old group
    keeps it (make_before_break) and is named as handing over until the new one is up; an
    evicted group is handing over while it still carries a bucket; nothing is once the table in
    force is the plan."""
    edges = (512, 1024, 2048)
    old = RoutingTable.build({1: "a", 2: "b"}, edges)
    planned = RoutingTable.build({0: "n", 1: "n", 2: "b"}, edges)
    ready = {"a", "b"}
    eff = make_before_break(planned, old, lambda g: g in ready)
    assert eff.groups == ("a", "a", "b") and handing_over(eff, planned) == {"a"}
    ready.add("n")
    eff = make_before_break(planned, eff, lambda g: g in ready)
    assert eff.groups == planned.groups and handing_over(eff, planned) == set()
    # the plan drops "b" for "c" (evicted), "a" keeps its buckets: only "b" is handing over
    planned2 = RoutingTable.build({1: "a", 2: "c"}, edges)
    eff2 = make_before_break(planned2, old, lambda g: g in {"a", "b"})
    assert handing_over(eff2, planned2) == {"b"}
    assert handing_over(None, planned2) == set() and handing_over(planned2, None) == set()


def test_ready_group_starts_a_request_on_the_shortest_ready_group_that_holds_it():
    from router.routing import ready_group
    t = RoutingTable.build({0: "a", 3: "b", 7: "c", 11: "d"})    # best: 128, 512, 1024, 2048
    up = {"a", "b", "d"}
    ready = up.__contains__
    assert ready_group(t, "b", 300, ready) == "b"           # its own group is up
    assert ready_group(t, "c", 300, ready) == "b"           # c starting: b holds 300 tokens
    assert ready_group(t, "c", 600, ready) == "d"           # b is too short for 600
    assert ready_group(t, "c", 100, ready) == "a"           # the shortest that holds it
    assert ready_group(t, "c", 3000, ready) is None         # none holds it: wait for c
    assert ready_group(t, "c", 300, lambda g: False) is None

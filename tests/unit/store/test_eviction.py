"""The eviction queue: records come out lowest (score, record) first, exactly, whatever is
pushed, re-pushed or dropped while a batch is being served (pure code)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcr.store.eviction import EvictionQueue

RECS = 12
scores = st.sampled_from([-math.inf, 0.0, 1.0, 2.0, 2.5, math.inf, math.nan])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, RECS - 1), scores),
        st.tuples(st.just("drop"), st.integers(0, RECS - 1), st.just(0.0)),
        st.tuples(st.just("pop"), st.just(0), st.just(0.0)),
        st.tuples(st.just("push_many"), st.integers(0, RECS - 1), scores),
        st.tuples(st.just("pop_many"), st.integers(1, 5), st.just(0.0)),
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(ops=ops, batch=st.integers(1, 4))
def test_pops_follow_the_latest_score_of_every_queued_record(ops, batch) -> None:
    # A batch of 1-4 records out of 12: pushes land below, inside and above the batch.
    queue = EvictionQueue(RECS, batch_min=batch)
    model: dict[int, float] = {}
    for op, rec, drawn in ops:
        score = math.inf if math.isnan(drawn) else drawn  # NaN counts as +inf
        if op == "push":
            queue.push(rec, drawn)
            model[rec] = score
        elif op == "push_many":  # this record and the next two, one score
            recs = np.array(sorted({rec, (rec + 1) % RECS, (rec + 2) % RECS}))
            queue.push_many(recs, np.full(len(recs), drawn))
            model.update(dict.fromkeys(recs.tolist(), score))
        elif op == "pop_many":  # rec: how many
            expected = [r for r, _ in sorted(model.items(), key=lambda i: (i[1], i[0]))][:rec]
            assert queue.pop_many(rec) == expected
            for r in expected:
                del model[r]
        elif op == "drop":
            queue.drop(rec)
            model.pop(rec, None)
        else:
            expected = min(model.items(), key=lambda item: (item[1], item[0]), default=None)
            got = queue.pop()
            assert got == (None if expected is None else expected[0])
            if got is not None:
                del model[got]
        assert len(queue) == len(model)
    drained = []
    while (rec := queue.pop()) is not None:
        drained.append(rec)
    assert drained == [rec for rec, _ in sorted(model.items(), key=lambda i: (i[1], i[0]))]


def test_a_queue_of_recovered_blocks_pops_in_record_order() -> None:
    queue = EvictionQueue(5000, batch_min=16)
    queue.push_all(np.arange(5000)[::-1].copy(), -math.inf)  # all without recency
    queue.push(7, 1.0)  # accessed since: last
    order = [queue.pop() for _ in range(5000)]
    assert order[:3] == [0, 1, 2] and order[-1] == 7 and sorted(order) == list(range(5000))
    assert queue.pop() is None

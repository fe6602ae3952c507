"""Behaviour of the admission/eviction policies in ``kvcr.policy``."""

from __future__ import annotations

import pytest

from kvcr.policy import (
    FIFOPolicy,
    G3FIFOPolicy,
    G3LRUPolicy,
    KVCachePolicy,
    LRUPolicy,
)
from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    PlacementAction,
    PlacementFailure,
)

ALL_POLICIES = [KVCachePolicy, LRUPolicy, FIFOPolicy, G3LRUPolicy, G3FIFOPolicy]
PLAIN_POLICIES = [KVCachePolicy, LRUPolicy, FIFOPolicy]
G3_POLICIES = [G3LRUPolicy, G3FIFOPolicy]
LRU_SCORED = [KVCachePolicy, LRUPolicy, G3LRUPolicy]
FIFO_SCORED = [FIFOPolicy, G3FIFOPolicy]

STORE_LOCAL = (PlacementAction.COPY_TO, CacheTier.LOCAL_G2)
DROP = (PlacementAction.DROP, None)
SPILL_TO_G3 = (PlacementAction.MOVE_TO, CacheTier.G3)

G2 = CacheTier.LOCAL_G2
G3 = CacheTier.G3


def meta(
    key: bytes = b"k",
    *,
    last_access: float | None = 1.0,
    tiers: frozenset[CacheTier] = frozenset({G2}),
    access_count: int = 1,
) -> BlockMeta:
    return BlockMeta(
        block_key=BlockKey(key),
        size_bytes=4096,
        access_count=access_count,
        last_access=last_access,
        resident_tiers=tiers,
    )


def failure(source: CacheTier = G2) -> PlacementFailure:
    return PlacementFailure(SPILL_TO_G3, source, "disk full", 1)


def ids(classes) -> list[str]:
    return [cls.__name__ for cls in classes]


# --- construction and class relationships ----------------------------------------------------


@pytest.mark.parametrize("policy_cls", ALL_POLICIES, ids=ids(ALL_POLICIES))
def test_every_policy_constructs_with_no_arguments_and_is_a_kv_cache_policy(policy_cls):
    assert isinstance(policy_cls(), KVCachePolicy)


@pytest.mark.parametrize("policy_cls", PLAIN_POLICIES, ids=ids(PLAIN_POLICIES))
def test_plain_policies_require_no_tier(policy_cls):
    assert policy_cls().required_tiers == frozenset()


@pytest.mark.parametrize("policy_cls", G3_POLICIES, ids=ids(G3_POLICIES))
def test_g3_policies_require_exactly_the_g3_tier(policy_cls):
    assert policy_cls().required_tiers == frozenset({G3})


def test_g3_policies_are_their_plain_counterparts_plus_spilling():
    assert issubclass(G3LRUPolicy, LRUPolicy)
    assert issubclass(G3FIFOPolicy, FIFOPolicy)


# --- admission -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", ALL_POLICIES, ids=ids(ALL_POLICIES))
@pytest.mark.parametrize("source", [CacheTier.FW_G1, CacheTier.FW_G2, CacheTier.REMOTE_G2, G3])
@pytest.mark.parametrize("required_local", [True, False])
def test_every_policy_stores_every_offered_block_in_local_g2(policy_cls, source, required_local):
    decision = policy_cls().decide_ingest(meta(), source, required_local)
    assert decision == STORE_LOCAL


@pytest.mark.parametrize("policy_cls", ALL_POLICIES, ids=ids(ALL_POLICIES))
def test_ingest_decision_ignores_router_and_framework_hints(policy_cls):
    decision = policy_cls().decide_ingest(
        meta(),
        CacheTier.FW_G1,
        False,
        router_hints={"kv_hint": {"actions": []}},
        framework_hints={"priority": "low"},
    )
    assert decision == STORE_LOCAL


# --- LRU scoring -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", LRU_SCORED, ids=ids(LRU_SCORED))
def test_lru_score_is_the_last_access_time(policy_cls):
    assert policy_cls().eviction_score(meta(last_access=123.25), G2) == 123.25


@pytest.mark.parametrize("policy_cls", LRU_SCORED, ids=ids(LRU_SCORED))
def test_lru_scores_older_accesses_lower_so_they_are_evicted_first(policy_cls):
    policy = policy_cls()
    old = policy.eviction_score(meta(b"old", last_access=10.0), G2)
    recent = policy.eviction_score(meta(b"recent", last_access=20.0), G2)
    assert old < recent


@pytest.mark.parametrize("policy_cls", LRU_SCORED, ids=ids(LRU_SCORED))
def test_lru_scores_a_never_accessed_block_below_any_accessed_one(policy_cls):
    policy = policy_cls()
    never = policy.eviction_score(meta(b"never", last_access=None), G2)
    for accessed in (-1e300, 0.0, 1.0):
        assert never < policy.eviction_score(meta(b"seen", last_access=accessed), G2)


@pytest.mark.parametrize("policy_cls", LRU_SCORED, ids=ids(LRU_SCORED))
def test_lru_score_depends_only_on_the_meta_not_on_earlier_calls(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a", last_access=5.0), G2)
    policy.on_ingest(meta(b"b", last_access=1.0), G2)
    assert policy.eviction_score(meta(b"a", last_access=5.0), G2) == 5.0
    assert policy.eviction_score(meta(b"b", last_access=1.0), G2) == 1.0


# --- FIFO scoring ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_scores_blocks_in_ingest_order(policy_cls):
    policy = policy_cls()
    for key in (b"first", b"second", b"third"):
        policy.on_ingest(meta(key), G2)
    scores = [policy.eviction_score(meta(key), G2) for key in (b"first", b"second", b"third")]
    assert scores == sorted(scores)
    assert len(set(scores)) == 3


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_order_ignores_later_accesses(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"first", last_access=1.0), G2)
    policy.on_ingest(meta(b"second", last_access=2.0), G2)
    first = policy.eviction_score(meta(b"first", last_access=99.0, access_count=50), G2)
    second = policy.eviction_score(meta(b"second", last_access=None), G2)
    assert first < second


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_score_is_stable_across_repeated_scoring(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a"), G2)
    assert policy.eviction_score(meta(b"a"), G2) == policy.eviction_score(meta(b"a"), G2)


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_ingesting_a_resident_block_again_keeps_its_place(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a"), G2)
    policy.on_ingest(meta(b"b"), G2)
    policy.on_ingest(meta(b"a"), G2)
    assert policy.eviction_score(meta(b"a"), G2) < policy.eviction_score(meta(b"b"), G2)


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_scores_a_block_scored_before_its_ingest_hook_by_first_sight(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a"), G2)
    early = policy.eviction_score(meta(b"new"), G2)
    policy.on_ingest(meta(b"new"), G2)
    policy.on_ingest(meta(b"later"), G2)
    assert policy.eviction_score(meta(b"new"), G2) == early
    assert policy.eviction_score(meta(b"a"), G2) < early < policy.eviction_score(meta(b"later"), G2)


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_forgets_a_removed_block_so_it_re_enters_at_the_back(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a"), G2)
    policy.on_ingest(meta(b"b"), G2)
    policy.on_remove(meta(b"a"))
    policy.on_ingest(meta(b"a"), G2)
    assert policy.eviction_score(meta(b"b"), G2) < policy.eviction_score(meta(b"a"), G2)


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_remove_forgets_the_key_in_every_tier(policy_cls):
    both = frozenset({G2, G3})
    policy = policy_cls()
    policy.on_ingest(meta(b"a", tiers=both), G2)
    policy.on_ingest(meta(b"b", tiers=both), G2)
    policy.on_remove(meta(b"a", tiers=both))
    policy.on_ingest(meta(b"a", tiers=both), G2)
    for tier in (G2, G3):
        assert policy.eviction_score(meta(b"b"), tier) < policy.eviction_score(meta(b"a"), tier)


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_remove_of_an_unknown_block_is_harmless(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a"), G2)
    before = policy.eviction_score(meta(b"a"), G2)
    policy.on_remove(meta(b"never-ingested"))
    policy.on_ingest(meta(b"b"), G2)
    assert policy.eviction_score(meta(b"a"), G2) == before
    assert before < policy.eviction_score(meta(b"b"), G2)


@pytest.mark.parametrize("policy_cls", FIFO_SCORED, ids=ids(FIFO_SCORED))
def test_fifo_keeps_a_separate_order_per_tier(policy_cls):
    policy = policy_cls()
    policy.on_ingest(meta(b"a", tiers=frozenset({G2})), G2)
    policy.on_ingest(meta(b"b", tiers=frozenset({G2})), G2)
    policy.on_ingest(meta(b"b", tiers=frozenset({G2, G3})), G3)  # b spilled to G3 first
    policy.on_ingest(meta(b"a", tiers=frozenset({G2, G3})), G3)
    assert policy.eviction_score(meta(b"a"), G2) < policy.eviction_score(meta(b"b"), G2)
    assert policy.eviction_score(meta(b"b"), G3) < policy.eviction_score(meta(b"a"), G3)


def test_fifo_policies_do_not_share_order_state():
    first, second = FIFOPolicy(), FIFOPolicy()
    first.on_ingest(meta(b"a"), G2)
    first.on_ingest(meta(b"b"), G2)
    second.on_ingest(meta(b"b"), G2)
    second.on_ingest(meta(b"a"), G2)
    assert first.eviction_score(meta(b"a"), G2) < first.eviction_score(meta(b"b"), G2)
    assert second.eviction_score(meta(b"b"), G2) < second.eviction_score(meta(b"a"), G2)


# --- eviction --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", PLAIN_POLICIES, ids=ids(PLAIN_POLICIES))
@pytest.mark.parametrize("source", [G2, G3])
def test_plain_policies_drop_evicted_blocks(policy_cls, source):
    assert policy_cls().decide_eviction(meta(), source) == DROP


@pytest.mark.parametrize("policy_cls", G3_POLICIES, ids=ids(G3_POLICIES))
def test_g3_policies_spill_a_local_g2_eviction_to_g3(policy_cls):
    assert policy_cls().decide_eviction(meta(tiers=frozenset({G2})), G2) == SPILL_TO_G3


@pytest.mark.parametrize("policy_cls", G3_POLICIES, ids=ids(G3_POLICIES))
def test_g3_policies_drop_a_local_g2_eviction_already_resident_in_g3(policy_cls):
    assert policy_cls().decide_eviction(meta(tiers=frozenset({G2, G3})), G2) == DROP


@pytest.mark.parametrize("policy_cls", G3_POLICIES, ids=ids(G3_POLICIES))
@pytest.mark.parametrize(
    "tiers", [frozenset({G3}), frozenset({G2, G3})], ids=["only-g3", "g2-and-g3"]
)
def test_g3_policies_drop_a_g3_eviction(policy_cls, tiers):
    assert policy_cls().decide_eviction(meta(tiers=tiers), G3) == DROP


# --- recovery --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", ALL_POLICIES, ids=ids(ALL_POLICIES))
@pytest.mark.parametrize("source", [G2, G3])
def test_every_policy_drops_a_block_whose_placement_failed(policy_cls, source):
    assert policy_cls().decide_recovery(meta(), failure(source)) == DROP


# --- hooks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", ALL_POLICIES, ids=ids(ALL_POLICIES))
def test_state_hooks_accept_their_arguments_and_return_none(policy_cls):
    policy = policy_cls()
    assert policy.on_ingest(meta(b"a"), G2) is None
    assert policy.on_align_sequence([meta(b"a"), meta(b"b")], True) is None
    assert policy.on_align_sequence([], False) is None
    assert policy.on_remove(meta(b"a")) is None


# --- customisation ---------------------------------------------------------------------------


class KeepHotBlocks(LRUPolicy):
    """Overrides one hook: refuses to evict blocks accessed more than twice."""

    def decide_eviction(self, meta, source):
        if meta.access_count > 2:
            return (PlacementAction.KEEP, None)
        return super().decide_eviction(meta, source)


def test_custom_policy_overriding_one_hook_changes_only_that_hook():
    policy = KeepHotBlocks()
    assert policy.decide_eviction(meta(access_count=3), G2) == (PlacementAction.KEEP, None)
    assert policy.decide_eviction(meta(access_count=1), G2) == DROP


def test_custom_policy_inherits_every_other_hook():
    policy = KeepHotBlocks()
    assert policy.required_tiers == frozenset()
    assert policy.decide_ingest(meta(), CacheTier.FW_G1, False) == STORE_LOCAL
    assert policy.eviction_score(meta(last_access=7.0), G2) == 7.0
    assert policy.decide_recovery(meta(), failure()) == DROP
    assert policy.on_ingest(meta(), G2) is None


def test_custom_policy_on_top_of_a_g3_policy_inherits_spilling_and_required_tiers():
    class QuietG3(G3FIFOPolicy):
        def decide_ingest(
            self, meta, source, required_local, router_hints=None, framework_hints=None
        ):
            return DROP

    policy = QuietG3()
    assert policy.decide_ingest(meta(), CacheTier.FW_G1, False) == DROP
    assert policy.required_tiers == frozenset({G3})
    assert policy.decide_eviction(meta(), G2) == SPILL_TO_G3

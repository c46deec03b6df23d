"""The placement plan, without Ray: roles on bundles, colocated / disaggregated, TP-matched engines."""

import pytest

from megarl.parallel import ParallelDims
from megarl.plan.placement import PoolSpec, make_placement, megatron_coordinates, plan_placement


def test_pool_spec_locates_bundles_node_by_node():
    pool = PoolSpec("global", (8, 8))
    assert pool.size == 16
    assert pool.locate(0) == (0, 0)
    assert pool.locate(7) == (0, 7)
    assert pool.locate(8) == (1, 0)
    assert pool.locate(15) == (1, 7)
    with pytest.raises(ValueError, match="bundles 0..15"):
        pool.locate(16)
    with pytest.raises(ValueError, match="positive GPU counts"):
        PoolSpec("bad", (8, 0))


def test_megatron_rank_order_is_tp_cp_dp_pp():
    dims = ParallelDims(tp=2, pp=2).for_world(8)  # dp = 2
    coords = [megatron_coordinates(r, dims) for r in range(8)]
    assert coords[:4] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0)]
    assert coords[4:] == [(0, 0, 0, 1), (1, 0, 0, 1), (0, 0, 1, 1), (1, 0, 1, 1)]


def test_colocated_single_node_tp2_engines_match_dp_replicas():
    plan = make_placement(nodes=[4], actor=ParallelDims(tp=2), ref=ParallelDims(tp=2))
    assert plan.colocated
    assert set(plan.pools) == {"global"}
    for role in ("actor", "ref", "rollout"):
        assert plan.role(role).pool == "global"
        assert plan.role(role).bundles == (0, 1, 2, 3)
    assert plan.role("actor").dims.dp == 2
    assert plan.colocate_count("global") == 3
    assert plan.gpu_fraction("actor") == pytest.approx(1 / 3)
    assert [e.bundles for e in plan.engines] == [(0, 1), (2, 3)]
    assert all(e.tp_matched and e.tp == 2 for e in plan.engines)
    assert [e.dp_rank for e in plan.engines] == [0, 1]
    assert [e.actor_ranks for e in plan.engines] == [(0, 1), (2, 3)]
    assert plan.engines_of_replica(1) == [plan.engines[1]]
    assert "2 engines of TP 2 (TP-matched" in plan.describe()


def test_two_nodes_eight_gpus_with_critic():
    plan = make_placement(nodes=[4, 4], actor=ParallelDims(tp=2), ref=ParallelDims(tp=2), critic=ParallelDims(tp=4))
    assert plan.role("actor").dims.dp == 4
    assert plan.role("critic").dims.dp == 2
    assert plan.colocate_count("global") == 4  # actor, ref, critic, rollout share every bundle
    assert [e.bundles for e in plan.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [e.node for e in plan.engines] == [0, 0, 1, 1]
    assert [e.dp_rank for e in plan.engines] == [0, 1, 2, 3]


def test_pp_engine_layouts():
    # 2 nodes × 4 GPUs, actor tp=2 pp=2 → dp=2; replica 0 holds ranks 0,1 (stage 0) and 4,5 (stage 1).
    dims = ParallelDims(tp=2, pp=2)
    per_group = make_placement(nodes=[4, 4], actor=dims)
    assert per_group.engine_layout == "per_tp_group"
    assert [(e.dp_rank, e.pp_rank, e.bundles) for e in per_group.engines] == [
        (0, 0, (0, 1)), (0, 1, (4, 5)), (1, 0, (2, 3)), (1, 1, (6, 7))]
    assert [e.index for e in per_group.engines] == [0, 1, 2, 3]
    assert [e.bundles for e in per_group.engines_of_replica(0)] == [(0, 1), (4, 5)]
    per_replica = make_placement(nodes=[4, 4], actor=dims, engine_layout="per_replica")
    assert [(e.index, e.dp_rank, e.bundles) for e in per_replica.engines] == [(0, 0, (0, 1)), (1, 1, (2, 3))]
    with pytest.raises(ValueError, match="engine_layout"):
        make_placement(nodes=[4], actor=dims, engine_layout="spread")


def test_70b_eight_nodes_by_eight_gpus():
    dims = ParallelDims(tp=8, pp=4)
    plan = make_placement(nodes=[8] * 8, actor=dims, ref=ParallelDims(tp=8, pp=2))
    actor = plan.role("actor")
    assert actor.world_size == 64 and actor.dims.dp == 2
    assert plan.role("ref").dims.dp == 4
    assert len(plan.engines) == 8  # one engine per node: every TP group of 8 GPUs
    for engine in plan.engines:
        assert engine.tp == 8 and engine.tp_matched
        assert {plan.pools["global"].node_of(b) for b in engine.bundles} == {engine.node}
    # Replica d's engines sit on its 4 pipeline stages: nodes d, d+2, d+4, d+6.
    assert [e.node for e in plan.engines_of_replica(0)] == [0, 2, 4, 6]
    assert [e.node for e in plan.engines_of_replica(1)] == [1, 3, 5, 7]
    per_replica = make_placement(nodes=[8] * 8, actor=dims, engine_layout="per_replica")
    assert [(e.dp_rank, e.node) for e in per_replica.engines] == [(0, 0), (1, 1)]


def test_disaggregated_rollout_pool():
    plan = make_placement(nodes=[8], actor=ParallelDims(tp=2), ref=ParallelDims(tp=2), rollout_nodes=[4])
    assert not plan.colocated
    assert plan.role("rollout").pool == "rollout"
    assert plan.role("rollout").bundles == (0, 1, 2, 3)
    assert plan.colocate_count("global") == 2 and plan.colocate_count("rollout") == 1
    assert plan.gpu_fraction("rollout") == 1.0
    assert [e.bundles for e in plan.engines] == [(0, 1), (2, 3)]
    assert not any(e.tp_matched for e in plan.engines)
    assert all(e.dp_rank is None for e in plan.engines)
    wide = make_placement(nodes=[8], actor=ParallelDims(tp=2), rollout_nodes=[8], engine_tp=4)
    assert [e.bundles for e in wide.engines] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_colocated_engine_tp_different_from_actor_is_not_matched():
    plan = make_placement(nodes=[4], actor=ParallelDims(tp=1), engine_tp=2)
    assert [e.bundles for e in plan.engines] == [(0, 1), (2, 3)]
    assert not plan.engines[0].tp_matched


def test_an_engine_may_span_whole_nodes():
    """TP=16 over two 8-GPU nodes (and TP=4 over two 2-GPU nodes): SGLang's multi-node engine."""
    plan = make_placement(nodes=[8, 8], actor=ParallelDims(tp=8), engine_tp=16)
    (engine,) = plan.engines
    assert (engine.bundles, engine.nodes, engine.node, engine.tp_matched) == (tuple(range(16)), (0, 1), 0, False)
    plan = make_placement(nodes=[2, 2, 2, 2], actor=ParallelDims(tp=1), engine_tp=4)
    assert [e.nodes for e in plan.engines] == [(0, 1), (2, 3)]
    assert [e.nodes for e in make_placement(nodes=[8, 8], actor=ParallelDims(tp=4)).engines] == [(0,), (0,), (1,), (1,)]


def test_errors_name_the_key():
    with pytest.raises(ValueError, match="actor.parallel on pool 'global'"):
        make_placement(nodes=[6], actor=ParallelDims(tp=4))
    with pytest.raises(ValueError, match="rollout.tp=3 does not divide"):
        make_placement(nodes=[4], actor=ParallelDims(tp=1), engine_tp=3)
    with pytest.raises(ValueError, match=r"rollout.tp=4: an engine of 4 GPUs would hold \[2, 2\] GPUs of nodes "
                                         r"\[0, 1\].*must take whole nodes of equal size"):
        make_placement(nodes=[2, 4, 2], actor=ParallelDims(tp=1), engine_tp=4)
    with pytest.raises(ValueError, match=r"rollout.tp=6: an engine of 6 GPUs would hold \[2, 4\]"):
        make_placement(nodes=[2, 4], actor=ParallelDims(tp=1), engine_tp=6)
    with pytest.raises(ValueError, match="actor.parallel.tp=4"):
        make_placement(nodes=[2, 2], actor=ParallelDims(tp=4))
    with pytest.raises(ValueError, match="must place role 'rollout'"):
        plan_placement({"global": [4]}, {"actor": "global"}, {"actor": ParallelDims()})
    with pytest.raises(ValueError, match="role 'critic' is placed but has no parallel layout"):
        plan_placement({"global": [4]}, {"actor": "global", "rollout": "global", "critic": "global"},
                       {"actor": ParallelDims()})
    with pytest.raises(ValueError, match="maps to pool 'gen'"):
        plan_placement({"global": [4]}, {"actor": "global", "rollout": "gen"}, {"actor": ParallelDims()})


def test_reward_model_role_shares_the_pool():
    plan = plan_placement({"global": [4]}, {"actor": "global", "rollout": "global", "reward_model": "global"},
                          {"actor": ParallelDims(tp=2), "reward_model": ParallelDims(tp=1)})
    assert plan.role("reward_model").dims.dp == 4
    assert plan.colocate_count("global") == 3

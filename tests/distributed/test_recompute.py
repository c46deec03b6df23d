"""Activation recomputation (full and selective) on CPU at TP=2: the same step as without it."""

from megarl.parallel.launch import run_ranks


def _steps(path):
    import torch

    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    results = {}
    for granularity in (None, "full", "selective"):
        # The actor's settings (actor.recompute_granularity / recompute_num_layers) as the worker passes them.
        sharded = ShardedModel(path, ParallelDims(tp=2), optim=OptimConfig(lr=1e-3), seed=1,
                                recompute_granularity=granularity, recompute_num_layers=1)
        expected = {None: None, "full": "uniform", "selective": None}[granularity]
        assert (sharded.config.recompute_granularity, sharded.config.recompute_method) == (granularity, expected)
        ids = torch.randint(0, 400, (4, 24), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # a left-padded row
        micro = [{"input_ids": ids[:2], "attention_mask": mask[:2]}, {"input_ids": ids[2:], "attention_mask": mask[2:]}]

        def loss_fn(logp_BS, entropy_BS, mb):
            valid = mb["attention_mask"][:, 1:].float()
            return -(logp_BS[:, :-1] * valid).sum() / 90.0, {}

        result = sharded.train_step(micro, loss_fn)
        weights = torch.cat([p.detach().reshape(-1).float() for p in sharded.module_chunks[0].parameters()])
        results[str(granularity)] = (result.loss, result.grad_norm, weights)
    return results


def test_recompute_gives_the_same_step(tmp_path):
    from megarl.models.tiny import save_tiny

    path = save_tiny(tmp_path / "model", num_layers=2)
    for rank_results in run_ranks(_steps, 2, str(path), timeout_s=240):
        loss, norm, weights = rank_results["None"]
        assert loss > 0 and norm > 0
        for granularity in ("full", "selective"):
            other_loss, other_norm, other_weights = rank_results[granularity]
            assert abs(other_loss - loss) <= 1e-6 * abs(loss), granularity
            assert abs(other_norm - norm) <= 1e-6 * norm, granularity
            assert (other_weights - weights).abs().max().item() <= 1e-7, granularity

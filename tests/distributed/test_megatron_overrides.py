"""The Megatron passthrough reaches Megatron: a role's ``override_transformer_config`` lands in the
model's ``TransformerConfig`` and changes what it computes (``hidden_dropout``), and ``override_optimizer_config`` lands
in the optimizer's ``OptimizerConfig``; the fields megarl derives stay as they were."""

from megarl.parallel.launch import run_ranks


def _job(path):
    import torch

    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]

    def loss_fn(logp_BS, entropy_BS, mb):
        return -logp_BS.mean(), {}

    out, groups = {}, None
    for name, transformer, optimizer in (
            ("plain", {}, {}),
            ("plain_again", {}, {}),
            ("overridden", {"hidden_dropout": 0.5, "deallocate_pipeline_outputs": True},
             {"loss_scale_window": 77, "log_num_zeros_in_grad": True})):
        torch.manual_seed(5)
        sharded = ShardedModel(path, ParallelDims(tp=1), optim=OptimConfig(lr=1e-3, override_optimizer_config=optimizer),
                               seed=1, groups=groups, megatron_overrides=transformer)
        groups = sharded.groups
        config, opt = sharded.config, sharded.optimizer.config
        out[name] = {"loss": sharded.train_step(micro, loss_fn).loss, "hidden_dropout": config.hidden_dropout,
                     "deallocate": config.deallocate_pipeline_outputs, "num_layers": config.num_layers,
                     "per_token": config.calculate_per_token_loss, "window": opt.loss_scale_window,
                     "zeros": opt.log_num_zeros_in_grad, "lr": opt.lr}
    return out


def test_the_overrides_reach_megatrons_configs_and_change_the_step(tmp_path):
    from megarl.models.tiny import save_tiny

    path = save_tiny(tmp_path / "model", num_layers=2)
    (out,) = run_ranks(_job, 1, str(path), timeout_s=240)
    plain, again, overridden = out["plain"], out["plain_again"], out["overridden"]
    assert (overridden["hidden_dropout"], overridden["deallocate"]) == (0.5, True)
    assert (plain["hidden_dropout"], plain["deallocate"]) == (0.0, False)
    assert (overridden["window"], overridden["zeros"]) == (77, True)
    assert plain["window"] != 77 and not plain["zeros"]
    # megarl's own fields are untouched by the passthrough
    for key in ("num_layers", "per_token", "lr"):
        assert overridden[key] == plain[key]
    assert plain["loss"] == again["loss"]  # deterministic without dropout
    assert abs(overridden["loss"] - plain["loss"]) > 1e-3 * abs(plain["loss"])  # dropout 0.5 changes the step

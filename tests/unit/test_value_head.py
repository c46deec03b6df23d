"""The critic's value head (GPTModel output-layer convention, seeded init) and its config checks."""

import pytest
import torch

from megarl.models.value_head import ValueHead, has_value_head, value_head_parameter_names
from megarl.parallel.pipeline import emits_values
from megarl.config import CriticConfig


def test_value_head_is_seeded_and_called_like_megatrons_output_layer():
    a, b = ValueHead(16, init_std=0.02, seed=7), ValueHead(16, init_std=0.02, seed=7)
    assert torch.equal(a.weight, b.weight) and a.weight.shape == (1, 16)
    assert not torch.equal(a.weight, ValueHead(16, init_std=0.02, seed=8).weight)
    assert torch.equal(a.bias, torch.zeros(1))
    assert 0.01 < float(a.weight.detach().std()) < 0.04
    assert not hasattr(a.weight, "tensor_model_parallel")  # replicated: counted once by Megatron's grad norm
    hidden_SBH = torch.randn(5, 3, 16)
    values_SB1, bias = a(hidden_SBH, weight=None, runtime_gather_output=None)
    assert bias is None and values_SB1.shape == (5, 3, 1)
    assert torch.allclose(values_SB1[..., 0], hidden_SBH @ a.weight[0] + a.bias)
    with pytest.raises(AssertionError, match="never tied"):
        a(hidden_SBH, weight=torch.zeros(10, 16))


def test_value_head_is_found_through_wrappers():
    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.output_layer = ValueHead(4, init_std=0.02, seed=0)

    class Wrapper(torch.nn.Module):  # like Megatron DDP: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    chunks = [Wrapper(torch.nn.Linear(4, 4)), Wrapper(Chunk())]
    assert has_value_head(chunks) and not has_value_head(chunks[:1])
    assert emits_values(chunks) and not emits_values(chunks[:1])  # what the pipeline sees: values, not logits
    assert value_head_parameter_names(chunks) == {"output_layer.weight", "output_layer.bias"}


@pytest.mark.parametrize("field", ["ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                                   "forward_micro_batch_size_per_gpu", "ppo_epochs"])
def test_critic_config_refuses_non_positive_sizes(field):
    kwargs = {"ppo_mini_batch_size": 4, field: 0}
    with pytest.raises(ValueError, match=f"critic.{field}"):
        CriticConfig(**kwargs)


def test_critic_config_checks_clip_and_aggregation():
    assert CriticConfig(ppo_mini_batch_size=4).cliprange_value == 0.5  # value_loss's default
    with pytest.raises(ValueError, match="critic.cliprange_value"):
        CriticConfig(ppo_mini_batch_size=4, cliprange_value=-0.1)
    with pytest.raises(ValueError, match="critic.loss_agg_mode"):
        CriticConfig(ppo_mini_batch_size=4, loss_agg_mode="mean")

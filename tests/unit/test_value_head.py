"""The critic's value head (GPTModel output-layer convention, seeded init) and its config checks."""

from types import SimpleNamespace

import pytest
import torch

from megarl.config import CriticConfig
from megarl.models.value_head import ValueHead, attach_value_head, has_value_head, value_head_parameter_names
from megarl.parallel.pipeline import emits_values


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


def _last_stage_chunk(device: str, params_dtype: torch.dtype) -> torch.nn.Module:
    """A stand-in for a last-stage GPTModel: the attributes attach_value_head reads, parameters on ``device``."""
    chunk = torch.nn.Module()
    chunk.body = torch.nn.Linear(8, 8, device=device, dtype=params_dtype)
    chunk.config = SimpleNamespace(sequence_parallel=False, hidden_size=8, init_method_std=0.02,
                                   params_dtype=params_dtype)
    chunk.share_embeddings_and_output_weights = False
    return chunk


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_attached_value_head_is_on_the_models_device_in_its_dtype(device):
    """On GPU the body is on the current device: a head built on the CPU stayed there (DDP does not move it)."""
    chunk = _last_stage_chunk(device, torch.bfloat16)
    attach_value_head(chunk, seed=3)
    head = chunk.output_layer
    assert isinstance(head, ValueHead)
    for parameter in (head.weight, head.bias):
        assert parameter.device.type == device and parameter.dtype == torch.bfloat16
    if device == "cpu":  # the seeded values do not depend on the device
        assert torch.equal(head.weight, ValueHead(8, init_std=0.02, seed=3, dtype=torch.bfloat16).weight)


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

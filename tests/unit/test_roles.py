"""The Megatron roles declared once (megarl/workers/roles.py): each spec names a worker that has its build calls, a
config section that has what the spec reads, and a step phase; building, placement and the planner see the roles a
config enables, in building order."""

from __future__ import annotations

import pytest

from megarl.config import load_config
from megarl.workers.roles import ROLE_SPECS, SCORING_ROLES, SPEC_OF, enabled_roles


def _cfg(*extra: str):
    return load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.init=pretrained", *extra])


CRITIC = ("critic.enable=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8")
TEACHER = ("teacher.enable=true", "teacher.model.path=/models/teacher")
REWARD_MODEL = ("reward_model.enable=true", "reward_model.model.path=/models/rm")


def test_every_spec_names_a_worker_with_its_build_calls_and_a_section_with_what_it_reads():
    cfg = _cfg(*CRITIC, *TEACHER, *REWARD_MODEL)
    assert [spec.name for spec in ROLE_SPECS] == ["actor", "critic", "teacher", "reward_model"]
    assert set(SPEC_OF) == {spec.name for spec in ROLE_SPECS}
    for spec in ROLE_SPECS:
        worker = spec.worker_class()
        assert worker.role == spec.name
        for method, kwargs in spec.calls(cfg):
            assert callable(getattr(worker, method)), (spec.name, method)
            assert "seed" not in kwargs  # the builder adds the run's seed
        assert spec.parallel(cfg) is spec.section_of(cfg).parallel
        assert set(spec.offload(cfg)) <= {"params", "grads", "optimizer", "ref_params"}
        assert spec.serves and spec.label.startswith("the ")
    for spec in SCORING_ROLES:
        section = spec.section_of(cfg)
        assert not spec.trains and section.model.path and spec.forward(cfg).keys[0].startswith(spec.section + ".")


@pytest.mark.parametrize("extra, names", [
    ((), ["actor"]),
    (CRITIC, ["actor", "critic"]),
    ((*TEACHER, *REWARD_MODEL), ["actor", "teacher", "reward_model"]),
])
def test_a_config_runs_the_roles_it_enables_in_building_order(extra, names):
    cfg = _cfg(*extra)
    assert [spec.name for spec in enabled_roles(cfg)] == names
    from megarl.plan.placement import placement_for

    plan = placement_for(cfg)
    assert {name for name in names} <= set(plan.roles)


def test_offload_flags_are_the_sections():
    cfg = _cfg(*CRITIC, *TEACHER, "trainer.device=cuda", "critic.grad_offload=true",
               "actor_rollout_ref.actor.optimizer_offload=true", "teacher.param_offload=true")
    assert SPEC_OF["actor"].offload(cfg) == {"params": False, "grads": False, "optimizer": True, "ref_params": False}
    assert SPEC_OF["critic"].offload(cfg) == {"params": False, "grads": True, "optimizer": False}
    assert SPEC_OF["teacher"].offload(cfg) == {"params": True}
    assert SPEC_OF["reward_model"].offload(cfg) == {"params": False}  # not enabled: nothing to move

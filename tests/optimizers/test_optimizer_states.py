"""Each optimizer's states and step scratch as the framework hands it the parameters (whole tensors, flat partitions, DTensor shards)."""

import pytest
from toy import PSI, TOY, make_inv, settings

from memplan import accounting as A
from memplan import layouts, options
from memplan.errors import SettingsError
from memplan.precision import get_optimizer, get_recipe
from memplan.request import JobRequest
from memplan.strategies import get_strategy


def test_adafactor_and_8bit_states():
    inv = make_inv({"layers.0": [(100, 50)], "": [(8000,)]})
    ada = A.estimate(inv, settings("ddp", 1, optimizer="adafactor"))
    assert ada.peak.optimizer_states_bytes == 4 * (100 + 50) + 4 * 8000
    b8 = A.estimate(inv, settings("ddp", 1, optimizer="adam8bit"))
    # 5000 >= 4096 -> 8-bit with an fp32 absmax per 256-element block (bitsandbytes 0.50 init_state); 8000
    # too; the two shared 256-entry fp32 quantization maps once
    assert b8.peak.optimizer_states_bytes == 2 * (5000 + 4 * 20) + 2 * (8000 + 4 * 32) + 2 * 1024


def test_shape_dependent_optimizers_see_what_the_framework_hands_them():
    """DeepSpeed hands its flat fp32 partition (Adafactor cannot factor it: 4 B per element, as measured with
    transformers' Adafactor under ZeRO-2), ZeRO-3 one flat tensor per sub-group, FSDP1 its FlatParameter shards;
    FSDP2's DTensors are refused."""
    from dataclasses import replace

    from memplan.units import round_up

    inv = TOY
    fsdp1 = replace(settings("ddp", 4, optimizer="adafactor", recipe="fsdp-bf16"),
                    strategy=get_strategy("fsdp-full", 1))
    for st in (settings("zero1", 4, optimizer="adafactor"), settings("zero2", 4, optimizer="adafactor"),
               settings("zero3", 4, optimizer="adafactor"), fsdp1):
        opt_numel = A.layouts.layout_sizes(inv, st.strategy.layout, 4).optimizer_numel
        assert A.estimate(inv, st).peak.optimizer_states_bytes == 4 * opt_numel, st.strategy.name
    z2 = A.layouts.layout_sizes(inv, "flat-aligned", 4).optimizer_numel
    assert z2 == round_up(PSI, 2 * 4) // 4
    # ZeRO-3 sub-groups: 8-bit states quantized per sub-group (blocks rounded per group)
    z3 = A.estimate(inv, settings("zero3", 4, optimizer="adam8bit",
                                  ds={"param_persistence_threshold": 0, "sub_group_size": 300_000}))
    parts = [-(-t.numel // 4) for t in inv.tensors]
    from memplan.frameworks.zero3 import sub_groups

    groups = sub_groups(parts, 300_000)
    assert len(groups) > 1
    assert z3.peak.optimizer_states_bytes == sum(2 * (g + 4 * -(-g // 256)) for g in groups) + 2 * 1024
    # DDP keeps shapes: factored
    ddp = A.estimate(inv, settings("ddp", 4, optimizer="adafactor"))
    assert ddp.peak.optimizer_states_bytes == 4 * (8 + 1024) + 4 * 4 * (1024 + 1024)
    with pytest.raises(SettingsError, match="DTensor"):
        options.resolve(inv, JobRequest.of(gpus=4, strategy="fsdp-full", optimizer="adafactor", activations="analytic"))
    with pytest.raises(SettingsError, match="DTensor"):
        options.resolve(inv, JobRequest.of(gpus=4, strategy="hsdp", optimizer="adam8bit", activations="analytic"))


def test_single_tensor_adam_scratch_counts_the_previous_denominator():
    # _single_tensor_adam: sqrt and division of this tensor while the previous one's denominator is still bound
    b = 1024 * 1024
    assert layouts.layout_sizes(TOY, "replicated", 1).single_step_scratch == 3 * b  # two equal neighbours
    from memplan.strategies import FLAT_PER_BLOCK

    assert layouts.layout_sizes(TOY, FLAT_PER_BLOCK, 2).single_step_scratch == b // 2 + b  # half-block shards


def test_lion_and_schedule_free_adamw_states_and_step_scratch(inventories):
    """lion-pytorch's Lion: one state (exp_avg, the parameter's dtype), update_fn's clone and sum of it (two
    temporaries of the tensor stepped, freed when it returns); schedulefree's AdamWScheduleFree: z and exp_avg_sq,
    then one foreach temporary per tensor (its default on any device). Measured on the CPU harness within 0.01%
    (docs/accuracy.md, session 28)."""
    from memplan.precision import step_temporaries

    inv = inventories("llama-7b")
    lion = options.resolve(inv, JobRequest.of(gpus=1, optimizer="lion", activations="analytic")).settings
    adamw = options.resolve(inv, JobRequest.of(gpus=1, optimizer="adamw", activations="analytic")).settings
    sf = options.resolve(inv, JobRequest.of(gpus=1, optimizer="schedulefree", activations="analytic")).settings
    assert sf.optimizer.name == "adamw-schedulefree"
    pl, pa, ps = (A.estimate(inv, s) for s in (lion, adamw, sf))
    assert pl.phases[-1].optimizer_states_bytes * 2 == pa.phases[-1].optimizer_states_bytes
    assert ps.phases[-1].optimizer_states_bytes == pa.phases[-1].optimizer_states_bytes
    assert ps.assumptions["optimizer_impl"] == "foreach" and pl.assumptions["optimizer_impl"] == "single-tensor"
    largest = max(t.numel for t in inv.tensors)
    rc = get_recipe("pure-bf16")
    assert step_temporaries(get_optimizer("lion"), "single-tensor", 2, rc, [3, largest, 5]) == \
        rc.state_bytes * 2 * largest

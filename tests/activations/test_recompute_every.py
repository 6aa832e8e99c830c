"""--recompute every:N, transformers' activation_checkpointing_enable(every_n_layers=N) (the Trainer's
activation_checkpointing_kwargs): blocks 0, N, 2N, ... checkpointed, the others keep their activations."""

from __future__ import annotations

import pytest

from memplan import activations as act
from memplan.errors import SettingsError
from memplan.model import sources
from memplan.model.scaling import scale_config


def test_values_are_checked_and_every_1_is_full():
    assert act.valid_recompute("every:1") == "full"
    assert act.valid_recompute("every:04") == "every:4"
    for bad in ("every:0", "every:", "every:x", "every:-2", "sometimes"):
        with pytest.raises(SettingsError) as e:
            act.valid_recompute(bad)
        assert bad in str(e.value)
    # blocks 0, N, 2N, ...: ceil(L / N) of them; the last block is one when (L - 1) % N == 0
    assert [act.checkpointed_blocks(f"every:{n}", 32) for n in (2, 3, 5, 32, 40)] == [16, 11, 7, 1, 1]
    assert act.checkpointed_blocks("full", 32) == 32 and act.checkpointed_blocks("none", 32) == 0
    assert [act.last_checkpointed(f"every:{n}", 4) for n in (2, 3)] == [False, True]
    # torchtitan's layer SAC: blocks N-1, 2N-1, ... (its counter is incremented before the test)
    assert act.valid_recompute("layer-sac:1") == "full"
    assert [act.is_checkpointed("layer-sac:3", i) for i in range(7)] == [False, False, True] * 2 + [False]
    assert [act.checkpointed_blocks(f"layer-sac:{n}", 32) for n in (2, 3, 32, 40)] == [16, 10, 1, 0]


def test_analytic_profile_keeps_inputs_of_the_checkpointed_blocks_only():
    dims = dict(hidden_size=512, num_layers=6, num_heads=8, vocab_size=1000, intermediate_size=1024)
    kw = dict(micro_batch=1, seq_len=64, compute_bytes=2, residual_bytes=2, attention="flash", gated_mlp=True)
    p = {r: act.analytic_profile(dims, recompute=r, **kw) for r in ("none", "every:2", "full")}
    none, full = p["none"], p["full"]
    # blocks 0, 2, 4 keep their input; 1, 3, 5 everything
    assert p["every:2"].saved_bytes("every:2") == (3 * full.layer_input_bytes + 3 * none.per_layer_bytes
                                                    + none.embedding_bytes)
    assert none.saved_bytes("none") > p["every:2"].saved_bytes("every:2") > full.saved_bytes("full")
    # a checkpointed block is recomputed in backward: its activations come back for that block
    assert p["every:2"].recompute_transient_bytes("every:2") == none.per_layer_bytes


def test_traced_every_2_is_full_depth_and_adds_up_block_by_block():
    from memplan.activations.tracing import trace_profile

    cfg = scale_config(sources.resolve("llama-7b").config, layers=4, hidden=256, vocab=1024)[0]
    t = {r: trace_profile(cfg, seq_len=128, recipe="deepspeed-bf16", attention="flash", recompute=r)
         for r in ("none", "full", "every:2", "every:3")}
    assert t["every:2"]["traced_layers"] == 4  # the blocks differ: traced at the model's depth
    # at forward's end, per sequence: two checkpointed blocks (their inputs) and two kept ones (everything),
    # the traced two-block profiles plus two blocks of the other kind
    c1 = t["every:2"]["live_after_forward"][1]
    assert c1 == t["none"]["live_after_forward"][1] + 2 * t["full"]["per_layer"][1]
    assert c1 == t["full"]["live_after_forward"][1] + 2 * t["none"]["per_layer"][1]
    # every:3 checkpoints blocks 0 and 3: the same bytes saved, but the last block is recomputed first in backward
    assert t["every:3"]["live_after_forward"] == t["every:2"]["live_after_forward"]
    assert t["every:3"]["backward_peak"][0][1] > t["every:2"]["backward_peak"][0][1]


def test_plan_ranks_fewer_recomputed_blocks_first():
    from memplan.planner import recompute_rank

    order = ["none", "selective", "layer-sac:8", "every:2", "full"]
    assert sorted(reversed(order), key=recompute_rank) == order


def test_layer_sac_and_op_sac_traces():
    """torchtitan's layer SAC checkpoints blocks N-1, 2N-1, ...; its per-op SAC keeps, per checkpointed block, the
    outputs of all but every second aten.mm (q, v, gate and down of a llama block) besides the block's input."""
    from memplan.activations.tracing import trace_profile

    cfg = scale_config(sources.resolve("llama-7b").config, layers=4, hidden=256, vocab=1024)[0]
    t = {r: trace_profile(cfg, seq_len=128, recipe="deepspeed-bf16", attention="flash", recompute=r)
         for r in ("every:2", "layer-sac:2", "op-sac")}
    # layer-sac:2 checkpoints blocks 1 and 3: as many as every:2 (0 and 2), but the last one, recomputed first
    assert t["layer-sac:2"]["live_after_forward"][1] == t["every:2"]["live_after_forward"][1]
    assert t["layer-sac:2"]["backward_peak"][0][1] > t["every:2"]["backward_peak"][0][1]
    # per sequence of 128 tokens in bf16, hidden 256, MLP 688: the input, q, v, down (hidden each), gate (688),
    # and the flash kernel's output with its fp32 logsumexp (2 heads): the CUDA fused kernels are on the list
    h, inter, s = 256, cfg["intermediate_size"], 128
    assert t["op-sac"]["traced_layers"] == 2
    assert t["op-sac"]["per_layer"][1] == s * 2 * (4 * h + inter) + s * 2 * h + 2 * s * 4

"""Properties of the engine on random inventories and settings (hypothesis)."""

from hypothesis import given, settings as hsettings, strategies as hs

from memplan import accounting as A
from memplan.model.inventory import ParamInventory, ParamTensor, classify
from memplan.precision import get_optimizer, get_recipe
from memplan.strategies import STRATEGIES

DIMS = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 50, "intermediate_size": 64}

shapes = hs.lists(hs.tuples(hs.integers(1, 300), hs.integers(1, 40)), min_size=1, max_size=6)


def inv_from(blocks):
    tensors = []
    for b, shps in enumerate(blocks):
        for i, shape in enumerate(shps):
            name = f"layers.{b}.w{i}.weight"
            tensors.append(ParamTensor(name, shape, "bfloat16", f"layers.{b}", classify(name)))
    return ParamInventory(model_name="p", source="t", builder="t", family="llama", tensors=tuple(tensors), dims=DIMS)


def est(inv, name, gpus, recipe="deepspeed-bf16", offload=False):
    s = A.Settings(strategy=STRATEGIES[name], recipe=get_recipe(recipe), optimizer=get_optimizer("adamw"),
                   cluster=A.Cluster(gpus=gpus, gpus_per_node=max(gpus, 1)),
                   ds=A.DeepSpeedKnobs(param_persistence_threshold=0, offload_optimizer=offload))
    return A.estimate(inv, s)


def states(plan):
    p = next(p for p in plan.phases if p.name == "backward-end")
    return p.weights_bytes + p.master_weights_bytes + p.grads_bytes + p.optimizer_states_bytes


@given(hs.lists(shapes, min_size=1, max_size=4), hs.sampled_from(sorted(STRATEGIES)), hs.integers(1, 16))
@hsettings(max_examples=150, deadline=None)
def test_bytes_are_non_negative_ints_and_peak_is_max(blocks, name, gpus):
    plan = est(inv_from(blocks), name, gpus)
    for p in plan.phases:
        for k in A.CATEGORY_KEYS:
            v = getattr(p, k)
            assert isinstance(v, int) and v >= 0
    assert plan.peak_bytes == max(p.total_bytes for p in plan.phases)


@given(hs.lists(shapes, min_size=1, max_size=4), hs.sampled_from(["zero1", "zero2", "zero3", "fsdp-full",
                                                                    "zero-optimizer"]), hs.integers(1, 8))
@hsettings(max_examples=150, deadline=None)
def test_sharded_states_never_grow_with_more_gpus(blocks, name, gpus):
    # Except by DeepSpeed's flat-buffer padding: ZeRO-1/2 keep the whole bf16 flat buffer, padded to a multiple
    # of 2 * dp_size, on every rank, so doubling the ranks can add up to 2 * 2N elements of padding (2 bytes
    # each) plus one element per partitioned fp32 copy (16 bytes).
    inv = inv_from(blocks)
    allowance = 2 * 2 * (2 * gpus) + 16 if name in ("zero1", "zero2") else 0
    assert states(est(inv, name, 2 * gpus)) <= states(est(inv, name, gpus)) + allowance


@given(hs.lists(shapes, min_size=1, max_size=4), hs.integers(1, 16))
@hsettings(max_examples=150, deadline=None)
def test_stage_ordering(blocks, gpus):
    inv = inv_from(blocks)
    s3, s2, s1 = (states(est(inv, f"zero{k}", gpus)) for k in (3, 2, 1))
    ddp_like = states(est(inv, "zero1", 1))
    flat_padding = 2 * 2 * (2 * gpus) + 16  # ZeRO-1/2 flat buffers padded to 2 * dp_size (see above)
    assert s3 <= s2 <= s1 <= ddp_like + flat_padding


@given(hs.lists(shapes, min_size=1, max_size=4), hs.sampled_from(["zero1", "zero2", "zero3"]))
@hsettings(max_examples=100, deadline=None)
def test_one_gpu_holds_ddp_model_states(blocks, name):
    # DDP's mixed-precision model states are 16 bytes per parameter; DeepSpeed's flat buffers pad to an even
    # element count at one rank (nccl_start_alignment_factor 2), i.e. at most one padding element.
    inv = inv_from(blocks)
    assert 0 <= states(est(inv, name, 1)) - 16 * inv.num_params <= 16


@given(hs.lists(shapes, min_size=1, max_size=4), hs.integers(1, 4))
@hsettings(max_examples=100, deadline=None)
def test_hsdp_one_replica_is_full_shard(blocks, gpus):
    inv = inv_from(blocks)
    assert est(inv, "hsdp", gpus, "fsdp-bf16").phases == est(inv, "fsdp-full", gpus, "fsdp-bf16").phases


_SCHEMA = None


def _schema():
    global _SCHEMA
    if _SCHEMA is None:
        import json
        from pathlib import Path

        _SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "memplan" / "schema" /
                              "estimate-v1.schema.json").read_text())
    return _SCHEMA


@given(hs.lists(shapes, min_size=1, max_size=4), hs.sampled_from(sorted(STRATEGIES)), hs.integers(1, 16),
       hs.sampled_from(["deepspeed-bf16", "torch-amp", "fp32", "fsdp-bf16"]), hs.integers(1, 2),
       hs.sampled_from(["cuda", "cpu"]))
@hsettings(max_examples=120, deadline=None)
def test_json_round_trips_and_follows_the_schema(blocks, name, gpus, recipe, fsdp_version, device):
    # the report of any valid configuration: integers for bytes, the schema's shape, and json.dumps/loads gives
    # back the same object (no float, NaN or object that JSON cannot carry)
    import json

    import jsonschema

    from memplan.report import plan_report
    from memplan.strategies import get_strategy

    inv = inv_from(blocks)
    s = A.Settings(strategy=get_strategy(name, fsdp_version), recipe=get_recipe(recipe),
                   optimizer=get_optimizer("adamw"), cluster=A.Cluster(gpus=gpus, gpus_per_node=gpus, device=device),
                   ds=A.DeepSpeedKnobs(param_persistence_threshold=0))
    rep = plan_report(A.estimate(inv, s))
    assert json.loads(json.dumps(rep, allow_nan=False)) == rep
    jsonschema.validate(rep, _schema())
    assert all(isinstance(v, int) and v >= 0 for k, v in rep["per_gpu"].items() if k.endswith("_bytes") and v is not None)

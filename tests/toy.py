"""A toy inventory whose bytes can be checked by hand (4 blocks of 1024 x 1024 and a root tensor) and Settings
built on it directly: the framework, optimizer and accounting tests share them."""

from memplan import accounting as A
from memplan.model.inventory import ParamInventory, ParamTensor, classify
from memplan.precision import get_optimizer, get_recipe
from memplan.strategies import DEFAULT_RECIPE, get_strategy

DIMS = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 100, "intermediate_size": 128}


def make_inv(shapes_by_block):
    tensors = []
    for block, shapes in shapes_by_block.items():
        for i, shape in enumerate(shapes):
            name = f"{block}.w{i}.weight" if block else f"w{i}.weight"
            tensors.append(ParamTensor(name, shape, "bfloat16", block, classify(name)))
    return ParamInventory(model_name="toy", source="test", builder="test", family="llama",
                          tensors=tuple(tensors), dims=DIMS)


# 4 blocks of 1024x1024 + a root tensor: Psi = 4*1024*1024 + 8*1024, divisible by every N below.
TOY = make_inv({"": [(8, 1024)], **{f"layers.{i}": [(1024, 1024)] for i in range(4)}})


PSI = TOY.num_params


def settings(strategy, gpus, **kw):
    st = get_strategy(strategy)
    recipe = kw.pop("recipe", DEFAULT_RECIPE[st.framework])
    ds = A.DeepSpeedKnobs(**kw.pop("ds", {"param_persistence_threshold": 0}))
    return A.Settings(strategy=st, recipe=get_recipe(recipe), optimizer=get_optimizer(kw.pop("optimizer", "adamw")),
                      cluster=A.Cluster(gpus=gpus, gpus_per_node=kw.pop("gpus_per_node", 8),
                                        blas_workspace_bytes=kw.pop("blas_workspace_bytes", 0)), ds=ds, **kw)


def model_states(plan, phase="backward-end"):
    p = next(p for p in plan.phases if p.name == phase)
    return p.weights_bytes + p.master_weights_bytes + p.grads_bytes + p.optimizer_states_bytes

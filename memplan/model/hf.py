"""transformers' config object for a config.json dict, and the pseudo-keys memplan adds to a config it traces or
runs (their bytes depend on them, so they are part of the trace's cache key; the builders drop them). Below
model/tasks.py and model/meta_builder.py, which both read configs through it. No torch at import."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from memplan.errors import ConfigError
from memplan.inputs import quote

#: an encoder-decoder's decoder length (--target-len): its labels per sample
TARGET_KEY = "memplan_target_len"
#: a vision-language model's images per sample (--images)
IMAGES_KEY = "memplan_images"
#: the image size a vision-language model of any resolution is fed (--image-size: [height, width] in pixels)
IMAGE_SIZE_KEY = "memplan_image_size"
#: the module paths the job freezes (--freeze, model/freeze.py)
FROZEN_KEY = "memplan_frozen"
#: the dtype an image's pixels arrive in where it is not the traced step's parameters' (FSDP's MixedPrecisionPolicy:
#: the stored parameters, and so model.dtype, are fp32 while the step computes in bf16)
INPUT_DTYPE_KEY = "memplan_input_dtype"
#: the dtype each block's floating-point inputs are cast to on entry (FSDP2's MixedPrecisionPolicy, whose
#: cast_forward_inputs is on by default: every fully_shard'ed module casts them, _fsdp_state.py _cast_forward_inputs)
BLOCK_INPUT_CAST_KEY = "memplan_block_input_cast"
#: the pseudo-keys a traced or run config may carry beside the config.json's own fields
PSEUDO_KEYS = (TARGET_KEY, IMAGES_KEY, IMAGE_SIZE_KEY, FROZEN_KEY, INPUT_DTYPE_KEY, BLOCK_INPUT_CAST_KEY)


def transformers_config(config: Mapping[str, Any], model_name: str = "model") -> Any:
    """The transformers config object for a config.json dict, as AutoConfig builds it for its model_type (never
    remote code); the pseudo-keys dropped."""
    import transformers
    from transformers import AutoConfig

    model_type = config.get("model_type")
    if not model_type:
        raise ConfigError(f"config for {model_name} has no 'model_type'")
    # a deep copy: transformers fills nested dicts in place (rope_scaling gains rope_theta, transformers 5.23),
    # which would change the caller's config, and with it the activation profile's cache key
    fields = copy.deepcopy({k: v for k, v in config.items()
                            if k not in ("model_type", "auto_map", "quantization_config", *PSEUDO_KEYS)})
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type in CONFIG_MAPPING_NAMES:  # known: the config's own fields failed its class's checks
            raise ConfigError(f"config for {model_name} is not valid for {model_type}: {exc}") from exc
        raise ConfigError(f"transformers {transformers.__version__} does not know model_type {quote(model_type)} "
                          "(memplan never runs remote code)") from exc
    except Exception as exc:
        raise ConfigError(f"config for {model_name} is not valid for {model_type}: {exc}") from exc

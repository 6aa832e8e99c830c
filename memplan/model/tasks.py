"""The task a config's model class trains on (its ``architectures``), and the inputs and labels its training step
takes: one place for the inventory, the traced step and the harness to agree on which transformers class runs.

transformers names a head by the class suffix (modeling_auto.py's MODEL_FOR_*_MAPPING_NAMES); what each head's
forward computes its loss from (modeling_bert.py, modeling_llama.py, the generic heads in modeling_layers.py):

- causal LM (``...ForCausalLM``, ``...LMHeadModel``): ``labels`` = the input ids, logits over the vocabulary at
  every position (the loss shifts them);
- masked LM (``...ForMaskedLM``): ``labels`` [batch, seq], the vocabulary logits at every position;
- sequence classification (``...ForSequenceClassification``): ``labels`` [batch], one row of ``num_labels``
  logits per sequence (an encoder's pooled first token; a decoder's last non-pad token), cross-entropy (mean
  squared error where num_labels is 1);
- token classification (``...ForTokenClassification``): ``labels`` [batch, seq], ``num_labels`` logits per token;
- extractive question answering (``...ForQuestionAnswering``): ``start_positions`` and ``end_positions``
  [batch], two logits per token;
- sequence-to-sequence LM (an encoder-decoder: ``...ForConditionalGeneration`` of a text model_type in
  MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, T5, mT5, BART, Pegasus, Marian; a config with
  ``is_encoder_decoder`` and no head named, as bart-large's BartModel, trains so too): ``input_ids`` [batch, seq]
  for the encoder and ``labels`` [batch, target] for the decoder, which the model shifts right into its
  ``decoder_input_ids`` (modeling_t5.py _shift_right, modeling_bart.py shift_tokens_right); the vocabulary
  logits at every target position;
- image classification by a vision transformer (``ViTForImageClassification``, ``DeiTForImageClassification``):
  ``pixel_values`` [batch, channels, image, image] in the parameters' dtype and ``labels`` [batch]; its sequence
  is its patches, (image / patch)^2, plus the class token (DeiT: and the distillation token), modeling_vit.py
  ViTEmbeddings / modeling_deit.py DeiTEmbeddings;
- image-text-to-text (a vision-language model: ``LlavaForConditionalGeneration``, ``Gemma3ForConditionalGeneration``,
  transformers' MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES): ``input_ids`` [batch, seq] in which each image stands
  as its tokens (the processor expands one image placeholder into them: LlavaProcessor, Gemma3Processor), the
  images' ``pixel_values`` [batch x images, channels, image, image] at the vision tower's image_size, and
  ``labels`` = the input ids (a collator masks the image tokens to -100: the same shapes); Gemma 3 also takes the
  processor's ``token_type_ids`` (1 at image tokens), from which its image tokens attend to each other both ways
  (modeling_gemma3.py create_masks_for_vision_model). The model scatters the projected image features into the
  embedded sequence at those tokens (get_placeholder_mask, masked_scatter). Tokens per image
  (image_text_tokens): LLaVA's vision tower's patches (image_size / patch_size)^2, and CLIP's class token unless
  vision_feature_select_strategy "default" drops the first token (modeling_llava.py get_image_features); Gemma 3's
  mm_tokens_per_image, its projector average-pooling the patch grid to that many (Gemma3MultiModalProjector);
  PaliGemma's SigLIP patches (image_size / patch_size)^2, with the processor's ``token_type_ids`` (0 in the prefix,
  which attends both ways: modeling_paligemma.py).
  Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE take an image at any resolution (PATCH_GRID_MODELS): the processor
  (Qwen2VLImageProcessor; smart_resize) resizes it to multiples of patch_size x spatial_merge_size and hands the
  model its patches flattened, ``pixel_values`` [images x (H/p) x (W/p), channels x temporal_patch_size x p x p]
  (a still image repeated over the temporal patch), with ``image_grid_thw`` [images, 3] = (1, H/p, W/p); the text
  holds each image as ``<|vision_start|>``, (H/p)(W/p)/merge^2 image tokens and ``<|vision_end|>``
  (Qwen2VLProcessor), and ``mm_token_type_ids`` (1 at image tokens: ProcessorMixin.create_mm_token_type_ids) from
  which the model builds its 3-D rotary positions (get_rope_index). The image size is --image-size (default:
  image_side, the largest square the processor's default max_pixels lets through).
  Mllama (Llama 3.2 Vision, CROSS_ATTENTION_MODELS) reads its images by cross-attention: one ``<|image|>`` token
  per image in the text, the image as max_num_tiles tiles (MllamaImageProcessor pads every image to them), with
  ``aspect_ratio_ids``, ``aspect_ratio_mask`` and the dense ``cross_attention_mask`` (_tile_inputs).

Other heads (speech and audio seq2seq, other vision-language models, multiple choice, pre-training, image models
other than ViT and DeiT) are refused with the class named: their inputs are neither a [batch, seq] of token ids nor
an image of a fixed size. No torch at import.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from memplan.errors import ConfigError
from memplan.inputs import quote
from memplan.model.hf import IMAGE_SIZE_KEY, IMAGES_KEY, TARGET_KEY, transformers_config

CAUSAL_LM = "causal-lm"
SEQ2SEQ = "seq2seq-lm"
#: class-name suffix -> task, longest first where one ends another
SUFFIXES = (("ForSequenceClassification", "sequence-classification"),
            ("ForTokenClassification", "token-classification"), ("ForQuestionAnswering", "question-answering"),
            ("ForQuestionAnsweringSimple", "question-answering"),  # XLM's and FlauBERT's span head
            ("ForMaskedLM", "masked-lm"), ("ForCausalLM", CAUSAL_LM), ("LMHeadModel", CAUSAL_LM),
            ("ForImageClassification", "image-classification"))
IMAGE = "image-classification"
#: a vision-language model: images' tokens in the text sequence, trained on the text's labels
IMAGE_TEXT = "image-text-to-text"
TASKS = (CAUSAL_LM, "masked-lm", "sequence-classification", "token-classification", "question-answering",
         IMAGE, SEQ2SEQ, IMAGE_TEXT)
#: models whose step reads its attention mask's values: Longformer's and LED's sliding-window attention asks whether
#: any token attends globally (modeling_longformer.py LongformerEncoder.forward, modeling_led.py LEDEncoder.forward:
#: ``is_index_global_attn.flatten().any().item()``) and gathers the global tokens' indices (_get_global_attn_indices:
#: ``nonzero``), so the step is fed the mask a tokenizer gives an unpadded batch (ones), made with torch.tensor so
#: that a traced step keeps its values (activations/tracing/grids.py)
MASK_VALUE_MODELS = ("longformer", "led")
#: the vision-language models of any image resolution (Qwen-VL: the image's patch grid, image_grid_thw, is an input)
PATCH_GRID_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
#: the vision-language model types memplan traces (their image tokens: image_text_tokens)
IMAGE_TEXT_MODELS = ("llava", "gemma3", "paligemma", "mllama") + PATCH_GRID_MODELS
#: the vision-language models whose language model reads the images by cross-attention (Llama 3.2 Vision's Mllama):
#: one <|image|> token per image in the text, the tiles' features beside it
CROSS_ATTENTION_MODELS = ("mllama",)
#: transformers' Qwen2VLImageProcessor's default pixel budget, size["longest_edge"] (max_pixels: 28 * 28 * 1280),
#: which smart_resize shrinks a larger image to; Qwen3-VL's processor is the same class
DEFAULT_MAX_PIXELS = 28 * 28 * 1280

#: the vision transformers whose image classification memplan traces: model_type -> tokens beside the patches
IMAGE_MODELS = {"vit": 1, "deit": 2}
#: heads whose inputs are not token ids alone (refused by name)
NOT_MODELLED = ("ForConditionalGeneration", "ForMultipleChoice", "ForPreTraining",
                "ForSeq2SeqLM", "ForImageTextToText", "ForVision2Seq", "ForSpeechSeq2Seq", "ForAudioClassification",
                "ForCTC", "ForMaskedImageModeling", "ForObjectDetection", "ForSemanticSegmentation",
                "ForNextSentencePrediction", "ForImageTextRetrieval", "ForZeroShotImageClassification")


def task_of(config: Mapping[str, Any]) -> str:
    """The task of the config's first architecture; a config without one (or an unknown base class) trains as a
    causal LM, as memplan's estimates always have. ConfigError for a head memplan does not model."""
    arch = architecture(config)
    if is_seq2seq(config):
        return SEQ2SEQ
    if arch.endswith(("ForConditionalGeneration", "ForImageTextToText")) \
            and str(config.get("model_type")) in auto_class_mapping(AUTO_MAPPINGS[IMAGE_TEXT]):
        if config.get("model_type") not in IMAGE_TEXT_MODELS:
            causal = auto_class_mapping(AUTO_MAPPINGS[CAUSAL_LM]).get(str(config.get("model_type")))
            alone = (f"; --task {CAUSAL_LM} trains its language model alone ({causal}, as AutoModelForCausalLM "
                     "builds it)" if isinstance(causal, str) and causal.endswith("ForCausalLM") else "")
            raise ConfigError(f"architectures {quote(arch)}: vision-language models are modelled for model_type "
                              f"{', '.join(IMAGE_TEXT_MODELS)}, not {quote(config.get('model_type'))} (its images' "
                              f"tokens and inputs are its own){alone}")
        return IMAGE_TEXT
    for suffix, task in SUFFIXES:
        if arch.endswith(suffix):
            if task == IMAGE and config.get("model_type") not in IMAGE_MODELS:
                raise ConfigError(f"architectures {quote(arch)}: image classification is modelled for vision "
                                  f"transformers ({', '.join(IMAGE_MODELS)}), not model_type "
                                  f"{quote(config.get('model_type'))}")
            return task
    for suffix in NOT_MODELLED:
        if arch.endswith(suffix):
            raise ConfigError(f"architectures {quote(arch)}: memplan models these heads: {', '.join(TASKS)}; a "
                              f"{suffix[3:]} head's inputs are not token ids alone and are not modelled yet")
    if not arch:
        _no_causal_lm(config)
    return CAUSAL_LM


def _no_causal_lm(config: Mapping[str, Any]) -> None:
    """A config that names no architectures trains as a causal LM, unless its model_type has no causal LM class in
    transformers (AutoModelForCausalLM refuses it): then ConfigError naming the --task its Auto classes do build
    (a LlavaConfig saved by hand, without the class it was trained as)."""
    mt = config.get("model_type")
    if not isinstance(mt, str) or mt in auto_class_mapping(AUTO_MAPPINGS[CAUSAL_LM]):
        return
    tasks = [t for t in (IMAGE_TEXT, SEQ2SEQ, IMAGE, "masked-lm", "sequence-classification")
             if mt in auto_class_mapping(AUTO_MAPPINGS[t])]
    if tasks:
        raise ConfigError(f"model_type {quote(mt)}: the config names no architectures and transformers has no causal "
                          f"LM class for it; --task {tasks[0]} (or the config's architectures) says which head trains")


#: transformers' seq2seq LM mapping (model_type -> class); its speech and audio members take features, not ids
SEQ2SEQ_MAPPING = "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"
#: text seq2seq members of that mapping whose config nests its parts (encoder-decoder's encoder and decoder,
#: T5Gemma's) or adds another modality (an audio or vision tower): not the flat config the step is built from
_NESTED = ("encoder", "decoder", "audio_config", "vision_config", "text_config", "speech_config", "encoder_config",
           "decoder_config")


def is_seq2seq(config: Mapping[str, Any]) -> bool:
    """Whether the config trains as a text encoder-decoder LM: its class is transformers' seq2seq LM for its
    model_type (or it names no head and sets is_encoder_decoder, as bart-large's BartModel). ConfigError for a
    seq2seq model whose inputs are not token ids (speech, audio, nested sub-configs)."""
    arch = architecture(config)
    if not (arch.endswith(("ForConditionalGeneration", "MTModel", "ForSeq2SeqLM"))
            or (config.get("is_encoder_decoder") is True and arch.endswith("Model")
                and not arch.endswith("EncoderModel"))):
        return False
    mapped = auto_class_mapping(SEQ2SEQ_MAPPING).get(str(config.get("model_type")))
    if mapped is None or config.get("is_encoder_decoder") is False:
        return False  # a ForConditionalGeneration of another kind (vision-language, speech): refused by name
    nested = [k for k in _NESTED if isinstance(config.get(k), Mapping)]
    if nested:
        raise ConfigError(f"architectures {quote(arch)}: a seq2seq model whose config nests {', '.join(nested)} "
                          "(another modality, or composite parts) is not modelled; text encoder-decoders (T5, BART, "
                          "Pegasus, Marian) are")
    return True


def seq2seq_class(config: Mapping[str, Any]) -> str:
    """The class a seq2seq config trains as: its own LM class, or for a base model's checkpoint (bart-large's
    BartModel) the one AutoModelForSeq2SeqLM builds for its model_type, with the LM head."""
    name = architecture(config)
    if name.endswith(("ForConditionalGeneration", "MTModel")):
        return name
    return str(auto_class_mapping(SEQ2SEQ_MAPPING)[config["model_type"]])


def seq2seq_layers(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(encoder blocks, decoder blocks) of a seq2seq config, as its transformers config reads them: T5's
    num_layers and num_decoder_layers (which defaults to num_layers: configuration_t5.py), BART's encoder_layers
    and decoder_layers, ProphetNet's num_encoder_layers; None where it names neither."""
    enc = config.get("encoder_layers", config.get("num_encoder_layers", config.get("num_layers")))
    dec = config.get("decoder_layers", config.get("num_decoder_layers")) or enc
    if not (isinstance(enc, int) and isinstance(dec, int)) or isinstance(enc, bool) or isinstance(dec, bool):
        return None
    return enc, dec


def check_target_len(config: Mapping[str, Any], target_len: int | None, seq_len: int) -> int | None:
    """The decoder's length for a seq2seq config (--target-len; default the encoder's), else None; ConfigError
    for --target-len on a model with no decoder input, or longer than learned absolute positions allow."""
    if task_of(config) != SEQ2SEQ:
        if target_len is not None:
            raise ConfigError(f"--target-len {target_len}: only an encoder-decoder (seq2seq) model has a decoder "
                              f"input; {architecture(config) or config.get('model_type')} takes --seq-len alone")
        return None
    tgt = seq_len if target_len is None else target_len
    if tgt < 1:
        raise ConfigError(f"--target-len must be at least 1, got {tgt}")
    most = config.get("max_position_embeddings")
    if isinstance(most, int) and most > 0 and tgt > most:
        raise ConfigError(f"--target-len {tgt}: {architecture(config)} learns {most} absolute positions "
                          "(max_position_embeddings); a longer target does not run")
    return tgt


def architecture(config: Mapping[str, Any]) -> str:
    """The class name the task is built from (the config's first architecture; '' for a causal LM without one)."""
    archs = config.get("architectures") or []
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""


def image_tokens(config: Mapping[str, Any]) -> int:
    """A vision transformer's sequence: (image_size / patch_size)^2 patches and its extra tokens. ConfigError where
    the image is not a whole number of patches (ViTPatchEmbeddings refuses other sizes)."""
    size, patch = config.get("image_size", 224), config.get("patch_size", 16)
    if isinstance(size, list):
        size = size[0] if len(set(size)) == 1 else size
    if isinstance(patch, list):
        patch = patch[0] if len(set(patch)) == 1 else patch
    if not (isinstance(size, int) and isinstance(patch, int) and size > 0 and patch > 0):
        raise ConfigError(f"image_size {size!r} and patch_size {patch!r}: a square image of whole patches is modelled")
    if size % patch:
        raise ConfigError(f"image_size {size} is not a multiple of patch_size {patch}")
    return (size // patch) ** 2 + IMAGE_MODELS.get(str(config.get("model_type")), 1)


def _vision(config: Mapping[str, Any]) -> Any:
    """A vision-language config's transformers config object (its vision_config with the defaults its class fills
    in: LlavaConfig's CLIP at 336 px in 14 px patches when none is given, CLIPVisionConfig's 224 / 32 otherwise)."""
    return transformers_config(config)


#: the fields image_text_tokens reads, by model_type: (top-level, vision_config's)
_TOKEN_FIELDS = {"llava": (("vision_feature_select_strategy",), ("model_type", "image_size", "patch_size")),
                 "gemma3": (("mm_tokens_per_image",), ("image_size", "patch_size")),
                 "paligemma": ((), ("image_size", "patch_size")),
                 "mllama": ((), ("image_size",)),  # (its tiles' size: read by --image-size's refusal)
                 **{m: ((), ("patch_size", "spatial_merge_size")) for m in PATCH_GRID_MODELS}}


def _token_fields(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(config, vision config) as image_text_tokens reads them: the dict itself where it gives every field read
    (a refusal then needs no transformers import), else transformers' config object with its classes' defaults
    (LlavaConfig's CLIP at 336 px in 14 px patches, SiglipVisionConfig's 224 / 16, ...)."""
    from types import SimpleNamespace

    top, vision = _TOKEN_FIELDS.get(str(config.get("model_type")), ((), ()))
    vc = config.get("vision_config")
    if isinstance(vc, Mapping) and all(k in config for k in top) and all(k in vc for k in vision):
        return SimpleNamespace(**{k: config[k] for k in top}), SimpleNamespace(**{k: vc[k] for k in vision})
    cfg = _vision(config)
    return cfg, cfg.vision_config


def patch_factor(config: Mapping[str, Any]) -> int:
    """A patch-grid model's image side unit, patch_size x spatial_merge_size (smart_resize's factor: 28 for Qwen2-VL
    and Qwen2.5-VL, 32 for Qwen3-VL): each merged token covers that square."""
    _, vc = _token_fields(config)
    patch, merge = vc.patch_size, vc.spatial_merge_size
    if not (isinstance(patch, int) and isinstance(merge, int) and patch > 0 and merge > 0):
        raise ConfigError(f"vision_config patch_size {patch!r} and spatial_merge_size {merge!r}: whole numbers of "
                          "pixels and patches are modelled")
    return patch * merge


def image_side(config: Mapping[str, Any]) -> int:
    """The default image of a patch-grid model: the largest square smart_resize makes within the processor's default
    max_pixels (a larger image is shrunk to it: floor(sqrt(max_pixels) / factor) x factor; 980 px for Qwen2.5-VL)."""
    factor = patch_factor(config)
    return max(factor, int(DEFAULT_MAX_PIXELS ** 0.5) // factor * factor)


def image_size_of(config: Mapping[str, Any]) -> tuple[int, int]:
    """The (height, width) in pixels a patch-grid model's images are fed at (--image-size; image_side unless given)."""
    size = config.get(IMAGE_SIZE_KEY)
    if size is None:
        side = image_side(config)
        return side, side
    return int(size[0]), int(size[1])


def parse_image_size(value: Any) -> tuple[int, int] | None:
    """--image-size: ``N`` (a square) or ``HxW`` in pixels, or None. ConfigError naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        h, w = value
    else:
        parts = str(value).strip().lower().split("x")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"--image-size {quote(value)}: give pixels, N (a square) or HxW, e.g. 448 or 448x640")
        h, w = int(parts[0]), int(parts[-1])
    if h <= 0 or w <= 0:
        raise ConfigError(f"--image-size {quote(value)}: the height and width must be at least one pixel")
    return h, w


def check_image_size(config: Mapping[str, Any], size: tuple[int, int] | None) -> tuple[int, int] | None:
    """The image size a vision-language job feeds: a patch-grid model's (--image-size, else image_side), None for
    a model whose vision tower takes its config's image_size. ConfigError for --image-size on a model of a fixed
    size or that takes no images, or a size that is not whole merged patches (the processor makes none such)."""
    if size is not None and (task_of(config) != IMAGE_TEXT or config.get("model_type") not in PATCH_GRID_MODELS):
        if task_of(config) == IMAGE_TEXT:
            _, vc = _token_fields(config)
            raise ConfigError(f"--image-size {size[0]}x{size[1]}: {config.get('model_type')}'s vision tower takes "
                              f"images of its config's image_size ({vc.image_size} px); its processor resizes to it")
        raise ConfigError(f"--image-size {size[0]}x{size[1]}: only a vision-language model of any image resolution "
                          f"({', '.join(PATCH_GRID_MODELS)}) takes an image size")
    if task_of(config) != IMAGE_TEXT or config.get("model_type") not in PATCH_GRID_MODELS:
        return None
    factor = patch_factor(config)
    if size is None:
        return image_side(config), image_side(config)
    bad = [v for v in size if v % factor]
    if bad:
        v = bad[0]
        raise ConfigError(f"--image-size {size[0]}x{size[1]}: {config.get('model_type')}'s processor resizes images to "
                          f"multiples of {factor} px (patch_size x spatial_merge_size; smart_resize), so {v} is not "
                          f"fed; {v // factor * factor or factor} or {(v // factor + 1) * factor}")
    return size


def image_text_tokens(config: Mapping[str, Any]) -> int:
    """The tokens one image takes in a vision-language model's sequence (see the module's docstring). ConfigError
    where the image is not whole patches or Gemma 3's patch grid does not pool to mm_tokens_per_image."""
    if config.get("model_type") in CROSS_ATTENTION_MODELS:  # one <|image|> token; the tiles are cross-attended
        return 1
    if config.get("model_type") in PATCH_GRID_MODELS:  # each merged square of patches, one token
        factor = patch_factor(config)
        h, w = image_size_of(config)
        return (h // factor) * (w // factor)
    cfg, vc = _token_fields(config)
    size, patch = vc.image_size, vc.patch_size
    if not (isinstance(size, int) and isinstance(patch, int) and size > 0 and patch > 0):
        raise ConfigError(f"vision_config image_size {size!r} and patch_size {patch!r}: a square image of whole "
                          "patches is modelled")
    if size % patch:
        raise ConfigError(f"vision_config image_size {size} is not a multiple of patch_size {patch}")
    side = size // patch
    if config.get("model_type") == "paligemma":  # SigLIP's patches, no class token (modeling_paligemma.py)
        return side * side
    if config.get("model_type") == "gemma3":  # the patch grid average-pooled to mm_tokens_per_image
        tokens = int(cfg.mm_tokens_per_image)
        per_side = int(tokens ** 0.5)
        if per_side * per_side != tokens or side % per_side:
            raise ConfigError(f"mm_tokens_per_image {tokens}: Gemma 3 pools its {side} x {side} patches to a square "
                              "grid whose side divides it")
        return tokens
    # LLaVA: the tower's sequence (CLIP: its class token first), less the first token under the default strategy
    cls = 1 if getattr(vc, "model_type", "") == "clip_vision_model" else 0
    return side * side + cls - (1 if cfg.vision_feature_select_strategy == "default" else 0)


def image_span(config: Mapping[str, Any]) -> int:
    """The tokens one image takes in the text: its image tokens, and a patch-grid model's <|vision_start|> and
    <|vision_end|> around them (Qwen2VLProcessor's template)."""
    return image_text_tokens(config) + (2 if config.get("model_type") in PATCH_GRID_MODELS else 0)


def images_of(config: Mapping[str, Any]) -> int:
    """The images per sample a vision-language step takes (--images; 1 unless given)."""
    n = config.get(IMAGES_KEY)
    return 1 if n is None else int(n)


def check_images(config: Mapping[str, Any], images: int | None, seq_len: int) -> int | None:
    """The images per sample for a vision-language config (--images; default 1), else None; ConfigError for
    --images on a text model, a negative count, or images whose tokens leave no text in --seq-len."""
    if task_of(config) != IMAGE_TEXT:
        if images is not None:
            raise ConfigError(f"--images {images}: only a vision-language model takes images with its text; "
                              f"{architecture(config) or config.get('model_type')} takes token ids alone")
        return None
    n = 1 if images is None else images
    if n < 0:
        raise ConfigError(f"--images must be 0 or more, got {n}")
    per = image_span(config)
    if n and seq_len <= n * per:
        raise ConfigError(f"--seq-len {seq_len}: {n} image(s) of {per} tokens each take {n * per} tokens of the "
                          "sequence and leave no text; a longer --seq-len, fewer --images"
                          + (" or a smaller --image-size" if config.get("model_type") in PATCH_GRID_MODELS else ""))
    return n


def stacks(config: Mapping[str, Any]) -> int | None:
    """The blocks of a model with two stacks (an encoder-decoder's encoder and decoder, a vision-language model's
    vision tower and language model), traced at full depth; None for a model of one stack or an unknown count."""
    if "factory" in config:
        return None
    task = task_of(config)
    if task == SEQ2SEQ or encoder_decoder_head(config):
        both = seq2seq_layers(config)
        return None if both is None else sum(both)
    if task == IMAGE_TEXT or composite(config):
        cfg = _vision(config)
        vc = cfg.vision_config
        tower = getattr(vc, "num_hidden_layers", None) or vc.depth  # Qwen-VL's vision config names it depth
        tower += getattr(vc, "num_global_layers", 0) or 0  # Mllama's global transformer after its local one
        return int(tower) + int(cfg.get_text_config().num_hidden_layers)
    return None


def two_stacks(config: Mapping[str, Any] | None) -> bool:
    """Whether the config trains two stacks of blocks (seq2seq, image-text-to-text, or a vision-language model's
    other head: composite): traced at full depth, with no analytic counterpart and no tensor, pipeline, context
    or expert parallel layout."""
    return config is not None and "factory" not in config and (task_of(config) in (SEQ2SEQ, IMAGE_TEXT)
                                                                or composite(config) or encoder_decoder_head(config))


def encoder_decoder_head(config: Mapping[str, Any]) -> bool:
    """An encoder-decoder under a head other than its LM's (BartForSequenceClassification, T5's,
    BartForQuestionAnswering): both stacks run, the decoder on the input shifted right, and the head reads the
    decoder's output at each sequence's last EOS (modeling_bart.py, modeling_t5.py)."""
    return config.get("is_encoder_decoder") is True and task_of(config) in ("sequence-classification",
                                                                            "question-answering")


def composite(config: Mapping[str, Any]) -> bool:
    """A vision-language config (its language model in text_config, its vision tower in vision_config) under a
    head that builds the whole model: Gemma3ForSequenceClassification is GenericForSequenceClassification over
    AutoModel, i.e. Gemma3Model with its vision tower, which text alone never runs (modeling_gemma3.py,
    modeling_layers.py)."""
    return isinstance(config.get("text_config"), Mapping) and isinstance(config.get("vision_config"), Mapping)


def check_seq_len(config: Mapping[str, Any], seq_len: int | None) -> int | None:
    """The job's sequence for the config's task: an image model's is its tokens (image_tokens), which --seq-len
    may repeat but not change. A text encoder's head with learned absolute positions (BERT's position_embeddings,
    max_position_embeddings rows: the model cannot run longer sequences) defaults to that many, and a longer
    --seq-len is refused; a causal LM's is the caller's (None: its default; rotary positions run longer)."""
    task = task_of(config)
    if task in (CAUSAL_LM, IMAGE_TEXT):
        return seq_len
    if task == SEQ2SEQ:  # T5's relative positions run any length; BART's learned ones refuse a longer one
        most = config.get("max_position_embeddings")
        if seq_len is None and isinstance(most, int) and most > 0:
            return min(most, 2048)
        if seq_len is not None and isinstance(most, int) and most > 0 and seq_len > most:
            raise ConfigError(f"--seq-len {seq_len}: {architecture(config)} learns {most} absolute positions "
                              "(max_position_embeddings); a longer sequence does not run")
        return seq_len
    if task != IMAGE:
        most = config.get("max_position_embeddings")
        absolute = (config.get("position_embedding_type", "absolute") == "absolute"
                    and config.get("position_biased_input", True) is not False)
        if not (isinstance(most, int) and most > 0 and absolute):
            return seq_len
        if seq_len is None:
            return min(most, 2048)
        if seq_len > most:
            raise ConfigError(f"--seq-len {seq_len}: {architecture(config)} learns {most} absolute positions "
                              "(max_position_embeddings); a longer sequence does not run")
        return seq_len
    tokens = image_tokens(config)
    if seq_len is not None and seq_len != tokens:
        raise ConfigError(f"--seq-len {seq_len}: a vision transformer's sequence is its patches and class token, "
                          f"{tokens} at image_size {config.get('image_size', 224)} (set image_size in the config)")
    return tokens


def check_labels(config: Mapping[str, Any]) -> None:
    """A classification head's label count as the config gives it (num_labels, or id2label's size): a whole
    number of at least one, or a one-line ConfigError (a head of no outputs has no loss to train)."""
    if task_of(config) not in ("sequence-classification", "token-classification", IMAGE):
        return
    n = config.get("num_labels")
    if "id2label" not in config and n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"num_labels {n!r}: a classification head needs at least one label")


def num_labels(config: Mapping[str, Any]) -> int:
    """PretrainedConfig's num_labels: id2label's size where given, else num_labels, else 2."""
    id2label = config.get("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    n = config.get("num_labels")
    return n if isinstance(n, int) and n >= 1 else 2


def build(config: Mapping[str, Any], hf_cfg: Any, **kw: Any) -> Any:
    """The transformers model for the config's task (``kw``: from_config's keyword arguments)."""
    from transformers import AutoModelForCausalLM

    task = task_of(config)
    if getattr(hf_cfg, "languages", None) and getattr(hf_cfg, "default_language", "") is None:
        # X-MOD's language adapters: its forward needs a language (modeling_xmod.py: set_default_language, which a
        # training script calls); which one does not change the bytes, so the first of its languages
        hf_cfg.default_language = list(hf_cfg.languages)[0]
    if kw.get("attn_implementation") == "sdpa" and not sdpa_supported(config):
        kw = {**kw, "attn_implementation": "eager"}  # what transformers itself picks for it
    import transformers

    if task == CAUSAL_LM:
        named = getattr(transformers, architecture(config), None) if architecture(config) else None
        if named is not None and config.get("model_type") not in auto_class_mapping(AUTO_MAPPINGS[CAUSAL_LM]):
            # a language model's text config the Auto class has no entry for (Emu3's emu3_text_model, Mllama's
            # mllama_text_model: language_model's flat config), built by the class it names, as the Auto class
            # builds it from the composite config
            return named._from_config(hf_cfg, **kw)
        return AutoModelForCausalLM.from_config(hf_cfg, **kw)

    name = seq2seq_class(config) if task == SEQ2SEQ else architecture(config)
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ConfigError(f"transformers {transformers.__version__} has no class {quote(name)}")
    return cls._from_config(hf_cfg, **kw)


def sdpa_supported(config: Mapping[str, Any]) -> bool:
    """Whether the task's transformers class offers SDPA attention (its _supports_sdpa): a model without it (Gemma 2,
    whose logits are soft-capped; gpt-oss, whose attention has sinks; BLOOM's ALiBi; LED, FSMT, Pegasus-X) runs
    transformers' eager attention. That is what transformers picks for it when the job names no attn_implementation
    (modeling_utils.py get_correct_attn_implementation: None tries sdpa, and _sdpa_can_dispatch's refusal falls
    back to eager), as a Trainer or from_pretrained job does; each layer's probabilities are kept."""
    import transformers

    task = task_of(config)
    if task == CAUSAL_LM:  # the class AutoModelForCausalLM builds for the model_type
        name = auto_class_mapping(AUTO_MAPPINGS[CAUSAL_LM]).get(str(config.get("model_type")))
        name = name[0] if isinstance(name, (tuple, list)) and name else name
    else:
        name = seq2seq_class(config) if task == SEQ2SEQ else architecture(config)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return cls is None or getattr(cls, "_supports_sdpa", True) is not False


def step_inputs(task: str, config: Mapping[str, Any], ids: Any, dtype: Any = None) -> dict[str, Any]:
    """The keyword arguments of one training step's forward for ``ids`` [batch, seq] (token ids): the inputs and
    the labels the task's loss takes (zeros: the bytes do not depend on their values). ``dtype``: the parameters'
    (an image's pixels are fed in it, as a Trainer's collator and model.dtype have them). A model that reads its
    attention mask's values (MASK_VALUE_MODELS) gets the tokenizer's mask of an unpadded batch, all ones."""
    out = _step_inputs(task, config, ids, dtype)
    if config.get("model_type") in MASK_VALUE_MODELS and "input_ids" in out:
        import torch

        batch, seq = out["input_ids"].shape
        out["attention_mask"] = torch.tensor([[1] * seq] * batch, dtype=torch.long, device=out["input_ids"].device)
    return out


def _step_inputs(task: str, config: Mapping[str, Any], ids: Any, dtype: Any = None) -> dict[str, Any]:
    import torch

    batch = ids.shape[0]
    if task == CAUSAL_LM:
        return {"input_ids": ids, "labels": ids}
    if task in ("masked-lm", "token-classification", "question-answering"):
        # made from Python lists (torch.tensor), so that a traced step keeps their values (activations/tracing/
        # grids.py reads_ids): XLM and FlauBERT take each sequence's length from its ids (lengths.max().item())
        # and LED's question answering its separators
        seq = ids.shape[1]
        ids = torch.tensor(_id_rows(ids), dtype=torch.long, device=ids.device)
        if task == "question-answering":
            z = torch.tensor([0] * batch, dtype=torch.long, device=ids.device)
            return {"input_ids": ids, "start_positions": z, "end_positions": z.clone()}
        return {"input_ids": ids, "labels": ids if task == "masked-lm" else
                torch.tensor([[0] * seq] * batch, dtype=torch.long, device=ids.device)}
    if task == "sequence-classification":
        regression = num_labels(config) == 1 and config.get("problem_type") in (None, "regression")
        eos = config.get("eos_token_id")
        rows = _id_rows(ids)
        if isinstance(eos, int) and 0 <= eos:
            # each sequence ends with its EOS, as a tokenizer ends it, and has no other: a BART-style head pools
            # the last EOS's hidden state and refuses examples without one, or with unequal counts
            # (modeling_bart.py BartForSequenceClassification: "All examples must have the same number of <eos>
            # tokens")
            other = 0 if eos else 1
            rows = [[other if t == eos else t for t in row[:-1]] + [eos] for row in rows]
        # made from Python lists (torch.tensor): the head reads their values (the EOS positions it pools, DeBERTa's
        # labels that are not negative), which a traced step keeps as constants (activations/tracing/grids.py)
        ids = torch.tensor(rows, dtype=torch.long, device=ids.device)
        labels = torch.tensor([0] * batch, dtype=torch.float32 if regression else torch.long, device=ids.device)
        return {"input_ids": ids, "labels": labels}
    if task == IMAGE:  # ids: only the batch is read; the image from the config
        size = config.get("image_size", 224)
        size = size[0] if isinstance(size, list) else size
        pixels = torch.zeros(batch, config.get("num_channels", 3), size, size, device=ids.device,
                             dtype=dtype or torch.get_default_dtype())
        return {"pixel_values": pixels, "labels": torch.zeros(batch, dtype=torch.long, device=ids.device)}
    if task == IMAGE_TEXT and config.get("model_type") in PATCH_GRID_MODELS:  # the text made whole, see there
        return _patch_grid_inputs(config, batch, ids.shape[1], images_of(config), ids.device, dtype)
    if task == IMAGE_TEXT and config.get("model_type") in CROSS_ATTENTION_MODELS:
        return _tile_inputs(config, ids, images_of(config), dtype)
    if task == IMAGE_TEXT:  # each image's tokens after the first (a BOS), its pixels, the text's labels
        cfg = _vision(config)
        n, per, token = images_of(config), image_text_tokens(config), int(cfg.image_token_id)
        ids = torch.where(ids == token, 0, ids)  # a drawn id equal to the image token would be one more image token
        if n:
            ids[:, 1:1 + n * per] = token
        out = {"input_ids": ids, "labels": ids}
        if n:
            vc = cfg.vision_config
            out["pixel_values"] = torch.zeros(batch * n, vc.num_channels, vc.image_size, vc.image_size,
                                              device=ids.device, dtype=dtype or torch.get_default_dtype())
        if config.get("model_type") == "gemma3":  # Gemma3Processor's: 1 at image tokens
            out["token_type_ids"] = (ids == token).long()
        elif config.get("model_type") == "paligemma":  # PaliGemmaProcessor's: 0 in the prefix (the image), 1 after
            tt = torch.ones_like(ids)
            tt[:, :1 + n * per] = 0
            out["token_type_ids"] = tt
        return out
    if task == SEQ2SEQ:  # the decoder's labels, shifted right by the model into its inputs
        tgt = int(config.get(TARGET_KEY) or ids.shape[1])
        return {"input_ids": ids, "labels": torch.zeros(batch, tgt, dtype=torch.long, device=ids.device)}
    raise ValueError(f"unknown task {task}")


def _id_rows(ids: Any) -> list[list[int]]:
    """The token ids as lists: the harness's drawn ids, or zeros for a traced step's (a fake tensor has no values;
    the bytes do not depend on them)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(ids, FakeTensor):
        return [[0] * ids.shape[1] for _ in range(ids.shape[0])]
    return [list(map(int, row)) for row in ids.tolist()]


def _tile_inputs(config: Mapping[str, Any], ids: Any, n: int, dtype: Any) -> dict[str, Any]:
    """A Mllama step's inputs as MllamaProcessor makes them (processing_mllama.py, image_processing_mllama.py):
    each image one <|image|> token (image_token_index) after the first text token; its pixels as max_num_tiles tiles
    of image_size, ``pixel_values`` [batch, images, tiles, channels, image_size, image_size] (the processor pads
    every image to max_num_tiles: the vision model runs them all, masking the padding tiles), ``aspect_ratio_ids``
    [batch, images] (a square image split over every tile: the squarest supported ratio of max_num_tiles tiles,
    1-based; the bytes are the same for any ratio),
    ``aspect_ratio_mask`` [batch, images, tiles] and the dense ``cross_attention_mask`` [batch, seq, images, tiles]
    (get_cross_attention_token_mask: consecutive image tokens all attend from the first to the sequence's end)."""
    import torch

    cfg = _vision(config)
    vc = cfg.vision_config
    batch, seq = ids.shape
    token = int(cfg.image_token_index)
    ids = torch.where(ids == token, 0, ids)
    if n:
        ids[:, 1:1 + n] = token
    # the collator's labels: the image tokens ignored (-100; Mllama's image token is past the head's vocabulary)
    out: dict[str, Any] = {"input_ids": ids, "labels": torch.where(ids == token, -100, ids)}
    if not n:
        return out
    tiles = int(vc.max_num_tiles)
    ratios = [tuple(r) for r in vc.supported_aspect_ratios]
    # a square image split over every tile (2 x 2 of 4), as the processor splits a large square one
    full = min((abs(h - w), i + 1) for i, (h, w) in enumerate(ratios) if h * w == tiles)[1] \
        if any(h * w == tiles for h, w in ratios) else len(ratios)
    out["pixel_values"] = torch.zeros(batch, n, tiles, vc.num_channels, vc.image_size, vc.image_size,
                                      device=ids.device, dtype=dtype or torch.get_default_dtype())
    out["aspect_ratio_ids"] = torch.full((batch, n), full, dtype=torch.long, device=ids.device)
    out["aspect_ratio_mask"] = torch.ones(batch, n, tiles, dtype=torch.long, device=ids.device)
    mask = torch.zeros(batch, seq, n, tiles, dtype=torch.long, device=ids.device)
    mask[:, 1:] = 1
    out["cross_attention_mask"] = mask
    return out


def _patch_grid_inputs(config: Mapping[str, Any], batch: int, seq: int, n: int, device: Any,
                       dtype: Any) -> dict[str, Any]:
    """A Qwen-VL step's inputs, as its processor makes them (see the module's docstring): each sample's text
    holding its ``n`` images, each as <|vision_start|>, its image tokens and <|vision_end|>, after a first text token;
    ``mm_token_type_ids``; and the images' flattened patches and ``image_grid_thw``. The token ids and the grid are
    made from Python lists (torch.tensor): the model reads their values (its 3-D positions, its vision tower's
    windows), which a traced step keeps as constants (activations/tracing/grids.py)."""
    import torch

    cfg = _vision(config)
    vc = cfg.vision_config
    per, patch = image_text_tokens(config), int(vc.patch_size)
    h, w = image_size_of(config)
    if n and seq <= n * (per + 2):  # check_images's refusal, for a caller that did not ask it
        raise ConfigError(f"--seq-len {seq}: {n} image(s) of {per + 2} tokens each take {n * (per + 2)} tokens of "
                          "the sequence and leave no text")
    row = [0] * seq
    for i in range(n):
        at = 1 + i * (per + 2)
        row[at] = int(cfg.vision_start_token_id)
        row[at + 1:at + 1 + per] = [int(cfg.image_token_id)] * per
        row[at + 1 + per] = int(cfg.vision_end_token_id)
    ids = torch.tensor([row] * batch, dtype=torch.long, device=device)
    out: dict[str, Any] = {"input_ids": ids, "labels": ids,
                           "mm_token_type_ids": torch.tensor([[int(t == cfg.image_token_id) for t in row]] * batch,
                                                             dtype=torch.long, device=device)}
    if n:
        channels = int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3))
        grid = [1, h // patch, w // patch]
        out["pixel_values"] = torch.zeros(batch * n * grid[1] * grid[2],
                                          channels * int(vc.temporal_patch_size) * patch * patch, device=device,
                                          dtype=dtype or torch.get_default_dtype())
        out["image_grid_thw"] = torch.tensor([grid] * (batch * n), dtype=torch.long, device=device)
    return out


def trace_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as the traced step builds it (and the harness runs it): a decoder's sequence classification finds
    each row's last token through pad_token_id and refuses batches of more than one without it (modeling_layers.py
    GenericForSequenceClassification); the bytes do not depend on which id it is, so one is set where none is.
    LayerDrop is off (LAYERDROP_KEYS)."""
    out = dict(config)
    if task_of(config) == "sequence-classification" and out.get("pad_token_id") is None:
        out["pad_token_id"] = 0
    for k in LAYERDROP_KEYS:
        if isinstance(out.get(k), (int, float)) and out[k] > 0:
            out[k] = 0.0
    return out


#: LayerDrop (Fan et al. 2019): a layer skipped at random in training, `torch.rand([]) < layerdrop` per layer
#: (modeling_m2m_100.py, modeling_bart.py): a step's bytes depend on the draw, and the most a step holds is the
#: one that drops none, which is what the trace and the harness run (a draw on fake tensors cannot be taken)
LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def layerdrop_note(config: Mapping[str, Any]) -> str | None:
    """The note for a config that trains with LayerDrop (trace_config runs every layer), or None."""
    on = {k: config[k] for k in LAYERDROP_KEYS if isinstance(config.get(k), (int, float)) and config[k] > 0}
    if not on:
        return None
    return ("LayerDrop (" + ", ".join(f"{k} {v:g}" for k, v in on.items()) + ") skips layers at random in training; "
            "counted with every layer running, the most a step holds")


def language_model(config: Mapping[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A composite config (a vision-language model's, with a ``text_config``) whose class is a causal LM built on
    that text sub-config, as the config the model is built from: transformers' Auto classes do the same
    (auto_factory.py from_config: where the model class's config_class is config.sub_configs["text_config"], the
    model is built from config.get_text_config(), the parent's quantization_config copied to it), so
    AutoModelForCausalLM on a Qwen3.5 config.json builds Qwen3_5ForCausalLM, its language model alone. Returns the
    text config as a flat config.json dict (with that class as its architectures) and a note; None for any other
    config. Imports transformers only for a config that nests a text_config."""
    if "factory" in config or not isinstance(config.get("text_config"), Mapping) or task_of(config) != CAUSAL_LM:
        return None
    import transformers

    arch = architecture(config) or auto_class_mapping(AUTO_MAPPINGS[CAUSAL_LM]).get(config.get("model_type"))
    if isinstance(arch, (tuple, list)):
        arch = arch[0] if arch else None
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    cfg = transformers_config(config)
    sub = getattr(cfg, "sub_configs", {}).get("text_config")
    if cls is None or sub is None or getattr(cls, "config_class", None) is not sub:
        return None
    text = cfg.get_text_config().to_dict()
    text.pop("transformers_version", None)
    text["architectures"] = [cls.__name__]
    for key in ("quantization_config", "dtype", "torch_dtype"):  # the parent's, where the text config has none
        if config.get(key) is not None and text.get(key) is None:
            text[key] = copy.deepcopy(config[key])
    note = (f"{cls.__name__} is built from the config's text_config (model_type {quote(text.get('model_type'))}), "
            "as transformers' AutoModelForCausalLM does: the language model alone, no vision tower")
    return text, note


#: transformers' auto mapping of each task (modeling_auto.py), by model_type: the class --task builds
AUTO_MAPPINGS = {CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                 IMAGE: "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                 "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                 "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                 "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", SEQ2SEQ: SEQ2SEQ_MAPPING,
                 IMAGE_TEXT: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"}


def with_task(config: Mapping[str, Any], task: str) -> dict[str, Any]:
    """The config with ``architectures`` set to the class transformers' Auto classes build for ``task`` and the
    config's model_type (--task: fine-tune a checkpoint saved with another head, e.g. bert-base's BertForMaskedLM
    as a sequence classifier). ConfigError where the task is unknown or the model type has no such head."""
    if task not in TASKS:
        raise ConfigError(f"--task {quote(task)}: one of {', '.join(TASKS)}")
    model_type = config.get("model_type")
    cls = auto_class_mapping(AUTO_MAPPINGS[task]).get(model_type)
    if isinstance(cls, (tuple, list)):
        cls = cls[0] if cls else None
    if cls is None:
        raise ConfigError(f"--task {task}: transformers has no {task} head for model_type {quote(model_type)}")
    return {**config, "architectures": [cls]}


_MAPPING_CACHE: dict[str, dict[str, Any]] = {}


def auto_class_mapping(name: str) -> dict[str, Any]:
    """transformers' MODEL_FOR_*_MAPPING_NAMES (model_type -> class name, or several: the first is the Auto
    class's), read from modeling_auto.py's source:
    importing that module imports torch (2 s), and a refusal must be quick; imported where the source cannot be
    read as literals."""
    if name in _MAPPING_CACHE:
        return _MAPPING_CACHE[name]
    import ast
    import importlib.util
    from pathlib import Path

    out: dict[str, Any] | None = None
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.submodule_search_locations:
        src = Path(list(spec.submodule_search_locations)[0]) / "models" / "auto" / "modeling_auto.py"
        try:
            tree = ast.parse(src.read_text())
            for node in tree.body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and getattr(node.targets[0], "id", None) == name and isinstance(node.value, ast.Call)
                        and node.value.args):
                    out = dict(ast.literal_eval(node.value.args[0]))
                    break
        except (OSError, SyntaxError, ValueError, TypeError):
            out = None
    if out is None:
        from transformers.models.auto import modeling_auto

        out = dict(getattr(modeling_auto, name))
    _MAPPING_CACHE[name] = out
    return out


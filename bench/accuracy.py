"""Accuracy of memplan against real runs: `memplan validate` over a matrix of strategies, written to
docs/accuracy.md with the command that produced it.

    python bench/accuracy.py            # the matrix below (CPU, gloo, 2 ranks; ~15 minutes on 2 cores)
    python bench/accuracy.py --quick    # one DeepSpeed stage and one FSDP2 strategy
    python bench/accuracy.py --cross    # the full cross product (strategy x ranks 1/2/4 x recompute x recipe x
                                        # model), written to docs/accuracy-cross.md; --resume continues a run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL_DS = dict(reduce_bucket_size=100_000, allgather_bucket_size=100_000, prefetch_bucket_size=10_000,
                max_live_parameters=100_000, param_persistence_threshold=0, overlap_comm=False)
LLAMA = ("llama-7b", dict(layers=2, hidden=256, vocab=2048))  # GQA-free llama block, untied head
LLAMA_BIGVOCAB = ("llama-7b", dict(layers=2, hidden=256, vocab=32000))  # the root larger than a block
GPT2 = ("gpt2", dict(layers=2, hidden=256, vocab=2048))  # tied embeddings, LayerNorm + GELU MLP
LLAMA3 = ("llama-3-8b", dict(layers=2, hidden=512, vocab=2048))  # GQA (4 query heads per kv head)
LLAMA3_4 = ("llama-3-8b", dict(layers=4, hidden=512, vocab=2048))
LLAMA4 = ("llama-7b", dict(layers=4, hidden=256, vocab=2048))  # more blocks: retention and prefetch matter
LLAMA8 = ("llama-7b", dict(layers=8, hidden=256, vocab=2048))  # pp 4 with two stages per rank: 8 stages
LLAMA_WIDE = ("llama-7b", dict(layers=2, hidden=512, vocab=128))
#: BertForSequenceClassification (tests/data/configs): the encoder with its pooler and classifier, 2 labels
BERT = ("tests/data/configs/bert-seq-cls.json", dict(layers=2, hidden=256, vocab=2048))  # run from the root
VIT = ("tests/data/configs/vit-small.json", dict(layers=2, hidden=256, vocab=None))  # the blocks' matrices outweigh the embedding
# encoder-decoders (model/tasks.py SEQ2SEQ): 2 encoder and 2 decoder blocks, 128 tokens in, 64 labels out
T5 = ("tests/data/configs/flan-t5-base.json", dict(layers=2, hidden=256, vocab=2048))
BART = ("tests/data/configs/bart-large.json", dict(layers=2, hidden=256, vocab=2048))
# sliding-window attention (window 512, global tokens): reads its attention mask's values (model/tasks.py
# MASK_VALUE_MODELS)
LONGFORMER = ("tests/data/configs/longformer-base-4096.json", dict(layers=2, hidden=256, vocab=2048))
LED = ("tests/data/configs/led-base-16384.json", dict(layers=2, hidden=256, vocab=2048))
# M2M100 (m2m100_418M's sizes): sinusoidal position tables as non-persistent buffers, a thrice-used shared embedding
M2M100 = ("tests/data/configs/m2m100.json", dict(layers=2, hidden=256, vocab=2048))
# vision-language models (model/tasks.py IMAGE_TEXT), run at their own tiny sizes: LLaVA (CLIP 32 px in 8 px
# patches, 3 vision blocks, the second-to-last one's features: 16 image tokens; 2 llama blocks) and Gemma 3 (SigLIP
# 64 px in 8 px patches pooled to 16 tokens, 2 + 2 blocks); one image per sample in 128 tokens
LLAVA = ("tests/data/configs/llava-tiny.json", dict(layers=None))
GEMMA3_VL = ("tests/data/configs/gemma3-vl-tiny.json", dict(layers=None))
# PaliGemma: SigLIP 32 px in 8 px patches (16 image tokens, a bidirectional prefix), 2 + 2 blocks
PALIGEMMA = ("tests/data/configs/paligemma-tiny.json", dict(layers=None))
# vision-language models of any image resolution (model/tasks.py PATCH_GRID_MODELS) at their own tiny sizes, images
# of 168 x 224 px (Qwen2-VL, Qwen2.5-VL: 14 px patches merged 2 x 2, 48 image tokens; Qwen2.5-VL's 112 px windows
# of unequal sizes) and 128 x 192 px (Qwen3-VL: 16 px patches, 24 image tokens) in 128 tokens
QWEN25_VL = ("tests/data/configs/qwen2.5-vl-tiny.json", dict(layers=None))
QWEN2_VL = ("tests/data/configs/qwen2-vl-tiny.json", dict(layers=None))
QWEN3_VL = ("tests/data/configs/qwen3-vl-tiny.json", dict(layers=None))
# Qwen3-VL-MoE: the same tower, a language model of 4 fused experts, top-2, in each of its 3 blocks
QWEN3_VL_MOE = ("tests/data/configs/qwen3-vl-moe-tiny.json", dict(layers=None))
# Qwen3.5 and Qwen3.5-MoE: Qwen3-VL's tower (2 blocks, 16 px patches) under a hybrid language model of 4 blocks
# (3 gated-delta-net linear attention, 1 full), the MoE's of 8 experts top-2 with a shared expert; 64 px images
QWEN35 = ("tests/data/configs/qwen3.5-tiny.json", dict(layers=None))
QWEN35_MOE = ("tests/data/configs/qwen3.5-moe-tiny.json", dict(layers=None))
QWEN_IMG = dict(image_size=(168, 224))
# Mllama (Llama 3.2 Vision): 56 px tiles in 14 px patches (17 patches with the class token, padded to 24), 4 tiles an
# image, 2 local + 1 global vision layers, a language model of 4 blocks whose 2nd and 4th cross-attend to the tiles
MLLAMA = ("tests/data/configs/mllama-tiny.json", dict(layers=None))
LLAMA10 = ("llama-7b", dict(layers=10, hidden=256, vocab=2048))  # two stages per rank over pp 2: 2-3 blocks each
MIXTRAL = ("mixtral-8x7b", dict(layers=2, hidden=256, vocab=2048))  # MoE: 8 experts, top-2, grouped_mm
MIXTRAL4 = ("mixtral-8x7b", dict(layers=4, hidden=256, vocab=2048))
LLAMA_CP = ("llama-7b", dict(layers=2, hidden=256, vocab=512))  # a small vocabulary: attention, not the loss
QWEN2_MOE = ("bench/configs/qwen2-moe-tiny/config.json", dict(layers=2))  # 8 experts top-2 and a shared expert
QWEN3_MOE = ("bench/configs/qwen3-moe-tiny/config.json", dict(layers=2))  # 16 experts, top-4, normalised
MIXTRAL6 = ("mixtral-8x7b", dict(layers=6, hidden=256, vocab=2048))  # two stages per rank over pp 2
QWEN2_MOE4 = ("bench/configs/qwen2-moe-tiny/config.json", dict(layers=4))
QWEN3_MOE4 = ("bench/configs/qwen3-moe-tiny/config.json", dict(layers=4))
#: transformers' own defaults for these MoE families, scaled to hidden 256, 2 blocks, 8 experts top-2
OTHER_MOE = [(f"bench/configs/{n}-tiny/config.json", dict(layers=2)) for n in ("olmoe", "phimoe", "granitemoe",
                                                                               "glm4-moe")]
GPT2_4 = ("gpt2", dict(layers=4, hidden=256, vocab=2048))  # tied embeddings, four blocks
DEEPSEEK = ("deepseek-v3", dict(layers=4, hidden=256, vocab=2048))  # MLA; 3 dense blocks then a 256-expert one
NO_REUSE = dict(max_reuse_distance=0, param_persistence_threshold=0)
LLAMA3_TP = ("llama-3-8b", dict(layers=2, hidden=1024, vocab=2048))  # GQA with 2 key/value heads: TP 2 divides them
Parallel = __import__("memplan.parallel", fromlist=["Parallel"]).Parallel

CASES = [
    # (label, model, strategy kwargs, ds overrides, torch overrides, recompute)
    ("ddp", LLAMA, dict(strategy="ddp"), {}, {}, "none"),
    ("ddp", LLAMA, dict(strategy="ddp"), {}, {}, "full"),
    ("ddp", GPT2, dict(strategy="ddp"), {}, {}, "none"),
    ("zero-optimizer", LLAMA, dict(strategy="zero-optimizer"), {}, {}, "none"),
    ("zero1 small buckets", LLAMA, dict(stage=1), SMALL_DS, {}, "none"),
    ("zero2 small buckets", LLAMA, dict(stage=2), SMALL_DS, {}, "none"),
    ("zero2 small buckets", GPT2, dict(stage=2), SMALL_DS, {}, "none"),
    ("zero2 small buckets", LLAMA3, dict(stage=2), SMALL_DS, {}, "full"),
    ("zero2 defaults", LLAMA, dict(stage=2), {}, {}, "none"),
    ("zero3 small buckets", LLAMA, dict(stage=3), SMALL_DS, {}, "none"),
    ("zero3 defaults", LLAMA, dict(stage=3), {}, {}, "none"),
    ("fsdp-full", LLAMA, dict(strategy="fsdp-full"), {}, {}, "none"),
    ("fsdp-grad-op", LLAMA, dict(strategy="fsdp-grad-op"), {}, {}, "none"),
    ("fsdp-no-shard", LLAMA, dict(strategy="fsdp-no-shard"), {}, {}, "none"),
    ("zero3 reuse distance 0", LLAMA4, dict(stage=3), NO_REUSE, {}, "none"),
    ("zero3 small buckets", LLAMA4, dict(stage=3), SMALL_DS, {}, "none"),
    ("fsdp-full", LLAMA4, dict(strategy="fsdp-full"), {}, {}, "none"),
    ("fsdp-grad-op", LLAMA4, dict(strategy="fsdp-grad-op"), {}, {}, "none"),
    # an int group size: 1 keeps whole parameters after forward (FSDP2 reads it as False)
    ("fsdp-full reshard 1 (= false)", LLAMA4, dict(strategy="fsdp-full"), {}, dict(reshard_after_forward=1), "none"),
    ("fsdp-full", LLAMA, dict(strategy="fsdp-full"), {}, {}, "full"),
    ("zero2 small buckets, 4 ranks", LLAMA, dict(stage=2, gpus=4), SMALL_DS, {}, "none"),
    ("ddp, 1 rank", LLAMA, dict(strategy="ddp", gpus=1), {}, {}, "none"),
    # session 4: second recipes, tied embeddings under FSDP2, more ranks, HSDP with two shard groups
    ("fsdp-full, torch-amp", LLAMA, dict(strategy="fsdp-full", precision="torch-amp"), {}, {}, "none"),
    ("fsdp-full, fp32", LLAMA, dict(strategy="fsdp-full", precision="fp32"), {}, {}, "none"),
    ("fsdp-no-shard, torch-amp", LLAMA, dict(strategy="fsdp-no-shard", precision="torch-amp"), {}, {}, "none"),
    ("ddp, fp32", LLAMA, dict(strategy="ddp", precision="fp32"), {}, {}, "none"),
    ("fsdp-full", GPT2, dict(strategy="fsdp-full"), {}, {}, "none"),
    ("fsdp-full, 4 ranks", LLAMA, dict(strategy="fsdp-full", gpus=4), {}, {}, "none"),
    ("hsdp 2 x 2, 4 ranks", LLAMA, dict(strategy="hsdp", gpus=4), {}, dict(hsdp_shard_size=2), "none"),
    ("zero3 small buckets, 4 ranks", LLAMA, dict(stage=3, gpus=4), SMALL_DS, {}, "none"),
    # session 5: resharding to a group of 2 of 4 ranks after forward (hpZ-like: a secondary shard per block)
    ("fsdp-full reshard 2 (hpZ-like), 4 ranks", LLAMA4, dict(strategy="fsdp-full", gpus=4), {},
     dict(reshard_after_forward=2), "none"),
    # session 5: MoE (large blocks: FSDP2's all-gather copy-outs and in-block backward moments dominate), blocks
    # that differ in size (DeepSeek: dense, then MoE)
    ("ddp", MIXTRAL, dict(strategy="ddp"), {}, {}, "none"),
    ("fsdp-full", MIXTRAL, dict(strategy="fsdp-full"), {}, {}, "none"),
    ("fsdp-full, fp32", MIXTRAL, dict(strategy="fsdp-full", precision="fp32"), {}, {}, "none"),
    ("zero3 defaults", MIXTRAL, dict(stage=3), {}, {}, "none"),
    ("fsdp-full", DEEPSEEK, dict(strategy="fsdp-full"), {}, {}, "none"),
    # session 5: ZeRO-1 at DeepSpeed's default buckets (its backward sets up the 500M-element ipg bucket too),
    # DeepSpeed's fp16 recipe, FSDP1 (FlatParameter per block)
    ("zero1 defaults", LLAMA, dict(stage=1), {}, {}, "none"),
    ("zero2 small buckets, fp16", LLAMA, dict(stage=2, precision="deepspeed-fp16"), SMALL_DS, {}, "none"),
    ("zero3 small buckets, fp16", LLAMA, dict(stage=3, precision="deepspeed-fp16"), SMALL_DS, {}, "none"),
    ("fsdp1 full", LLAMA, dict(strategy="fsdp-full"), {}, dict(fsdp_version=1), "none"),
    ("fsdp1 full, fp32", LLAMA, dict(strategy="fsdp-full", precision="fp32"), {}, dict(fsdp_version=1), "none"),
    ("fsdp1 grad-op", LLAMA4, dict(strategy="fsdp-grad-op"), {}, dict(fsdp_version=1), "none"),
    ("fsdp1 no-shard", LLAMA, dict(strategy="fsdp-no-shard"), {}, dict(fsdp_version=1), "none"),
    ("fsdp1 full", MIXTRAL, dict(strategy="fsdp-full"), {}, dict(fsdp_version=1), "none"),
    ("fsdp1 hybrid 2 x 2, 4 ranks", LLAMA, dict(strategy="hsdp", gpus=4), {}, dict(hsdp_shard_size=2, fsdp_version=1),
     "none"),
    # session 6: ZeRO-Offload (on CPU one allocator holds device and host: the host share is compared too), a
    # tied embedding under full recompute
    ("zero3 + offload optimizer, small buckets", LLAMA, dict(stage=3), dict(SMALL_DS, offload_optimizer=True), {},
     "none"),
    ("zero3 + offload optimizer, defaults", LLAMA, dict(stage=3), dict(offload_optimizer=True), {}, "none"),
    ("zero3 + offload optimizer and params", LLAMA, dict(stage=3),
     dict(SMALL_DS, offload_optimizer=True, offload_param=True), {}, "none"),
    ("zero2 + offload optimizer", LLAMA, dict(stage=2), dict(SMALL_DS, offload_optimizer=True), {}, "none"),
    ("ddp", GPT2, dict(strategy="ddp"), {}, {}, "full"),
    ("fsdp-full", GPT2, dict(strategy="fsdp-full"), {}, {}, "full"),
    # session 8: DeepSpeed with fp32 parameters (torch autocast around the engine, or plain fp32): its ZeRO
    # optimizers still keep their own fp32 copy; ZeRO-3's linear saves the uncast input and weight
    ("zero3 small buckets, torch-amp", LLAMA3, dict(stage=3, precision="torch-amp"), SMALL_DS, {}, "none"),
    ("zero3 small buckets, torch-amp", LLAMA3, dict(stage=3, precision="torch-amp"), SMALL_DS, {}, "full"),
    ("zero3 small buckets, fp32", GPT2, dict(stage=3, precision="fp32"), SMALL_DS, {}, "none"),
    ("zero2 small buckets, torch-amp", LLAMA3, dict(stage=2, precision="torch-amp"), SMALL_DS, {}, "full"),
    ("zero1 small buckets, fp32", GPT2, dict(stage=1, precision="fp32"), SMALL_DS, {}, "none"),
    # session 16: transformers' every_n_layers (Trainer activation_checkpointing_kwargs): blocks 0, N, 2N, ...
    # checkpointed, the others keep their activations; every:2 of four blocks leaves the last one kept, every:3
    # checkpoints it
    ("ddp", LLAMA4, dict(strategy="ddp"), {}, {}, "every:2"),
    ("ddp", LLAMA4, dict(strategy="ddp"), {}, {}, "every:3"),
    ("fsdp-full", LLAMA4, dict(strategy="fsdp-full"), {}, {}, "every:2"),
    ("fsdp1 full", LLAMA4, dict(strategy="fsdp-full"), {}, dict(fsdp_version=1), "every:2"),
    ("zero2 small buckets", LLAMA4, dict(stage=2), SMALL_DS, {}, "every:2"),
    ("zero3 small buckets", LLAMA4, dict(stage=3), SMALL_DS, {}, "every:3"),
    ("fsdp-full", GPT2_4, dict(strategy="fsdp-full"), {}, {}, "every:2"),
    # session 16: torchtitan's layer SAC (blocks N-1, 2N-1, ...) and per-op SAC (each block checkpointed, the
    # outputs of all but every second aten.mm kept; gpt2's Conv1D is addmm, not on the list; Mixtral's experts run
    # grouped_mm, not on it either)
    ("ddp", LLAMA4, dict(strategy="ddp"), {}, {}, "layer-sac:2"),
    ("fsdp-full", LLAMA4, dict(strategy="fsdp-full"), {}, {}, "layer-sac:3"),
    ("ddp", LLAMA4, dict(strategy="ddp"), {}, {}, "op-sac"),
    ("fsdp-full", LLAMA4, dict(strategy="fsdp-full"), {}, {}, "op-sac"),
    ("zero3 small buckets", LLAMA4, dict(stage=3), SMALL_DS, {}, "op-sac"),
    ("fsdp-full", GPT2_4, dict(strategy="fsdp-full"), {}, {}, "op-sac"),
    ("fsdp-full", MIXTRAL, dict(strategy="fsdp-full"), {}, {}, "op-sac"),
    # session 16: full recompute over four blocks, where each block's sharded gradients outweigh its
    # activations: memory grows through backward and peaks inside the second block's (the first prefetched)
    ("fsdp-full", LLAMA4, dict(strategy="fsdp-full"), {}, {}, "full"),
    ("fsdp-full, 4 ranks", LLAMA4, dict(strategy="fsdp-full", gpus=4), {}, {}, "full"),
    ("fsdp-full reshard 2 (hpZ-like), 4 ranks", LLAMA4, dict(strategy="fsdp-full", gpus=4), {},
     dict(reshard_after_forward=2), "full"),
    ("fsdp-grad-op", LLAMA4, dict(strategy="fsdp-grad-op"), {}, {}, "full"),
    ("fsdp1 full", LLAMA4, dict(strategy="fsdp-full"), {}, dict(fsdp_version=1), "full"),
    # session 18: DeepSpeed stage 0 as 0.19.8 runs it (FP16_UnfusedOptimizer; the torch optimizer in fp32), and
    # size-based FSDP units (each MLP a unit, the attention with the decoder stack's unit: an upper bound)
    ("zero0", LLAMA, dict(stage=0), {}, {}, "none"),
    ("zero0 fp32", LLAMA, dict(stage=0, precision="fp32"), {}, {}, "none"),
    ("fsdp1 size:300000", LLAMA, dict(strategy="fsdp-full"), {}, dict(fsdp_version=1, fsdp_wrap="size:300000"),
     "none"),
    ("fsdp-full size:300000", LLAMA, dict(strategy="fsdp-full"), {}, dict(fsdp_wrap="size:300000"), "none"),
    # session 19: tensor, sequence and pipeline parallelism in torchtitan's layout (DTensor TP with loss
    # parallelism, torch.distributed.pipelining), FSDP2 over the data-parallel ranks
    ("fsdp-full tp 2", LLAMA, dict(strategy="fsdp-full", parallel=Parallel(tp=2)), {}, {}, "none"),
    ("fsdp-full tp 2 + sp", LLAMA, dict(strategy="fsdp-full", parallel=Parallel(tp=2, sp=True)), {}, {}, "none"),
    ("fsdp-full tp 2, logits gathered (no loss parallel)", LLAMA,
     dict(strategy="fsdp-full", parallel=Parallel(tp=2, loss_parallel=False)), {}, {}, "none"),
    ("fsdp-full tp 2", LLAMA, dict(strategy="fsdp-full", parallel=Parallel(tp=2)), {}, {}, "full"),
    ("fsdp-full tp 2, GQA", LLAMA3_TP, dict(strategy="fsdp-full", parallel=Parallel(tp=2)), {}, {}, "none"),
    ("fsdp-full tp 2 x dp 2", LLAMA, dict(strategy="fsdp-full", gpus=4, parallel=Parallel(tp=2)), {}, {}, "none"),
    ("fsdp-full pp 2 1f1b, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2)), {}, {}, "none"),
    ("fsdp-full pp 2 gpipe, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="gpipe")), {}, {}, "none"),
    ("fsdp-full pp 2 interleaved, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="interleaved")), {}, {}, "none"),
    ("fsdp-full pp 2 x dp 2 1f1b, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(pp=2)), {}, {}, "none"),
    ("fsdp-full pp 2 x dp 2 gpipe, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(pp=2, schedule="gpipe")), {}, {}, "none"),
    ("fsdp-full tp 2 x pp 2 1f1b, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(tp=2, pp=2)), {}, {}, "none"),
    ("ddp pp 2 1f1b, torch-amp, 4 micro-batches", LLAMA4, dict(strategy="ddp", grad_accum=4, parallel=Parallel(pp=2)),
     {}, {}, "none"),
    ("zero1 pp 2 (PipelineEngine), 4 micro-batches", LLAMA4, dict(stage=1, grad_accum=4, parallel=Parallel(pp=2)),
     {}, {}, "none"),
    ("zero1 pp 2 (PipelineEngine) small buckets, 4 micro-batches", LLAMA4,
     dict(stage=1, grad_accum=4, parallel=Parallel(pp=2)), SMALL_DS, {}, "none"),
    ("fsdp-full pp 2 zbv (zero bubble), 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="zbv")), {}, {}, "none"),
    ("fsdp-full pp 2 zbv (zero bubble), 8 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=8, parallel=Parallel(pp=2, schedule="zbv")), {}, {}, "none"),
    ("fsdp-full pp 2 x dp 2 zbv (zero bubble), 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(pp=2, schedule="zbv")), {}, {}, "none"),
    # session 28: Lion (lion-pytorch) and schedule-free AdamW (schedulefree) on what each framework hands them
    ("lion, 1 rank", LLAMA, dict(gpus=1, optimizer="lion"), {}, {}, "none"),
    ("lion ddp", LLAMA, dict(strategy="ddp", optimizer="lion"), {}, {}, "none"),
    ("lion ddp pure-bf16", LLAMA, dict(strategy="ddp", precision="pure-bf16", optimizer="lion"), {}, {}, "none"),
    ("lion fsdp-full", LLAMA, dict(strategy="fsdp-full", optimizer="lion"), {}, {}, "none"),
    ("lion fsdp1 full", LLAMA, dict(strategy="fsdp-full", optimizer="lion"), {}, dict(fsdp_version=1), "none"),
    ("schedule-free adamw ddp", LLAMA, dict(strategy="ddp", optimizer="adamw-schedulefree"), {}, {}, "none"),
    ("schedule-free adamw fsdp-full", LLAMA, dict(strategy="fsdp-full", optimizer="adamw-schedulefree"), {}, {},
     "none"),
    # torch.optim.Muon on the blocks' matrices with AdamW on the rest; the small vocabulary lets Newton-Schulz peak
    ("muon, 1 rank", LLAMA, dict(gpus=1, optimizer="muon"), {}, {}, "none"),
    ("muon ddp", LLAMA, dict(strategy="ddp", optimizer="muon"), {}, {}, "none"),
    ("muon, 1 rank, hidden 512 vocab 128", LLAMA_WIDE, dict(gpus=1, optimizer="muon"), {}, {}, "none"),
    ("muon ddp pure-bf16, hidden 512 vocab 128", LLAMA_WIDE, dict(strategy="ddp", precision="pure-bf16", optimizer="muon"), {}, {},
     "none"),
    # adam-mini 1.1.1 (Adam_mini): m, and v per head / row / block, chosen by the parameters' names
    ("adam-mini, 1 rank", LLAMA, dict(gpus=1, optimizer="adam-mini"), {}, {}, "none"),
    ("adam-mini ddp", LLAMA, dict(strategy="ddp", optimizer="adam-mini"), {}, {}, "none"),
    ("adam-mini, 1 rank, pure-bf16", LLAMA, dict(gpus=1, precision="pure-bf16", optimizer="adam-mini"), {}, {},
     "none"),
    ("adam-mini ddp pure-bf16", LLAMA, dict(strategy="ddp", precision="pure-bf16", optimizer="adam-mini"), {}, {},
     "none"),
    ("adam-mini, 1 rank, hidden 512 vocab 128", LLAMA_WIDE, dict(gpus=1, optimizer="adam-mini"), {}, {}, "none"),
    # session 29: APOLLO (apollo-torch APOLLOAdamW) as the Trainer groups it: rank 128 on the attention and MLP weights
    ("apollo-adamw, 1 rank", LLAMA, dict(gpus=1, optimizer="apollo-adamw"), {}, {}, "none"),
    ("apollo-adamw, 1 rank, pure-bf16", LLAMA, dict(gpus=1, precision="pure-bf16", optimizer="apollo-adamw"), {}, {},
     "none"),
    ("apollo-adamw ddp pure-bf16", LLAMA, dict(strategy="ddp", precision="pure-bf16", optimizer="apollo-adamw"), {},
     {}, "none"),
    ("apollo-adamw, 1 rank, hidden 512 vocab 128", LLAMA_WIDE, dict(gpus=1, optimizer="apollo-adamw"), {}, {},
     "none"),
    # session 33: GaLore (galore-torch GaLoreAdamW) as the Trainer groups it: rank 128, SVD projections
    ("galore-adamw, 1 rank", LLAMA, dict(gpus=1, optimizer="galore-adamw"), {}, {}, "none"),
    ("galore-adamw, 1 rank, pure-bf16", LLAMA, dict(gpus=1, precision="pure-bf16", optimizer="galore-adamw"), {}, {},
     "none"),
    ("galore-adamw ddp pure-bf16", LLAMA, dict(strategy="ddp", precision="pure-bf16", optimizer="galore-adamw"), {},
     {}, "none"),
    ("galore-adamw, 1 rank, hidden 512 vocab 128", LLAMA_WIDE, dict(gpus=1, optimizer="galore-adamw"), {}, {},
     "none"),
    ("galore-adamw, 1 rank, fp32, hidden 512 vocab 128", LLAMA_WIDE, dict(gpus=1, precision="fp32",
                                                                         optimizer="galore-adamw"), {}, {}, "none"),
    # session 33: Keller Jordan's Muon (muon-optimizer): SingleDeviceMuonWithAuxAdam on one rank, MuonWithAuxAdam
    # over DDP's ranks (each orthogonalises every second matrix, then all-gathers them)
    ("muon-with-aux-adam, 1 rank", LLAMA, dict(gpus=1, optimizer="muon-with-aux-adam"), {}, {}, "none"),
    ("muon-with-aux-adam ddp", LLAMA, dict(strategy="ddp", optimizer="muon-with-aux-adam"), {}, {}, "none"),
    ("muon-with-aux-adam ddp pure-bf16", LLAMA, dict(strategy="ddp", precision="pure-bf16",
                                                     optimizer="muon-with-aux-adam"), {}, {}, "none"),
    ("muon-with-aux-adam ddp, hidden 512 vocab 128", LLAMA_WIDE, dict(strategy="ddp", optimizer="muon-with-aux-adam"),
     {}, {}, "none"),
    ("muon-with-aux-adam, 1 rank, hidden 512 vocab 128", LLAMA_WIDE, dict(gpus=1, optimizer="muon-with-aux-adam"),
     {}, {}, "none"),
    # session 33: a bf16 model under autocast (transformers 5 loads a bf16 checkpoint so; the Trainer's bf16=True)
    ("bf16-autocast, 1 rank", LLAMA, dict(gpus=1, precision="bf16-autocast"), {}, {}, "none"),
    ("bf16-autocast ddp", LLAMA, dict(strategy="ddp", precision="bf16-autocast"), {}, {}, "none"),
    ("bf16-autocast ddp", GPT2, dict(strategy="ddp", precision="bf16-autocast"), {}, {}, "none"),
    ("bf16-autocast, 1 rank", LLAMA, dict(gpus=1, precision="bf16-autocast"), {}, {}, "full"),
    # a float16 checkpoint under bf16 autocast: every weight copied, the residual stream promoted to fp32
    ("fp16-bf16-autocast, 1 rank", LLAMA, dict(gpus=1, precision="fp16-bf16-autocast"), {}, {}, "none"),
    # (not on CPU: GPT-2's layer_norm refuses an fp32 input with fp16 weights, and DDP's step stops in CPU
    # autocast's prioritize, "Unexpected floating ScalarType", measured with torch 2.13)
    # session 29: a text encoder's own head (model/tasks.py): BertForSequenceClassification on its labels
    ("bert seq-cls, 1 rank, fp32", BERT, dict(gpus=1, precision="fp32"), {}, {}, "none"),
    ("bert seq-cls, 1 rank", BERT, dict(gpus=1), {}, {}, "none"),
    ("bert seq-cls ddp", BERT, dict(strategy="ddp"), {}, {}, "none"),
    ("bert seq-cls, 1 rank, fp32", BERT, dict(gpus=1, precision="fp32"), {}, {}, "full"),
    ("bert seq-cls fsdp-full, fp32", BERT, dict(strategy="fsdp-full", precision="fp32"), {}, {}, "none"),
    # a vision transformer (ViTForImageClassification, 64 px in 8 px patches: 65 tokens, 10 classes)
    ("vit image-cls, 1 rank, fp32", VIT, dict(gpus=1, precision="fp32", seq_len=None), {}, {}, "none"),
    ("vit image-cls, 1 rank", VIT, dict(gpus=1, seq_len=None), {}, {}, "none"),
    ("vit image-cls, 1 rank, fp32", VIT, dict(gpus=1, precision="fp32", seq_len=None), {}, {}, "full"),
    ("vit image-cls fsdp-full, fp32", VIT, dict(strategy="fsdp-full", precision="fp32", seq_len=None), {}, {},
     "none"),
    # session 37: vision-language models, images in the text sequence
    ("llava image-text, 1 rank, fp32", LLAVA, dict(gpus=1, precision="fp32"), {}, {}, "none"),
    ("llava image-text, 1 rank", LLAVA, dict(gpus=1), {}, {}, "none"),
    ("llava image-text, 1 rank, fp32", LLAVA, dict(gpus=1, precision="fp32"), {}, {}, "full"),
    ("llava image-text fsdp-full, fp32", LLAVA, dict(strategy="fsdp-full", precision="fp32"), {}, {}, "none"),
    ("llava image-text, 1 rank, fp32, 2 images", LLAVA, dict(gpus=1, precision="fp32", images=2), {}, {}, "none"),
    # the vision tower frozen (--freeze vision), as LLaVA's own fine-tuning freezes it
    ("llava image-text, 1 rank, frozen vision", LLAVA, dict(gpus=1, freeze="vision"), {}, {}, "none"),
    ("llava image-text ddp, frozen vision", LLAVA, dict(strategy="ddp", freeze="vision"), {}, {}, "none"),
    ("llava image-text zero2, frozen vision", LLAVA, dict(stage=2, freeze="vision"), SMALL_DS, {}, "none"),
    ("gemma3 image-text fsdp-full, frozen vision", GEMMA3_VL, dict(strategy="fsdp-full", freeze="vision"), {}, {},
     "none"),
    ("gemma3 image-text, 1 rank, fp32, frozen vision", GEMMA3_VL, dict(gpus=1, precision="fp32", freeze="vision"),
     {}, {}, "full"),
    ("gemma3 image-text, 1 rank, fp32, text only", GEMMA3_VL, dict(gpus=1, precision="fp32", images=0), {}, {},
     "none"),
    ("paligemma image-text, 1 rank, fp32", PALIGEMMA, dict(gpus=1, precision="fp32"), {}, {}, "none"),
    ("paligemma image-text, 1 rank", PALIGEMMA, dict(gpus=1), {}, {}, "full"),
    ("paligemma image-text fsdp-full, frozen vision", PALIGEMMA, dict(strategy="fsdp-full", freeze="vision"), {},
     {}, "none"),
    ("gemma3 image-text, 1 rank, fp32", GEMMA3_VL, dict(gpus=1, precision="fp32"), {}, {}, "none"),
    ("gemma3 image-text, 1 rank", GEMMA3_VL, dict(gpus=1), {}, {}, "none"),
    ("gemma3 image-text, 1 rank, fp32", GEMMA3_VL, dict(gpus=1, precision="fp32"), {}, {}, "full"),
    ("gemma3 image-text ddp, fp32", GEMMA3_VL, dict(strategy="ddp", precision="fp32"), {}, {}, "none"),
    ("gemma3 image-text zero3", GEMMA3_VL, dict(stage=3), SMALL_DS, {}, "none"),
    # session 40: Qwen-VL, images of any size (--image-size), their patches and grid as inputs
    ("qwen2.5-vl image-text, 1 rank, fp32", QWEN25_VL, dict(gpus=1, precision="fp32", **QWEN_IMG), {}, {}, "none"),
    ("qwen2.5-vl image-text, 1 rank", QWEN25_VL, dict(gpus=1, **QWEN_IMG), {}, {}, "none"),
    ("qwen2.5-vl image-text, 1 rank, fp32", QWEN25_VL, dict(gpus=1, precision="fp32", **QWEN_IMG), {}, {}, "full"),
    ("qwen2.5-vl image-text, 1 rank, fp32, 2 images", QWEN25_VL, dict(gpus=1, precision="fp32", images=2,
                                                                      **QWEN_IMG), {}, {}, "none"),
    ("qwen2.5-vl image-text ddp, frozen vision", QWEN25_VL, dict(strategy="ddp", freeze="vision", **QWEN_IMG), {},
     {}, "none"),
    ("qwen2.5-vl image-text zero3", QWEN25_VL, dict(stage=3, **QWEN_IMG), SMALL_DS, {}, "none"),
    ("qwen2.5-vl image-text fsdp-full, fp32", QWEN25_VL, dict(strategy="fsdp-full", precision="fp32", **QWEN_IMG),
     {}, {}, "none"),
    # FSDP's bf16 mixed precision: the pixels fed in fp32 (model.dtype), FSDP2 casting each unit's fp32 inputs (the
    # vision blocks' rotary cos and sin) to bf16
    ("qwen2.5-vl image-text fsdp-full", QWEN25_VL, dict(strategy="fsdp-full", **QWEN_IMG), {}, {}, "none"),
    ("qwen2.5-vl image-text fsdp-full, fsdp1", QWEN25_VL, dict(strategy="fsdp-full", fsdp_version=1, **QWEN_IMG), {},
     {}, "none"),
    ("qwen2.5-vl image-text fsdp-full", QWEN25_VL, dict(strategy="fsdp-full", **QWEN_IMG), {}, {}, "full"),
    ("qwen2-vl image-text, 1 rank, fp32", QWEN2_VL, dict(gpus=1, precision="fp32", **QWEN_IMG), {}, {}, "none"),
    ("qwen2-vl image-text, 1 rank", QWEN2_VL, dict(gpus=1, **QWEN_IMG), {}, {}, "full"),
    ("qwen3-vl image-text, 1 rank, fp32", QWEN3_VL, dict(gpus=1, precision="fp32", image_size=(128, 192)), {}, {},
     "none"),
    ("qwen3-vl image-text, 1 rank", QWEN3_VL, dict(gpus=1, image_size=(128, 192)), {}, {}, "none"),
    ("qwen3-vl-moe image-text, 1 rank, fp32", QWEN3_VL_MOE, dict(gpus=1, precision="fp32", image_size=(128, 192)),
     {}, {}, "none"),
    ("qwen3-vl-moe image-text, 1 rank", QWEN3_VL_MOE, dict(gpus=1, image_size=(128, 192)), {}, {}, "full"),
    ("qwen3-vl-moe image-text fsdp-full", QWEN3_VL_MOE, dict(strategy="fsdp-full", image_size=(128, 192)), {}, {},
     "none"),
    ("qwen3-vl image-text fsdp-full, frozen vision", QWEN3_VL, dict(strategy="fsdp-full", freeze="vision",
                                                                    image_size=(128, 192)), {}, {}, "none"),
    # session 43: Qwen3.5 and its MoE, patch-grid models as Qwen3-VL
    ("qwen3.5 image-text, 1 rank, fp32", QWEN35, dict(gpus=1, precision="fp32", image_size=(64, 64)), {}, {}, "none"),
    ("qwen3.5 image-text, 1 rank", QWEN35, dict(gpus=1, image_size=(64, 64)), {}, {}, "none"),
    ("qwen3.5 image-text fsdp-full, frozen vision", QWEN35, dict(strategy="fsdp-full", freeze="vision",
                                                                 image_size=(64, 64)), {}, {}, "none"),
    ("qwen3.5-moe image-text, 1 rank, fp32", QWEN35_MOE, dict(gpus=1, precision="fp32", image_size=(64, 64)), {}, {},
     "none"),
    # session 41: Mllama, its tiles read by the language model's cross-attention layers
    ("mllama image-text, 1 rank, fp32", MLLAMA, dict(gpus=1, precision="fp32"), {}, {}, "none"),
    ("mllama image-text, 1 rank", MLLAMA, dict(gpus=1), {}, {}, "none"),
    ("mllama image-text, 1 rank", MLLAMA, dict(gpus=1), {}, {}, "full"),
    ("mllama image-text ddp, frozen vision", MLLAMA, dict(strategy="ddp", freeze="vision"), {}, {}, "none"),
    ("mllama image-text, 1 rank, fp32, 2 images", MLLAMA, dict(gpus=1, precision="fp32", images=2), {}, {}, "none"),
    ("mllama image-text zero3", MLLAMA, dict(stage=3), SMALL_DS, {}, "none"),
    ("mllama image-text fsdp-full", MLLAMA, dict(strategy="fsdp-full"), {}, {}, "none"),
    # session 34: encoder-decoders, T5 (relative position bias learned through SDPA's mask) and BART
    ("t5 seq2seq, 1 rank, fp32, target 64", T5, dict(gpus=1, precision="fp32", target_len=64), {}, {}, "none"),
    ("t5 seq2seq, 1 rank, target 64", T5, dict(gpus=1, target_len=64), {}, {}, "none"),
    ("t5 seq2seq, 1 rank, fp32, target 64", T5, dict(gpus=1, precision="fp32", target_len=64), {}, {}, "full"),
    ("t5 seq2seq fsdp-full, fp32, target 64", T5, dict(strategy="fsdp-full", precision="fp32", target_len=64), {},
     {}, "none"),
    ("t5 seq2seq zero3, target 64", T5, dict(stage=3, target_len=64), SMALL_DS, {}, "none"),
    ("bart seq2seq, 1 rank, fp32, target 64", BART, dict(gpus=1, precision="fp32", target_len=64), {}, {}, "none"),
    ("bart seq2seq, 1 rank, target 64", BART, dict(gpus=1, target_len=64), {}, {}, "none"),
    ("bart seq2seq ddp, target 64", BART, dict(strategy="ddp", target_len=64), {}, {}, "none"),
    ("m2m100 seq2seq, 1 rank, fp32, target 64", M2M100, dict(gpus=1, precision="fp32", target_len=64), {}, {},
     "none"),
    ("m2m100 seq2seq, 1 rank, target 64", M2M100, dict(gpus=1, target_len=64), {}, {}, "none"),
    ("bart seq2seq, 1 rank, fp32, target 64", BART, dict(gpus=1, precision="fp32", target_len=64), {}, {}, "full"),
    # session 28: every schedule of torch.distributed.pipelining (memplan/parallel/schedules.py), at 2 and 4 stages
    ("fsdp-full pp 2 looped-bfs, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="looped-bfs")), {}, {}, "none"),
    ("fsdp-full pp 2 interleaved-zb, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="interleaved-zb")), {}, {}, "none"),
    ("fsdp-full pp 2 dualpipev, 4 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="dualpipev")), {}, {}, "none"),
    ("fsdp-full pp 2 dualpipev, 6 micro-batches", LLAMA4,
     dict(strategy="fsdp-full", grad_accum=6, parallel=Parallel(pp=2, schedule="dualpipev")), {}, {}, "none"),
    ("fsdp-full pp 4 1f1b, 4 micro-batches", LLAMA8,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(pp=4)), {}, {}, "none"),
    ("fsdp-full pp 4 interleaved, 8 micro-batches", LLAMA8,
     dict(strategy="fsdp-full", gpus=4, grad_accum=8, parallel=Parallel(pp=4, schedule="interleaved")), {}, {},
     "none"),
    ("fsdp-full pp 4 dualpipev, 8 micro-batches", LLAMA8,
     dict(strategy="fsdp-full", gpus=4, grad_accum=8, parallel=Parallel(pp=4, schedule="dualpipev")), {}, {},
     "none"),
    ("fsdp-full pp 2 interleaved, 4 micro-batches", LLAMA10,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="interleaved")), {}, {}, "none"),
    ("fsdp-full pp 2 looped-bfs, 4 micro-batches", LLAMA10,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="looped-bfs")), {}, {}, "none"),
    ("fsdp-full pp 2 zbv (zero bubble), 4 micro-batches", LLAMA10,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="zbv")), {}, {}, "none"),
    ("fsdp-full pp 2 interleaved-zb, 4 micro-batches", LLAMA10,
     dict(strategy="fsdp-full", grad_accum=4, parallel=Parallel(pp=2, schedule="interleaved-zb")), {}, {}, "none"),
    ("fsdp-full pp 2 dualpipev, 6 micro-batches", LLAMA10,
     dict(strategy="fsdp-full", grad_accum=6, parallel=Parallel(pp=2, schedule="dualpipev")), {}, {}, "none"),
    ("fsdp-full pp 4 1f1b, 8 micro-batches", LLAMA10,
     dict(strategy="fsdp-full", gpus=4, grad_accum=8, parallel=Parallel(pp=4)), {}, {}, "none"),
    ("fsdp-full pp 2 x dp 2 1f1b reshard after forward", LLAMA4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(pp=2)), {}, dict(reshard_after_forward=True),
     "none"),
    # session 20: expert parallelism as transformers' DistributedConfig(ep_size) runs it (AllToAllEP; the experts
    # FSDP2-sharded over efsdp = dp / ep, their own unit inside each block's)
    ("fsdp-full ep 2", MIXTRAL, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "none"),
    ("fsdp-full ep 2", MIXTRAL, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "full"),
    ("fsdp-full ep 2", MIXTRAL4, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "none"),
    ("fsdp-full ep 2 x efsdp 2, 4 ranks", MIXTRAL, dict(strategy="fsdp-full", gpus=4, parallel=Parallel(ep=2)), {}, {},
     "none"),
    ("fsdp-full ep 4, 4 ranks", MIXTRAL, dict(strategy="fsdp-full", gpus=4, parallel=Parallel(ep=4)), {}, {}, "none"),
    ("fsdp-full ep 2, fp32", MIXTRAL, dict(strategy="fsdp-full", precision="fp32", parallel=Parallel(ep=2)), {}, {},
     "none"),
    ("fsdp-full ep 2", DEEPSEEK, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "none"),
    ("fsdp-full ep 2", QWEN2_MOE, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "none"),
    ("fsdp-full ep 2", QWEN3_MOE, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "none"),
    *[("fsdp-full ep 2", m, dict(strategy="fsdp-full", parallel=Parallel(ep=2)), {}, {}, "none") for m in OTHER_MOE],
    # session 47: EP x PP as torchtitan runs it (each stage's experts over ep of its dp x tp ranks, FSDP2 over
    # efsdp, the experts units kept unsharded after forward as the blocks are under pipelining)
    ("fsdp-full ep 2 x pp 2 1f1b, 4 micro-batches", MIXTRAL4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(ep=2, pp=2)), {}, {}, "none"),
    ("fsdp-full ep 2 x pp 2 gpipe, 4 micro-batches", MIXTRAL4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(ep=2, pp=2, schedule="gpipe")), {}, {},
     "none"),
    ("fsdp-full ep 2 x efsdp 2 x pp 2 1f1b, 8 ranks", MIXTRAL4,
     dict(strategy="fsdp-full", gpus=8, grad_accum=4, parallel=Parallel(ep=2, pp=2)), {}, {}, "none"),
    ("fsdp-full ep 2 x pp 2 interleaved, 4 micro-batches", MIXTRAL6,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(ep=2, pp=2, schedule="interleaved")), {},
     {}, "none"),
    ("fsdp-full ep 2 x pp 2 1f1b, 4 micro-batches", QWEN2_MOE4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(ep=2, pp=2)), {}, {}, "none"),
    ("fsdp-full tp 2 x ep 2 x pp 2 1f1b, 4 micro-batches", QWEN3_MOE4,
     dict(strategy="fsdp-full", gpus=4, grad_accum=4, parallel=Parallel(tp=2, ep=2, pp=2)), {}, {}, "none"),
    # EP with TP on the attention (and the shared expert): ep a multiple of tp, experts over efsdp = dp x tp / ep
    ("fsdp-full tp 2 x ep 2", QWEN3_MOE, dict(strategy="fsdp-full", parallel=Parallel(tp=2, ep=2)), {}, {}, "none"),
    ("fsdp-full tp 2 x ep 2, 4 ranks", QWEN3_MOE, dict(strategy="fsdp-full", gpus=4, parallel=Parallel(tp=2, ep=2)),
     {}, {}, "none"),
    ("fsdp-full tp 2 x ep 4, 4 ranks", QWEN3_MOE, dict(strategy="fsdp-full", gpus=4, parallel=Parallel(tp=2, ep=4)),
     {}, {}, "none"),
    ("fsdp-full tp 2 x ep 2", QWEN2_MOE, dict(strategy="fsdp-full", parallel=Parallel(tp=2, ep=2)), {}, {}, "none"),
    # context parallelism: torch's context_parallel ring attention (harness/cp.py), sequence 1024 over the CP ranks
    ("fsdp-full cp 2, seq 1024", LLAMA_CP, dict(strategy="fsdp-full", seq_len=1024, parallel=Parallel(cp=2)), {}, {},
     "none"),
    ("fsdp-full cp 2, seq 1024", LLAMA_CP, dict(strategy="fsdp-full", seq_len=1024, parallel=Parallel(cp=2)), {}, {},
     "full"),
    ("fsdp-full cp 4, seq 1024, 4 ranks", LLAMA_CP,
     dict(strategy="fsdp-full", gpus=4, seq_len=1024, parallel=Parallel(cp=4)), {}, {}, "none"),
    ("fsdp-full cp 2 x dp 2, seq 1024, 4 ranks", LLAMA_CP,
     dict(strategy="fsdp-full", gpus=4, seq_len=1024, parallel=Parallel(cp=2)), {}, {}, "none"),
    ("fsdp-full cp 2, seq 1024, fp32", LLAMA_CP,
     dict(strategy="fsdp-full", precision="fp32", seq_len=1024, parallel=Parallel(cp=2)), {}, {}, "none"),
    ("fsdp-full cp 2, seq 1024, GQA", LLAMA3,
     dict(strategy="fsdp-full", seq_len=1024, parallel=Parallel(cp=2)), {}, {}, "none"),
    ("ddp cp 2, seq 1024, torch-amp", LLAMA_CP, dict(strategy="ddp", seq_len=1024, parallel=Parallel(cp=2)), {}, {},
     "none"),
    # session 23: FSDP2's root given the blocks' reshard_after_forward (Accelerate's call, --fsdp-root-reshard
    # same): resharded after the loss and gathered again at backward's first hook, its all-gather output beside
    # its copies; against a bare fully_shard(model) (auto). A 32,000-row vocabulary makes the root the largest unit
    ("fsdp-full root same, seq 64, torch-amp", LLAMA_BIGVOCAB,
     dict(strategy="fsdp-full", precision="torch-amp", seq_len=64), {}, dict(fsdp_root_reshard="same"), "none"),
    ("fsdp-full root auto, seq 64, torch-amp", LLAMA_BIGVOCAB,
     dict(strategy="fsdp-full", precision="torch-amp", seq_len=64), {}, dict(fsdp_root_reshard="auto"), "none"),
    # session 35: torch.compile of each block (--compile blocks; the harness compiles them with inductor's C++
    # kernels): inductor's partitioner and fusion rules on the trace; under DDP dynamo's DDPOptimizer splits
    ("compile blocks, one rank", LLAMA, dict(gpus=1, compile="blocks"), {}, {}, "none"),
    ("compile blocks, one rank", LLAMA, dict(gpus=1, compile="blocks"), {}, {}, "full"),
    ("compile blocks, one rank, pure-bf16", LLAMA, dict(gpus=1, compile="blocks", precision="pure-bf16"), {}, {},
     "none"),
    ("compile blocks, one rank", GPT2, dict(gpus=1, compile="blocks"), {}, {}, "none"),
    ("compile blocks, one rank", MIXTRAL, dict(gpus=1, compile="blocks"), {}, {}, "none"),
    ("ddp, compile blocks", LLAMA, dict(strategy="ddp", compile="blocks"), {}, {}, "none"),
    ("ddp, compile blocks", LLAMA, dict(strategy="ddp", compile="blocks"), {}, {}, "full"),
    ("fsdp-full, compile blocks", LLAMA, dict(strategy="fsdp-full", compile="blocks"), {}, {}, "none"),
    ("fsdp-full, compile blocks", LLAMA, dict(strategy="fsdp-full", compile="blocks"), {}, {}, "full"),
    ("fsdp-full, compile blocks, pure-bf16", GPT2,
     dict(strategy="fsdp-full", compile="blocks", precision="pure-bf16"), {}, {}, "none"),
    # at sequence 512 the activations, not the optimizer step, make the peak
    ("compile blocks, one rank, seq 512", LLAMA, dict(gpus=1, compile="blocks", seq_len=512), {}, {}, "full"),
    ("compile blocks, one rank, seq 512", MIXTRAL, dict(gpus=1, compile="blocks", seq_len=512), {}, {}, "none"),
    ("ddp, compile blocks, seq 512", LLAMA, dict(strategy="ddp", compile="blocks", seq_len=512), {}, {}, "full"),
    ("fsdp-full, compile blocks, seq 512", LLAMA, dict(strategy="fsdp-full", compile="blocks", seq_len=512), {}, {},
     "full"),
    # session 36: float8 training, torchao's Float8Linear (--precision fp8-*; the harness runs torchao 0.18 on the
    # CPU: torch._scaled_mm's emulation, whose scratch the CPU target models)
    ("fp8-tensorwise, one rank", LLAMA, dict(gpus=1, precision="fp8-tensorwise"), {}, {}, "none"),
    ("fp8-tensorwise, one rank", LLAMA, dict(gpus=1, precision="fp8-tensorwise"), {}, {}, "full"),
    ("fp8-rowwise, one rank", LLAMA3, dict(gpus=1, precision="fp8-rowwise"), {}, {}, "none"),
    ("fp8-rowwise, one rank", MIXTRAL, dict(gpus=1, precision="fp8-rowwise"), {}, {}, "none"),
    ("ddp, fp8-tensorwise", LLAMA, dict(strategy="ddp", precision="fp8-tensorwise"), {}, {}, "none"),
    ("ddp, fp8-rowwise", LLAMA3, dict(strategy="ddp", precision="fp8-rowwise"), {}, {}, "full"),
    ("fsdp-full, fp8-rowwise", LLAMA, dict(strategy="fsdp-full", precision="fp8-rowwise"), {}, {}, "none"),
    ("fsdp-full, fp8-rowwise", LLAMA, dict(strategy="fsdp-full", precision="fp8-rowwise"), {}, {}, "full"),
    ("fsdp-full, fp8-rowwise-gw-hp", LLAMA3, dict(strategy="fsdp-full", precision="fp8-rowwise-gw-hp"), {}, {},
     "none"),
    ("fsdp-full, fp8-tensorwise", LLAMA4, dict(strategy="fsdp-full", precision="fp8-tensorwise"), {}, {}, "none"),
    ("fp8-tensorwise, compile blocks, one rank", LLAMA, dict(gpus=1, precision="fp8-tensorwise", compile="blocks"),
     {}, {}, "none"),
    ("fsdp-full, fp8-rowwise, compile blocks", LLAMA,
     dict(strategy="fsdp-full", precision="fp8-rowwise", compile="blocks"), {}, {}, "full"),
    # float8 inside compiled blocks where the backward makes the peak (sequence 512)
    ("fp8-rowwise, compile blocks, one rank, seq 512", LLAMA,
     dict(gpus=1, precision="fp8-rowwise", compile="blocks", seq_len=512), {}, {}, "none"),
    ("ddp, fp8-rowwise, compile blocks, seq 512", LLAMA,
     dict(strategy="ddp", precision="fp8-rowwise", compile="blocks", seq_len=512), {}, {}, "full"),
    ("fsdp-full, fp8-tensorwise, compile blocks, seq 512", LLAMA,
     dict(strategy="fsdp-full", precision="fp8-tensorwise", compile="blocks", seq_len=512), {}, {}, "none"),
    # Accelerate's torchao backend (mixed_precision fp8): the first and last linears kept, on the job's own recipe
    ("float8 tensorwise first-last, one rank", LLAMA,
     dict(gpus=1, precision="torch-amp", float8="tensorwise", float8_keep="first-last"), {}, {}, "none"),
    # gradient_as_bucket_view: the buckets are the gradients (frameworks/ddp.py whole_step_grads); under gradient
    # accumulation the peak is lower than without it (the kept gradients are the buckets)
    ("ddp gradient_as_bucket_view", LLAMA, dict(strategy="ddp"), {}, dict(gradient_as_bucket_view=True), "none"),
    ("ddp gradient_as_bucket_view, seq 16, 2 micro-batches", LLAMA, dict(strategy="ddp", seq_len=16, grad_accum=2),
     {}, dict(gradient_as_bucket_view=True), "none"),
    ("ddp, seq 16, 2 micro-batches", LLAMA, dict(strategy="ddp", seq_len=16, grad_accum=2), {}, {}, "none"),
    ("ddp, float8 tensorwise first-last, bf16-autocast", LLAMA,
     dict(strategy="ddp", precision="bf16-autocast", float8="tensorwise", float8_keep="first-last"), {}, {}, "full"),
    ("fsdp-full, float8 rowwise, pure-bf16", LLAMA, dict(strategy="fsdp-full", precision="pure-bf16",
                                                        float8="rowwise"), {}, {}, "full"),
    # FSDP2's float8 all-gather (--float8-all-gather: torchao's enable_fsdp_float8_all_gather)
    ("fsdp-full, fp8-tensorwise, float8 all-gather", LLAMA,
     dict(strategy="fsdp-full", precision="fp8-tensorwise", float8_all_gather=True), {}, {}, "none"),
    ("fsdp-full, fp8-tensorwise, float8 all-gather", LLAMA,
     dict(strategy="fsdp-full", precision="fp8-tensorwise", float8_all_gather=True), {}, {}, "full"),
    ("fsdp-full, fp8-tensorwise, float8 all-gather", LLAMA4,
     dict(strategy="fsdp-full", precision="fp8-tensorwise", float8_all_gather=True), {}, {}, "none"),
    ("fsdp-grad-op, fp8-tensorwise, float8 all-gather", LLAMA3,
     dict(strategy="fsdp-grad-op", precision="fp8-tensorwise", float8_all_gather=True), {}, {}, "none"),
    ("fsdp-full, fp8-tensorwise, float8 all-gather, compile blocks", LLAMA,
     dict(strategy="fsdp-full", precision="fp8-tensorwise", float8_all_gather=True, compile="blocks"), {}, {},
     "none"),
    ("fsdp-full, fp8-tensorwise, float8 all-gather, compile blocks, seq 512", LLAMA,
     dict(strategy="fsdp-full", precision="fp8-tensorwise", float8_all_gather=True, compile="blocks", seq_len=512),
     {}, {}, "none"),
    # other families under FSDP2 with float8: an encoder classifier, a ViT, an encoder-decoder, an MoE
    ("fsdp-full, fp8-rowwise", BERT, dict(strategy="fsdp-full", precision="fp8-rowwise"), {}, {}, "none"),
    ("fsdp-full, fp8-tensorwise", VIT, dict(strategy="fsdp-full", precision="fp8-tensorwise", seq_len=None), {}, {},
     "none"),
    ("fsdp-full, fp8-rowwise", T5, dict(strategy="fsdp-full", precision="fp8-rowwise"), {}, {}, "none"),
    ("fsdp-full, fp8-rowwise", QWEN3_MOE, dict(strategy="fsdp-full", precision="fp8-rowwise"), {}, {}, "none"),
    # session 39: DeepSpeed ZeRO-1/2 under gradient accumulation (the harness now calls engine.step() after every
    # backward, as DeepSpeed's loop does): ZeRO-1's bucket kept across micro-steps, ZeRO-2's second
    # grads_in_partition, the step as one micro-step's
    ("zero1 small buckets, grad-accum 2", LLAMA, dict(stage=1, grad_accum=2), SMALL_DS, {}, "full"),
    ("zero1 small buckets, grad-accum 2", LLAMA, dict(stage=1, grad_accum=2), SMALL_DS, {}, "none"),
    ("zero2 small buckets, grad-accum 2", LLAMA, dict(stage=2, grad_accum=2), SMALL_DS, {}, "full"),
    ("zero2 small buckets, grad-accum 4", LLAMA, dict(stage=2, grad_accum=4), SMALL_DS, {}, "none"),
    ("zero1, grad-accum 2", LLAMA, dict(stage=1, grad_accum=2), {}, {}, "full"),
    ("zero2 overlap_comm, grad-accum 2", LLAMA, dict(stage=2, grad_accum=2), dict(overlap_comm=True), {}, "none"),
    ("zero1 + offload optimizer, small buckets, grad-accum 2", LLAMA, dict(stage=1, grad_accum=2, offload_optimizer=True),
     SMALL_DS, {}, "none"),
    ("zero2 + offload optimizer, small buckets, grad-accum 2", LLAMA, dict(stage=2, grad_accum=2, offload_optimizer=True),
     SMALL_DS, {}, "none"),
    ("zero3 small buckets, grad-accum 2", LLAMA, dict(stage=3, grad_accum=2), SMALL_DS, {}, "full"),
    ("zero3 + offload optimizer, small buckets, grad-accum 2", LLAMA, dict(stage=3, grad_accum=2, offload_optimizer=True),
     SMALL_DS, {}, "none"),
    # session 48: Longformer and LED (sliding-window attention over chunks of the window; a sequence classifier's
    # CLS attends globally), sequences of two windows
    ("longformer masked-lm, 1 rank, fp32, seq 1024", LONGFORMER, dict(gpus=1, precision="fp32", seq_len=1024), {},
     {}, "none"),
    ("longformer masked-lm, 1 rank, seq 1024", LONGFORMER, dict(gpus=1, seq_len=1024), {}, {}, "none"),
    ("longformer masked-lm, 1 rank, fp32, seq 1024", LONGFORMER, dict(gpus=1, precision="fp32", seq_len=1024), {},
     {}, "full"),
    ("longformer masked-lm, 1 rank, fp32, seq 300 (padded to the window)", LONGFORMER,
     dict(gpus=1, precision="fp32", seq_len=300), {}, {}, "none"),
    ("longformer seq-cls (global CLS), 1 rank, fp32, seq 1024", LONGFORMER,
     dict(gpus=1, precision="fp32", seq_len=1024, task="sequence-classification"), {}, {}, "none"),
    ("longformer masked-lm ddp, seq 1024", LONGFORMER, dict(strategy="ddp", seq_len=1024), {}, {}, "none"),
    ("led seq2seq, 1 rank, fp32, seq 1024, target 64", LED, dict(gpus=1, precision="fp32", seq_len=1024,
                                                                 target_len=64), {}, {}, "none"),
    ("led seq2seq, 1 rank, seq 1024, target 64", LED, dict(gpus=1, seq_len=1024, target_len=64), {}, {}, "none"),
]
QUICK = [CASES[5], CASES[11]]


def lora_cases() -> list[tuple]:
    """LoRA fine-tuning (PEFT's get_peft_model in the harness): frozen base weights, adapters trained; to
    docs/accuracy-lora.md (session 13)."""
    from dataclasses import replace

    from memplan.model.lora import LoraSpec

    qv = LoraSpec(rank=16, targets=("q_proj", "v_proj"))
    lin = LoraSpec(rank=16, targets="all-linear")
    return [
        ("lora q,v single", LLAMA3, dict(strategy="single", gpus=1, lora=qv), {}, {}, "none"),
        ("lora q,v ddp", LLAMA3, dict(strategy="ddp", lora=qv), {}, {}, "none"),
        ("lora all-linear ddp", LLAMA3, dict(strategy="ddp", lora=lin), {}, {}, "none"),
        ("lora all-linear ddp", LLAMA3, dict(strategy="ddp", lora=lin), {}, {}, "full"),
        ("lora all-linear ddp, pure-bf16", LLAMA3, dict(strategy="ddp", precision="pure-bf16",
                                                        lora=LoraSpec(rank=16, targets="all-linear")), {}, {}, "none"),
        ("lora q,v dropout 0.1 ddp", LLAMA3, dict(strategy="ddp", lora=LoraSpec(rank=16, targets=("q_proj", "v_proj"),
                                                                                dropout=0.1)), {}, {}, "none"),
        ("lora q,v fsdp-full", LLAMA3, dict(strategy="fsdp-full", lora=qv), {}, {}, "none"),
        ("lora all-linear fsdp-full", LLAMA3, dict(strategy="fsdp-full", lora=lin), {}, {}, "none"),
        ("lora q,v fsdp-full, 4 ranks", LLAMA3, dict(strategy="fsdp-full", gpus=4, lora=qv), {}, {}, "full"),
        ("lora all-linear fsdp-grad-op", LLAMA3, dict(strategy="fsdp-grad-op", lora=lin), {}, {}, "none"),
        ("lora all-linear zero1", LLAMA3, dict(stage=1, lora=lin), {}, {}, "none"),
        ("lora all-linear zero2 small buckets", LLAMA3, dict(stage=2, lora=lin), SMALL_DS, {}, "none"),
        ("lora q,v zero3", LLAMA3, dict(stage=3, lora=qv), {}, {}, "none"),
        ("lora all-linear zero3 small buckets", LLAMA3, dict(stage=3, lora=lin), SMALL_DS, {}, "full"),
        ("lora all-linear, bias all, ddp", GPT2, dict(strategy="ddp", lora=LoraSpec(rank=8, targets="all-linear",
                                                                                    bias="all")), {}, {}, "none"),
        ("lora c_attn fsdp-full", GPT2, dict(strategy="fsdp-full", lora=LoraSpec(rank=8)), {}, {}, "full"),
        ("lora q,k,v,o fsdp-full", MIXTRAL, dict(strategy="fsdp-full", lora=LoraSpec(
            rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))), {}, {}, "none"),
        ("lora q,v + lm_head saved, ddp", LLAMA3, dict(strategy="ddp", lora=LoraSpec(
            rank=8, targets=("q_proj", "v_proj"), modules_to_save=("lm_head",))), {}, {}, "none"),
        # QLoRA: bitsandbytes 0.50's 4-bit base, quantized on the CPU (session 14)
        ("qlora nf4 dq q,v single", LLAMA3, dict(strategy="single", gpus=1, lora=replace(qv, quantize="nf4",
                                                                                      double_quant=True)),
         {}, {}, "none"),
        ("qlora nf4 dq all-linear single", LLAMA3, dict(strategy="single", gpus=1, lora=replace(
            lin, quantize="nf4", double_quant=True)), {}, {}, "full"),
        ("qlora nf4 q,v ddp", LLAMA3, dict(strategy="ddp", lora=replace(qv, quantize="nf4")), {}, {}, "none"),
        ("qlora fp4 all-linear ddp", LLAMA3, dict(strategy="ddp", lora=replace(lin, quantize="fp4")), {}, {},
         "none"),
        ("qlora nf4 dq q,v single, fp32 compute", LLAMA3, dict(strategy="single", gpus=1, lora=replace(
            qv, quantize="nf4", double_quant=True, compute_dtype="float32")), {}, {}, "none"),
        ("qlora nf4 dq all-linear zero2", LLAMA3, dict(stage=2, lora=replace(lin, quantize="nf4",
                                                                             double_quant=True)), {}, {}, "none"),
        ("qlora nf4 dq q,v single, pure-bf16", LLAMA3, dict(strategy="single", gpus=1, precision="pure-bf16",
                                                             lora=replace(qv, quantize="nf4", double_quant=True)),
         {}, {}, "none"),
        # FSDP-QLoRA (session 32): the 4-bit codes packed into a float bnb_4bit_quant_storage, sharded by FSDP2 as
        # frozen parameters, each QuantState whole; a uint8 storage kept whole (Accelerate's ignored_params)
        ("qlora nf4 dq all-linear fsdp-full, fp32 storage, torch-amp", LLAMA3, dict(
            strategy="fsdp-full", precision="torch-amp", lora=replace(lin, quantize="nf4", double_quant=True,
                                                                      quant_storage="float32")), {}, {}, "none"),
        ("qlora nf4 dq all-linear fsdp-full, fp32 storage, torch-amp", LLAMA3, dict(
            strategy="fsdp-full", precision="torch-amp", lora=replace(lin, quantize="nf4", double_quant=True,
                                                                      quant_storage="float32")), {}, {}, "full"),
        ("qlora nf4 dq all-linear fsdp-full, fp32 storage, torch-amp, 4 ranks", LLAMA3, dict(
            strategy="fsdp-full", gpus=4, precision="torch-amp",
            lora=replace(lin, quantize="nf4", double_quant=True, quant_storage="float32")), {}, {}, "none"),
        ("qlora nf4 dq all-linear fsdp-full, uint8 kept whole, torch-amp", LLAMA3, dict(
            strategy="fsdp-full", precision="torch-amp", lora=replace(lin, quantize="nf4", double_quant=True)),
         {}, {}, "none"),
        ("qlora nf4 q,v fsdp-grad-op, fp32 storage, fp32", LLAMA3, dict(
            strategy="fsdp-grad-op", precision="fp32", lora=replace(qv, quantize="nf4", quant_storage="float32")),
         {}, {}, "none"),
        ("qlora nf4 q,v fsdp-full, bf16 storage, pure-bf16", LLAMA3, dict(
            strategy="fsdp-full", precision="pure-bf16", lora=replace(qv, quantize="nf4", quant_storage="bfloat16")),
         {}, {}, "none"),
        # ZeRO-3 QLoRA (session 32): DeepSpeed partitions the float-packed 4-bit parameters, QuantStates whole
        ("qlora nf4 dq all-linear zero3, bf16 storage", LLAMA3, dict(
            stage=3, lora=replace(lin, quantize="nf4", double_quant=True, quant_storage="bfloat16")), {}, {}, "none"),
        ("qlora nf4 q,v zero3 small buckets, bf16 storage", LLAMA3, dict(
            stage=3, lora=replace(qv, quantize="nf4", quant_storage="bfloat16")), SMALL_DS, {}, "full"),
        ("lora q,v single, pure-bf16", LLAMA3, dict(strategy="single", gpus=1, precision="pure-bf16", lora=qv), {},
         {}, "full"),
        ("qlora nf4 c_attn single", GPT2, dict(strategy="single", gpus=1, lora=LoraSpec(rank=8, quantize="nf4")),
         {}, {}, "full"),
        # session 38: FSDP1 under PEFT's units (each adapter its own FlatParameter, as the HF Trainer wraps it)
        ("lora q,v fsdp1 full, fp32", LLAMA3, dict(strategy="fsdp-full", precision="fp32", lora=qv), {},
         dict(fsdp_version=1), "none"),
        ("lora all-linear fsdp1 full, pure-bf16", LLAMA3, dict(strategy="fsdp-full", precision="pure-bf16", lora=lin),
         {}, dict(fsdp_version=1), "none"),
        ("lora all-linear fsdp1 full, pure-bf16", LLAMA3, dict(strategy="fsdp-full", precision="pure-bf16", lora=lin),
         {}, dict(fsdp_version=1), "full"),
        ("lora q,v fsdp1 grad-op, fp32, 4 blocks", LLAMA3_4, dict(strategy="fsdp-grad-op", precision="fp32", lora=qv),
         {}, dict(fsdp_version=1), "none"),
        ("lora q,v fsdp1 full, fp32, 4 blocks", LLAMA3_4, dict(strategy="fsdp-full", precision="fp32", lora=qv),
         {}, dict(fsdp_version=1), "none"),
        ("qlora nf4 dq all-linear fsdp1 full, bf16 storage, pure-bf16", LLAMA3, dict(
            strategy="fsdp-full", precision="pure-bf16", lora=replace(lin, quantize="nf4", double_quant=True,
                                                                      quant_storage="bfloat16")),
         {}, dict(fsdp_version=1), "none"),
        # session 35: LoRA with each block compiled (--compile blocks)
        ("lora q,v single, compile blocks", LLAMA3, dict(strategy="single", gpus=1, compile="blocks", lora=qv), {}, {},
         "none"),
        ("lora all-linear ddp, compile blocks", LLAMA3, dict(strategy="ddp", compile="blocks", lora=lin), {}, {},
         "none"),
        ("lora all-linear fsdp-full, compile blocks", LLAMA3, dict(strategy="fsdp-full", compile="blocks", lora=lin),
         {}, {}, "none"),
        # session 39: LoRA on transformers 5's fused experts (PEFT's conversion to target_parameters: lora.ParamWrapper
        # folds the adapters into a copy of each expert stack every forward); measured again with PEFT 0.22 (session
        # 44), which converts Qwen2-MoE too and keeps linear targets as modules
        ("lora all-linear single, fused experts", MIXTRAL, dict(strategy="single", gpus=1, lora=lin), {}, {}, "none"),
        ("lora all-linear single, fused experts", MIXTRAL, dict(strategy="single", gpus=1, lora=lin), {}, {}, "full"),
        ("lora all-linear ddp, fused experts, pure-bf16", MIXTRAL, dict(strategy="ddp", precision="pure-bf16",
                                                                        lora=lin), {}, {}, "none"),
        ("lora q,v,w1,w2,w3 zero2, fused experts", MIXTRAL, dict(stage=2, lora=LoraSpec(
            rank=16, targets=("q_proj", "v_proj", "w1", "w2", "w3"))), {}, {}, "none"),
        ("lora all-linear fsdp-full, fused experts", MIXTRAL, dict(strategy="fsdp-full", lora=lin), {}, {}, "none"),
        ("lora all-linear fsdp-full, fused experts, pure-bf16", MIXTRAL, dict(strategy="fsdp-full",
                                                                             precision="pure-bf16", lora=lin), {},
         {}, "none"),
        ("lora all-linear zero3, fused experts", MIXTRAL, dict(stage=3, lora=lin), {}, {}, "none"),
        ("lora all-linear single, fused experts", QWEN3_MOE, dict(strategy="single", gpus=1, lora=lin), {}, {},
         "none"),
        ("lora all-linear single, fused experts", QWEN2_MOE, dict(strategy="single", gpus=1, lora=lin), {}, {},
         "none"),
        # session 39: found by a gradient-accumulation probe, the same at ga 1: over (see the note)
        ("lora all-linear zero3 small buckets", LLAMA3, dict(stage=3, lora=lin), SMALL_DS, {}, "none"),
        ("qlora nf4 all-linear single, fused experts", MIXTRAL, dict(strategy="single", gpus=1,
                                                                     lora=replace(lin, quantize="nf4")), {}, {},
         "none"),
        # session 40: Qwen2.5-VL (the vision tower's linears adapted too under all-linear)
        ("lora q,v single, qwen2.5-vl", QWEN25_VL, dict(strategy="single", gpus=1, lora=qv, **QWEN_IMG), {}, {},
         "none"),
        ("lora all-linear single, qwen2.5-vl", QWEN25_VL, dict(strategy="single", gpus=1, lora=lin, **QWEN_IMG), {},
         {}, "none"),
        ("lora all-linear fsdp-full, qwen2.5-vl", QWEN25_VL, dict(strategy="fsdp-full", lora=lin, **QWEN_IMG), {}, {},
         "none"),
    ]

# The cross product the harness issue asks for: every strategy at 1, 2 and 4 ranks, with and without full
# recompute, under two recipes each, on a GQA llama (untied head) and gpt2 (tied embeddings). Strategies that
# need several shard groups run at 4 ranks only.
CROSS_STRATEGIES = [
    # (label, strategy kwargs, ds overrides, torch overrides, rank counts)
    ("ddp", dict(strategy="ddp"), {}, {}, (1, 2, 4)),
    ("zero-optimizer", dict(strategy="zero-optimizer"), {}, {}, (1, 2, 4)),
    ("zero1 small buckets", dict(stage=1), SMALL_DS, {}, (1, 2, 4)),
    ("zero2 small buckets", dict(stage=2), SMALL_DS, {}, (1, 2, 4)),
    ("zero3 small buckets", dict(stage=3), SMALL_DS, {}, (1, 2, 4)),
    ("zero3 defaults", dict(stage=3), {}, {}, (1, 2, 4)),
    ("fsdp-full", dict(strategy="fsdp-full"), {}, {}, (1, 2, 4)),
    # after the first cross run (session 6): ZeRO-Offload, which runs on CPU too
    ("zero3 + offload optimizer", dict(stage=3), dict(SMALL_DS, offload_optimizer=True), {}, (1, 2, 4)),
    ("fsdp-grad-op", dict(strategy="fsdp-grad-op"), {}, {}, (1, 2, 4)),
    ("hsdp 2 x 2", dict(strategy="hsdp"), {}, dict(hsdp_shard_size=2), (4,)),
    ("fsdp-full reshard 2 (hpZ-like)", dict(strategy="fsdp-full"), {}, dict(reshard_after_forward=2), (4,)),
]
CROSS_RECIPES = {"deepspeed": ("deepspeed-bf16", "deepspeed-fp16"), "torch-ddp": ("torch-amp", "fp32"),
                 "fsdp": ("fsdp-bf16", "fp32")}


def cross_cases() -> list[tuple]:
    out = []
    for label, strat, ds, tk, ranks in CROSS_STRATEGIES:
        fw = ("deepspeed" if "stage" in strat else "torch-ddp" if strat["strategy"] in ("ddp", "zero-optimizer")
              else "fsdp")
        for model in (LLAMA3, GPT2):
            for gpus in ranks:
                for rc in ("none", "full"):
                    for recipe in CROSS_RECIPES[fw]:
                        out.append((f"{label}, {recipe}, {gpus} rank{'s' if gpus > 1 else ''}", model,
                                    dict(strat, gpus=gpus, precision=recipe), ds, tk, rc))
    return out


def _row(label: str, shown: str, rc: str, plan, ranks, old=None) -> list:  # noqa: ANN001
    """A table row from a prediction and what the ranks measured; ``old``: a stored row without the ranks'
    data (written before they were kept), re-predicted against its measured peak (model states unchanged)."""
    from memplan.harness import compare as cmp

    if ranks:
        c = cmp.compare(plan, tuple(ranks), 0.03)
        exact = all(x["predicted"] == x["measured"] for x in c.categories.values())
        return [label, shown, rc, c.predicted_peak_bytes, c.measured_peak_bytes, c.peak_error, c.spread, exact,
                f"{c.predicted_peak_phase}/{c.measured_peak_phase}", list(ranks)]
    phase = cmp.MEASURED_PHASE.get(plan.peak.name, plan.peak.name)
    predicted, measured = plan.peak_bytes + sum(cmp.measured_host(plan).values()), old[4]
    return [label, shown, rc, predicted, measured, (predicted - measured) / measured, old[6], old[7],
            f"{phase}/{old[8].split('/')[1]}", None]


def main() -> None:
    from memplan.errors import MemplanError
    from memplan.request import JobRequest
    from memplan.validation import predict, validate

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cross", action="store_true", help="the full cross product, to docs/accuracy-cross.md")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in the .jsonl, run the rest")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: predict again with this code against the measurements kept in the .jsonl")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--cpu-isa", default=None,
                    help="the instruction set the CPU kernels follow (memplan.activations.kernels.CPU_ISAS): for --repredict, "
                         "that of the machine the kept measurements came from (they were made on AVX512 CPUs "
                         "without bf16 instructions: the default); for runs, this machine's")
    ap.add_argument("--lora", action="store_true", help="the LoRA cases (PEFT), to docs/accuracy-lora.md")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "docs" / ("accuracy-cross.md" if args.cross else
                                                "accuracy-lora.md" if args.lora else "accuracy.md"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from memplan.activations.kernels import host_cpu_isa

    args.cpu_isa = args.cpu_isa or ("avx512" if args.repredict else host_cpu_isa())
    cases = cross_cases() if args.cross else lora_cases() if args.lora else QUICK if args.quick else CASES
    keys = [(c[0], c[1][0], c[1][1]["layers"], c[5]) for c in cases]
    assert len(set(keys)) == len(keys), "two cases share a label, model and recompute: rows would be confused"
    # every finished row goes to a .jsonl beside the output, with what each rank measured: a long run that is
    # cut off can --resume, and a changed engine can --repredict without running the frameworks again
    log = Path(args.out).with_suffix(".jsonl")
    done = {}
    if (args.resume or args.repredict) and log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            done[(r[0], r[1], r[2])] = r
    elif log.exists():
        log.unlink()
    rows, errors, kept = [], {}, []
    for i, (label, (model, scale), strat, ds, tk, rc) in enumerate(cases, 1):
        t = time.perf_counter()
        strat = dict(strat)
        gpus = strat.pop("gpus", args.gpus)
        shown = f"{model}, {scale['layers']} blocks" if scale["layers"] else f"{model}, as given"
        # the harness's FSDP2 root as the kept rows measured it: fully_shard(model) without reshard_after_forward
        # (--fsdp-root-reshard auto; memplan's default, same, is Accelerate's call, measured on the GPU)
        kw = dict(gpus=gpus, gpus_per_node=gpus, micro_batch=2, seq_len=strat.pop("seq_len", 128), recompute=rc,
                  **ds, **{"fsdp_root_reshard": "auto", **tk}, **strat)
        row = done.get((label, shown, rc))
        if args.repredict:
            if row is None or row[3] is None:
                continue  # never run (or failed): nothing measured to compare with
            # a row measured on another instruction set than the table's is predicted with its own (index 10)
            isa = row[10] if len(row) > 10 else args.cpu_isa
            plan = predict(model, JobRequest.of(device="cpu", cpu_isa=isa, **kw), **scale)[0]
            row = _row(label, shown, rc, plan, row[9] if len(row) > 9 else None, old=row) + (
                [isa] if len(row) > 10 else [])
        elif row is None:
            try:
                v = validate(model, JobRequest.of(device="cpu", cpu_isa=args.cpu_isa, **kw), **scale)
            except MemplanError as exc:
                row = [label, shown, rc, None, None, None, None, None, str(exc), None]
            else:
                row = _row(label, shown, rc, v.plan, v.ranks) + [args.cpu_isa]
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)
        kept.append(row)
        if row[3] is not None:
            errors.setdefault(label.split()[0].rstrip(","), []).append(row[5])
        err = "failed" if row[3] is None else f"{100 * row[5]:+.2f}%"
        print(f"[{i}/{len(cases)}] {label:30} {shown:22} recompute {rc:4}: error {err} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    if args.repredict:
        log.write_text("".join(json.dumps(r) + "\n" for r in kept))
    write(args, rows, errors)


def _cpu_name() -> str:
    """This machine's CPU model and the ATen capability, for the table's header."""
    name = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"predicted on {name}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}"


def _other_isas(args, rows) -> str:  # noqa: ANN001
    """The rows measured (and so predicted) on another instruction set than the table's, named."""
    other: dict[str, list[str]] = {}
    for r in rows:
        if len(r) > 10 and r[10] != args.cpu_isa:
            other.setdefault(r[10], []).append(f"{r[0]} ({r[1]}, {r[2]})")
    return "".join(f" Measured on {isa} and predicted with `--cpu-isa {isa}`: {'; '.join(names)}."
                   for isa, names in sorted(other.items()))


def write(args, rows, errors) -> None:  # noqa: ANN001
    import platform

    import torch
    import transformers

    try:
        import deepspeed

        dsv = deepspeed.__version__
    except Exception:  # pragma: no cover
        dsv = "not installed"
    lines = [
        "# Accuracy: memplan's prediction against real runs",
        "",
        f"Produced by `python bench/accuracy.py"
        f"{' --quick' if args.quick else ' --cross' if args.cross else ' --lora' if args.lora else ''}"
        f"{' --repredict' if args.repredict else ''}` on {platform.machine()} "
        f"({os.cpu_count()} cores), CPU only: {args.gpus} gloo ranks spawned on one host, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, deepspeed {dsv} (cases marked 1 or 4 ranks use that many). Each "
        "model is scaled down (2 or 4 blocks, hidden 256 or 512, vocabulary 2048) and predicted for exactly that config; micro-batch 2, sequence 128, "
        "2 warm-up steps then 1 measured step. FSDP2's and FSDP1's all-gathers and reduce-scatters run as in-place "
        "all-reduces on gloo (memplan/harness/gloo.py `collectives_in_place`, `flat_collectives_in_place`: "
        "gloo's own temporaries, which NCCL does not allocate, are left out). The predictions are for `--device cpu`: "
        "no CUDA overheads, CPU dropout masks, and the scratch CPU bf16 GEMMs allocate on the measuring CPU's "
        f"instruction set, `--cpu-isa {args.cpu_isa}` (memplan/activations/kernels.py `cpu_gemm_scratch`; "
        f"{_cpu_name()}). Measured = the CPU allocator's live bytes from the profiler's "
        "memory events (see memplan/harness/measure.py); worst rank. Error = (predicted - measured) / measured; "
        "a negative error is an under-estimate." + _other_isas(args, rows) + (
            " --repredict: the predictions are this code's, the measurements those kept in the .jsonl beside this "
            "file from the run that made them (rows kept without the ranks' data keep their model-state check)."
            if args.repredict else ""),
        "",
        "| case | model | recompute | predicted peak | measured peak | error | rank spread | model states exact | "
        "peak phase (pred/meas) |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for label, model, rc, p, m, e, sp, exact, phase, *_ in rows:
        if p is None:
            lines.append(f"| {label} | {model} | {rc} | – | – | – | – | – | failed: {phase} |")
            continue
        flag = " ⚠ under" if e < -0.01 else ""
        lines.append(f"| {label} | {model} | {rc} | {p:,} | {m:,} | {100 * e:+.2f}%{flag} | {100 * sp:.1f}% | "
                     f"{'yes' if exact else 'NO'} | {phase} |")
    lines += ["", "Per strategy (|error| on the peak):", "", "| strategy | cases | median | max |", "|---|---:|---:|---:|"]
    for k, es in errors.items():
        a = [abs(e) for e in es]
        lines.append(f"| {k} | {len(a)} | {100 * statistics.median(a):.2f}% | {100 * max(a):.2f}% |")
    out = Path(args.out)
    keep = ""  # the hand-written findings below the table survive a re-run
    if out.exists() and "\n## Findings" in out.read_text():
        keep = "\n## Findings" + out.read_text().split("\n## Findings", 1)[1]
    out.write_text("\n".join(lines) + "\n" + keep)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Model parallelism: tensor (TP), sequence (SP) and pipeline (PP) parallelism, as the frameworks lay them out.

A job on ``gpus = dp x tp x pp`` GPUs runs its data-parallel strategy (DDP, ZeRO, FSDP2/HSDP) over the dp ranks
that hold the same share of the model. That share is a smaller model: the pipeline stage's blocks (with the
embedding on the first stage, the final norm and the head on the last) with every tensor-parallel linear cut to
its TP rank's rows or columns. This module computes that share per pipeline rank, exactly, as a ParamInventory the
engine sizes like any other model, and how many micro-batches each stage holds in flight. Pure Python: it imports
neither torch nor transformers.

Two layouts, chosen by the data-parallel strategy's framework:

- ``torchtitan`` (FSDP2, HSDP, DDP): DTensor tensor parallelism (torch.distributed.tensor.parallel: ColwiseParallel
  and RowwiseParallel on the attention and MLP projections, the embedding and the head split by vocabulary rows
  with torch.chunk's sizes, ceil(V / tp) on the first ranks), torch.distributed.pipelining's schedules, and
  torchtitan's stage split (torchtitan/distributed/pipeline_parallel.py generate_llm_fqn_per_model_part: the
  embedding and the head each count as one layer, the effective layers spread evenly, the first stages one more;
  looped virtual stages, rank r holding stages r, r + pp, ...; multi-stage schedules two per rank by default).
- ``megatron-deepspeed`` (DeepSpeed ZeRO-0/1, and ZeRO-2/3 without PP): Megatron's tensor-parallel layers
  (ColumnParallelLinear / RowParallelLinear; the vocabulary padded to a multiple of 128 x tp,
  megatron/training/tokenizer ``_vocab_size_with_padding``, make_vocab_size_divisible_by 128; key/value heads
  replicated when there are fewer of them than TP ranks) and DeepSpeed's PipelineEngine (1F1B only,
  deepspeed/runtime/pipe/schedule.py TrainSchedule; PipelineModule's default partition_method "parameters":
  deepspeed/runtime/utils.py partition_balanced over the layers' parameter counts, layers = [embedding, blocks...,
  final norm, head]; ZeRO-2 and -3 refused with PP, as engine.py's PipelineEngine asserts).

One file per parallelism: tensor.py (TP), sequence.py (SP), pipeline.py (PP: the stages and each pipeline rank's
share; schedules.py: the schedules' action lists), context.py (CP), expert.py (EP); degrees.py holds the degrees
(``Parallel``) and the names they share, layout.py which layout a strategy runs and the checks.

Glossary (one meaning each, in this package and the engine):

- **layout**: the way a data-parallel framework lays out model parallelism, ``torchtitan`` or
  ``megatron-deepspeed`` above (``layout_of``; the JSON's ``parallel.layout``). How a strategy lays out its own
  tensors across the data-parallel ranks (replicated, flat-aligned, per-parameter...) is its **tensor layout**
  (memplan/strategies.py, memplan/layouts.py), and ``accounting.Layout`` is the engine's set of per-rank plans.
- **share**: what one pipeline rank holds (``RankShare``): its stages (``Chunk``), its tensors after TP, the
  micro-batches it holds in flight.
- **stage** / **chunk**: one pipeline stage; a rank holds several under a multi-stage schedule (virtual stages).
- **degree**: tp, pp, cp, ep (and vpp, virtual stages per rank); dp is what is left of the GPUs.
"""

from memplan.parallel.context import ring_attention
from memplan.parallel.degrees import (CP_KEY, EP_KEY, LAYOUT_SCHEDULES, MEGATRON_DEEPSPEED, SCHEDULES, TORCHTITAN,
                                      Parallel)
from memplan.parallel.expert import routed_experts
from memplan.parallel.layout import check, layout_of
from memplan.parallel.pipeline import (Chunk, RankShare, backward_moments, dominated, held_moments, in_flight,
                                       partition_balanced, rank_chunks, recv_buffers, shares, stage_input,
                                       stage_inventory, stage_output, torchtitan_stages, zero_bubble_grads)
from memplan.parallel.sequence import norm_saved, sp_saving, sp_tokens
from memplan.parallel.tensor import (BARE_VOCAB, COLUMN, KV, MEGATRON_VOCAB_MULTIPLE, ROW, loss_parallel_extra,
                                     padded_vocab, rank_config, rank_dims, tp_inventory)

__all__ = ["BARE_VOCAB", "COLUMN", "CP_KEY", "EP_KEY", "KV", "LAYOUT_SCHEDULES", "MEGATRON_DEEPSPEED",
           "MEGATRON_VOCAB_MULTIPLE", "ROW", "SCHEDULES", "TORCHTITAN", "Chunk", "Parallel", "RankShare", "check",
           "backward_moments", "dominated", "held_moments", "in_flight", "layout_of", "loss_parallel_extra",
           "norm_saved", "padded_vocab", "partition_balanced", "rank_chunks", "rank_config", "rank_dims",
           "recv_buffers", "ring_attention", "routed_experts", "shares", "sp_saving", "sp_tokens", "stage_input",
           "stage_inventory", "stage_output", "torchtitan_stages", "tp_inventory", "zero_bubble_grads"]

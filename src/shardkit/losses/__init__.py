"""Layer 1: losses over a vocabulary split across tensor-parallel ranks (see docs/losses.md).

Exact at every tensor-parallel size, computed without gathering the logits: log-softmax, per-token
log-probs, cross-entropy (label smoothing, z-loss, soft-capping, temperature, ignore index, padded
vocabularies), the fused linear cross-entropy that never materializes the logits, and RL helpers
(entropy, argmax, top-k). Imports only torch, ``shardkit.distributed`` and ``shardkit.kernels`` (the
Triton passes of the plain cross-entropy on CUDA).
"""

from shardkit.losses.checks import TargetOutOfRangeError
from shardkit.losses.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from shardkit.losses.fused_linear import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_logprobs
from shardkit.losses.log_softmax import _compute_distributed_log_softmax, distributed_log_softmax
from shardkit.losses.logprobs import ChunkedDistributedLogprob, DistributedLogprob, vocab_parallel_logprobs
from shardkit.losses.megatron import megatron_cross_entropy
from shardkit.losses.nemo_rl_cp import (
    AllGatherCPTensor,
    _get_tokens_on_this_cp_rank,
    allgather_cp_sharded_tensor,
    cp_load_balanced_to_contiguous,
    cp_shift_next,
    group_all_reduce_sum,
    group_all_reduce_sum_with_grad,
)
from shardkit.losses.nemo_rl_logprobs import (
    ChunkedDistributedGatherLogprob,
    all_to_all_sq2vp,
    all_to_all_vp2sq,
    get_distillation_topk_logprobs_from_logits,
    get_next_token_logprobs_from_logits,
)
from shardkit.losses.nemo_rl_vocab import (
    ChunkedDistributedLogprobWithSampling,
    DistributedCrossEntropy,
    DistributedLogprobWithSampling,
    vocab_parallel_full_log_softmax,
    vocab_parallel_gather_columns,
    vocab_parallel_log_softmax,
)
from shardkit.losses.next_token import (
    TrainingSamplingParams,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
)
from shardkit.losses.parallel_ce import (
    HAVE_TE_PARALLEL_CE,
    MISSING_TE_PARALLEL_CE_MSG,
    CrossEntropyFunction,
    ParallelCrossEntropy,
    TEParallelCrossEntropy,
    parallel_cross_entropy,
)
from shardkit.losses.rl_helpers import vocab_parallel_argmax, vocab_parallel_entropy, vocab_parallel_topk
from shardkit.losses.sampling import (
    apply_top_k_top_p,
    distributed_vocab_topk,
    gather_logits_at_global_indices,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_top_k_top_p_mask,
)
from shardkit.losses.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "ChunkedDistributedGatherLogprob",
    "all_to_all_sq2vp",
    "all_to_all_vp2sq",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
    "AllGatherCPTensor",
    "ChunkedDistributedLogprobWithSampling",
    "DistributedCrossEntropy",
    "DistributedLogprobWithSampling",
    "_get_tokens_on_this_cp_rank",
    "allgather_cp_sharded_tensor",
    "cp_load_balanced_to_contiguous",
    "cp_shift_next",
    "group_all_reduce_sum",
    "group_all_reduce_sum_with_grad",
    "vocab_parallel_full_log_softmax",
    "vocab_parallel_gather_columns",
    "vocab_parallel_log_softmax",
    "HAVE_TE_PARALLEL_CE",
    "MISSING_TE_PARALLEL_CE_MSG",
    "ChunkedDistributedLogprob",
    "CrossEntropyFunction",
    "DistributedLogprob",
    "ParallelCrossEntropy",
    "ParallelLMHead",
    "TEParallelCrossEntropy",
    "TargetOutOfRangeError",
    "TrainingSamplingParams",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "_compute_distributed_log_softmax",
    "apply_top_k_top_p",
    "distributed_vocab_topk",
    "gather_logits_at_global_indices",
    "megatron_cross_entropy",
    "distributed_log_softmax",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
    "parallel_cross_entropy",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_logprobs",
    "vocab_parallel_logprobs",
    "vocab_parallel_sampling_logprobs",
    "vocab_parallel_top_k_top_p_mask",
    "vocab_parallel_topk",
]

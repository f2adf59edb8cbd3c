"""DeepSeek-V4: hyper-connected residual streams, compressed sparse attention and hash-routed
experts, on the engine's paged caches.

The network, as transformers 5.24 (``models/deepseek_v4``) computes it:

- **Hyper-connections.** The residual is ``hc_mult`` streams. Before each attention and
  MLP block a hyper-connection reads the streams (flattened, RMS-normalised, one linear
  map) into three weights: ``pre`` collapses the streams into the block's input, ``post``
  spreads the block's output over them, and ``comb`` (made doubly stochastic by
  Sinkhorn-Knopp iterations) mixes the old streams into the new. ``hc_head`` collapses
  them once more before the final norm. All of this in float32.
- **Attention.** One shared key=value head of ``head_dim`` (512) for every query head;
  queries through the q_lora latent and a per-head RMS normalisation; rope on the
  trailing ``qk_rope_head_dim`` dims, interleaved pairs; attention sinks (a learned
  logit per head that joins the softmax and is dropped); the output's rope dims rotated
  back by the query's position; a grouped low-rank output projection
  (``o_groups`` groups to ``o_lora_rank`` each, then ``o_b_proj``).
  Every layer attends to a sliding window of ``sliding_window`` tokens. Compressed
  layers also attend to compressed entries, one per ``ratio`` tokens: a softmax-gated
  pool of the window's ``kv_proj`` rows (with a learned per-slot bias), RMS-normalised,
  roped at the window's first position. Heavily compressed layers (ratio 128) see every
  finished entry; compressed sparse layers (ratio 4) pool overlapping windows (the
  previous window's first half-series with this one's second) and see the ``index_topk``
  entries a lightning indexer picks, the indexer itself scoring compressed keys pooled
  the same way at ``index_head_dim``. An entry is visible to queries at or after its
  window's last token. Sliding layers rope with θ=``rope_theta``, compressed layers and
  their compressors with θ=``compress_rope_theta`` and YaRN, cos/sin unscaled.
- **Experts.** Every layer routes experts: the first ``num_hash_layers``
  (``mlp_layer_types`` ``hash_moe``) by a fixed token-id table ``tid2eid``, the rest by
  top-k of ``sqrtsoftplus`` scores plus ``e_score_correction_bias``; the chosen scores,
  normalised and times ``routed_scaling_factor``, weight them. Gate and up are clamped
  by ``swiglu_limit`` (gate from above, up both ways) in routed and shared experts.

On the engine. Each attention's parts are KV-cache layers: the window keys and the
compressed entries are two ``sparse_mla`` caches (one entry per token, the value the
whole entry, selected positions given explicitly), and the compressors' per-token
projections are ``token_state`` caches read back when a window completes, possibly steps
later (chunked prefill, decode). The compressed entry of window ``w`` is written at the
slot of the window's last token, ``w·ratio + ratio - 1``; the lightning indexer's
pooled keys likewise, in a ``token_state`` cache, scored in the model. Window and
compressed attention each return their log-sum-exp, merged with the sinks into one
softmax. Everything is per token in the shared block numbering, so prefix caching and
preemption need nothing special; the price is memory: every token keeps its window key
and its compressor inputs, which a dedicated layout would drop once out of the window.

Router logits are computed in float32 (transformers uses the model dtype; with float32
weights, as in the tests, both agree).

The package, one part of the network per module (every name below is importable from the
package itself, as it was from the single module it replaces):

- ``config``: the layer types, ``V4Dims`` and the router's scoring functions;
- ``norms``: the float32 RMS norms; ``rope``: the interleaved rope and its inverse;
- ``hyper_connections``: the streams' hyper-connections and ``hc_head``;
- ``compressor``: the pooled compressed entries; ``indexer``: the lightning indexer;
- ``step``: what every layer of one forward pass shares;
- ``attention``: window and compressed attention, merged with the sinks;
- ``moe``: the router, the shared expert and the experts' block;
- ``decoder``: the decoder layer and the ``model.*`` stack;
- ``model``: ``DeepseekV4ForCausalLM``; ``checkpoint_names``: reference names -> transformers';
- ``mtp_block``: the multi-token-prediction block that the ``mtp`` proposer runs.
"""

from engine_deepseek_v4.deepseek_v4.attention import CacheLayers, GroupedProjection, V4Attention, merge_with_sinks
from engine_deepseek_v4.deepseek_v4.checkpoint_names import transformers_name
from engine_deepseek_v4.deepseek_v4.compressor import Compressor
from engine_deepseek_v4.deepseek_v4.config import CSA, DEFAULT_RATIOS, HCA, SCORE_FUNCTIONS, SLIDING, V4Dims
from engine_deepseek_v4.deepseek_v4.decoder import V4DecoderLayer, V4Stack
from engine_deepseek_v4.deepseek_v4.hyper_connections import HyperConnection, HyperHead, hyper_residual
from engine_deepseek_v4.deepseek_v4.indexer import LightningIndexer
from engine_deepseek_v4.deepseek_v4.model import DeepseekV4ForCausalLM, logger
from engine_deepseek_v4.deepseek_v4.moe import ClampedMLP, V4MoE, V4Router
from engine_deepseek_v4.deepseek_v4.mtp_block import MtpV4Layer
from engine_deepseek_v4.deepseek_v4.norms import Fp32RMSNorm, unweighted_rms_norm
from engine_deepseek_v4.deepseek_v4.rope import Rope, rotate
from engine_deepseek_v4.deepseek_v4.step import Step

__all__ = [
    "CSA",
    "DEFAULT_RATIOS",
    "HCA",
    "SCORE_FUNCTIONS",
    "SLIDING",
    "CacheLayers",
    "ClampedMLP",
    "Compressor",
    "DeepseekV4ForCausalLM",
    "Fp32RMSNorm",
    "GroupedProjection",
    "HyperConnection",
    "HyperHead",
    "LightningIndexer",
    "MtpV4Layer",
    "Rope",
    "Step",
    "V4Attention",
    "V4DecoderLayer",
    "V4Dims",
    "V4MoE",
    "V4Router",
    "V4Stack",
    "hyper_residual",
    "logger",
    "merge_with_sinks",
    "rotate",
    "transformers_name",
    "unweighted_rms_norm",
]

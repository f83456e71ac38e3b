"""TokenBatch → FeatureBatch: what the frozen target gives a draft head to learn from.

One extraction function serves online features (inside training) and the feature cache, so the
two are the same computation. Batches are right-padded: with a causal mask, padding after a
sequence cannot change the features of its real tokens, so no position ids are needed. Features
at padded positions are zeroed so that they never depend on the batch they were computed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from specdraft.data.chat import TokenizedConversation
from specdraft.data.families import output_logits
from specdraft.data.target import Target
from specdraft.heads.spec import TargetSpec

DEFAULT_LM_HEAD_CHUNK_TOKENS = 1024
# Rows of logits turned into top-k probabilities at a time on a CPU. The fp32 softmax of a whole
# chunk is 1024 × 49k × 4 B = 200 MB, so its cast, softmax and top-k each went through memory; 32
# rows (6 MB) stay in the CPU's cache between them: the lm_head + top-k of 4,096 tokens took 0.40 s
# instead of 0.94 (SmolLM2, bf16, a 2-core AVX-512-bf16 EPYC), the same numbers to the bit.
TOPK_ROWS = 32


@dataclass
class TokenBatch:
    """Right-padded token batch. All B×T; ``attention_mask`` and ``loss_mask`` are 0/1 long."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask)))


@dataclass
class FeatureBatch:
    """Target features for a :class:`TokenBatch`.

    hidden      B×T×H      last hidden state after the final norm, target dtype
    aux         B×T×(k·H)  hidden_states[i] for the k requested aux layer ids, concatenated in
                           the order given (None unless requested)
    topk_ids    B×T×K      the target's K most likely next tokens (None unless top_k > 0)
    topk_probs  B×T×K      their fp32 probabilities under the full softmax
    input_hidden B×T×H     the features the head reads when they differ from ``hidden`` (EAGLE's
                           training noise); ``hidden`` stays the clean regression target
    seed        the seed of what a head draws at random from this training batch (DFlash's
                anchors), set by the DataModule so that a resumed run draws what an
                uninterrupted one would; None: the head's own choice
    All feature tensors are zero at padded positions.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    hidden: Tensor
    aux: Tensor | None = None
    topk_ids: Tensor | None = None
    topk_probs: Tensor | None = None
    input_hidden: Tensor | None = None
    seed: int | None = None

    def to(self, device: torch.device | str) -> FeatureBatch:
        return FeatureBatch(
            **{k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        )


def pad_token_id(spec: TargetSpec) -> int:
    """The id right padding uses: the target's pad token, else its primary eos (always masked out)."""
    return spec.pad_token_id if spec.pad_token_id is not None else spec.eos_token_ids[0]


def collate(samples: Sequence[TokenizedConversation], pad_token_id: int) -> TokenBatch:
    """Right-pad tokenized conversations into one :class:`TokenBatch`."""
    if not samples:
        raise ValueError("collate: no samples")
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.long)
    return TokenBatch(input_ids, attention_mask, loss_mask)


def pack_batches(order: Sequence[int], lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Greedily cut ``order`` (sample indices) into consecutive batches whose padded size
    ``batch size × longest length`` stays within ``max_batch_tokens``. Sorting ``order`` by length
    first keeps padding small."""
    batches: list[list[int]] = []
    longest = 0
    for index in order:
        length = lengths[index]
        if length > max_batch_tokens:
            raise ValueError(f"a sample of {length} tokens exceeds max_batch_tokens={max_batch_tokens}")
        if batches and (len(batches[-1]) + 1) * max(longest, length) <= max_batch_tokens:
            batches[-1].append(index)
            longest = max(longest, length)
        else:
            batches.append([index])
            longest = length
    return batches


def length_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Length-bucketed batches within ``max_batch_tokens``, longest first, so a batch that does
    not fit in memory fails at once, not at the end."""
    return pack_batches(
        sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True), lengths, max_batch_tokens
    )


@torch.no_grad()
def extract_features(
    target: Target,
    batch: TokenBatch,
    aux_layer_ids: Sequence[int] = (),
    top_k: int = 0,
    lm_head_chunk_tokens: int = DEFAULT_LM_HEAD_CHUNK_TOKENS,
) -> FeatureBatch:
    """Run the frozen target once over ``batch``.

    ``aux_layer_ids`` use the hidden_states convention of :mod:`specdraft.heads.spec` (id i =
    the stream entering decoder layer i); they are captured with forward pre-hooks, so only the
    requested layers are kept, not all N+1 hidden states. The lm_head runs only when the
    top-k is asked for, over real tokens only, ``lm_head_chunk_tokens`` at a time (a full
    B×T×V fp32 tensor for a 49k vocabulary is 200 kB per token).
    """
    device = target.device
    input_ids = batch.input_ids.to(device)
    attention_mask = batch.attention_mask.to(device)
    decoder = target.model.get_decoder()
    layers = decoder.layers
    for layer_id in aux_layer_ids:
        if not 0 <= layer_id < len(layers):
            raise ValueError(
                f"aux layer id {layer_id} out of range 0..{len(layers) - 1} (hidden_states indexing)"
            )

    captured: dict[int, Tensor] = {}

    def capture(layer_id: int):
        def hook(module, args, kwargs):
            captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [layers[i].register_forward_pre_hook(capture(i), with_kwargs=True) for i in aux_layer_ids]
    # Right padding (collate's) hides nothing from a real token that causality does not already
    # hide: without the mask SDPA runs its causal kernel on the key/value heads (1.09× the batch
    # on SmolLM2, bf16, 16 × 512 tokens; the real tokens' features identical). Pads' outputs differ
    # and are zeroed below.
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    try:
        output = decoder(
            input_ids=input_ids, attention_mask=None if right_padded else attention_mask, use_cache=False
        )
    finally:
        for handle in handles:
            handle.remove()

    keep = attention_mask.unsqueeze(-1).to(output.last_hidden_state.dtype)
    hidden = output.last_hidden_state * keep
    features = FeatureBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        loss_mask=batch.loss_mask,
        hidden=hidden,
        aux=torch.cat([captured[i] for i in aux_layer_ids], dim=-1) * keep if aux_layer_ids else None,
    )
    if top_k > 0:
        _lm_head_outputs(target, features, top_k, lm_head_chunk_tokens)
    return features


def _lm_head_outputs(target: Target, features: FeatureBatch, top_k: int, chunk: int) -> None:
    """Fill ``features.topk_*`` from the frozen lm_head at the real tokens only."""
    hidden = features.hidden
    batch_size, length, _ = hidden.shape
    flat_index = features.attention_mask.to(hidden.device).reshape(-1).nonzero().squeeze(-1)
    real = hidden.reshape(batch_size * length, -1)[flat_index]
    logits = partial(output_logits, target.model.config, target.model.get_output_embeddings())
    ids, probs = target_topk(real, logits, top_k, chunk)
    zeros = partial(torch.zeros, batch_size * length, top_k, device=hidden.device)
    features.topk_ids, features.topk_probs = zeros(dtype=torch.long), zeros(dtype=torch.float32)
    features.topk_ids[flat_index], features.topk_probs[flat_index] = ids, probs
    features.topk_ids = features.topk_ids.view(batch_size, length, top_k)
    features.topk_probs = features.topk_probs.view(batch_size, length, top_k)


@torch.no_grad()
def target_topk(
    hidden: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    k: int,
    chunk: int = DEFAULT_LM_HEAD_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """The target's k most likely next tokens at N hidden states (after its final norm): ids N×k
    int64 and their fp32 probabilities N×k under the full softmax. ``lm_head`` (n×H -> n×V logits)
    runs ``chunk`` rows at a time (N×V logits would be 0.8 GB in bf16 for 8k tokens of a 49k
    vocabulary), each chunk's fp32 softmax ``TOPK_ROWS`` rows at a time on a CPU. The feature
    cache and the objective (when the features hold no top-k) both read the target's top-k here."""
    count = hidden.shape[0]
    ids = torch.empty(count, k, dtype=torch.long, device=hidden.device)
    probs = torch.empty(count, k, dtype=torch.float32, device=hidden.device)
    rows = TOPK_ROWS if hidden.device.type == "cpu" else chunk  # a GPU gains nothing, pays launches
    for start in range(0, count, chunk):
        logits = lm_head(hidden[start : start + chunk])
        for row in range(0, len(logits), rows):  # a row's softmax needs only its own logits
            stop = min(row + rows, len(logits))
            piece = slice(start + row, start + stop)
            probs[piece], ids[piece] = logits[row:stop].float().softmax(dim=-1).topk(k, dim=-1)
    return ids, probs

"""Target features captured while greedy regeneration runs, instead of a second forward later.

Regeneration's prefill already computes the prompt's hidden states and each decoding step the
hidden state of the token it feeds, so the feature cache's forward over the same tokens
(``specdraft-cache``: 6-7 of the quickstart's 45 minutes on a 2-core EPYC) repeats work done. A
:class:`FeatureCapture` hooks the target's decoder while :func:`~specdraft.data.generate.greedy_generate`
runs and keeps, for every token of prompt + answer, what :func:`~specdraft.data.features.extract_features`
would compute: the last hidden state, the requested aux layers' inputs, the top-k of the target's
softmax (at the answer's positions and the prompt's last, where objectives read it; zero at the
prompt's others). The generator feeds each answer's last token once more (one extra step per
row) so that it has features too.

The tokens are the generated ids themselves, not the answer decoded to text and tokenized again
(the cache stage's input), and the features come from a left-padded prefill and one-token steps,
so they equal a right-padded full forward at rounding level (fp32 ≤ 1e-5 on the tiny target,
tested), as the cache's own batches do among themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdraft.data.features import target_topk


@dataclass
class CapturedFeatures:
    """One sequence's features, T = prompt + answer tokens.

    hidden  T×H     last hidden state after the final norm, target dtype
    aux     T×(k·H) inputs of the aux layers, concatenated (None without aux layers)
    topk_ids T×K int64, topk_probs T×K fp32 (None when top_k is 0)
    """

    hidden: Tensor
    aux: Tensor | None
    topk_ids: Tensor | None
    topk_probs: Tensor | None


class FeatureCapture:
    """Collects features of the sequences :func:`~specdraft.data.generate.greedy_generate` feeds,
    per prompt index. Use as a context manager around the generation (it hooks the decoder and the
    aux layers, and removes the hooks on exit)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int] = (), top_k: int = 0) -> None:
        self.model, self.aux_layer_ids, self.top_k = model, tuple(aux_layer_ids), top_k
        self.decoder = model.get_decoder()
        layers = self.decoder.layers
        for layer_id in self.aux_layer_ids:
            if not 0 <= layer_id < len(layers):
                raise ValueError(
                    f"aux layer id {layer_id} out of range 0..{len(layers) - 1} (hidden_states indexing)"
                )
        self._pieces: dict[int, list[tuple[Tensor, ...]]] = {}
        self._last: dict[str, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> FeatureCapture:
        def keep_output(module, args, output) -> None:
            self._last["hidden"] = output.last_hidden_state

        def keep_input(layer_id: int):
            def hook(module, args, kwargs) -> None:
                self._last[f"aux{layer_id}"] = args[0] if args else kwargs["hidden_states"]

            return hook

        self._handles = [self.decoder.register_forward_hook(keep_output)]
        self._handles += [
            self.decoder.layers[i].register_forward_pre_hook(keep_input(i), with_kwargs=True)
            for i in self.aux_layer_ids
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._last = [], {}

    def _rows(self) -> tuple[Tensor, Tensor | None]:
        """The last forward's hidden states B×W×H and aux inputs B×W×(k·H) (None without aux)."""
        aux = [self._last[f"aux{i}"] for i in self.aux_layer_ids]
        return self._last["hidden"], torch.cat(aux, dim=-1) if aux else None

    def _topk(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """ids and fp32 probabilities N×K of the top-k of N×V logits, as the feature cache
        computes them from its own logits."""
        return target_topk(logits, nn.Identity(), self.top_k)

    def prefill(self, prompts: Sequence[int], attention_mask: Tensor, last_logits: Tensor) -> None:
        """After a left-padded prefill of ``prompts`` (indices; B×W ``attention_mask``, the last
        column's logits B×V): keep each prompt's real positions. The top-k of a prompt position
        is kept at its last one only, from the prefill's own logits, and is zero before it: no
        objective reads it there (a head is supervised where the next token is the answer's), and
        the lm_head over every prompt token cost about half the capture: 384 ShareGPT first turns
        were answered in 67 / 74 s with it, 64 / 66 s without, 57 / 58 s capturing nothing
        (specdraft-regen, SmolLM2, bf16, 128 rows, 2-core AVX-512-bf16 EPYC)."""
        hidden, aux = self._rows()
        last_ids, last_probs = self._topk(last_logits) if self.top_k else (None, None)
        # One transfer to the host for the whole prefill, not one (and a sync) per row and field.
        hidden, aux, last_ids, last_probs = _to_host(hidden, aux, last_ids, last_probs)
        counts = attention_mask.sum(-1).tolist()
        for row, prompt in enumerate(prompts):
            piece = slice(hidden.shape[1] - counts[row], None)  # left padded: the last columns
            ids = probs = None
            if self.top_k:
                ids = last_ids.new_zeros(counts[row], self.top_k)
                probs = last_probs.new_zeros(counts[row], self.top_k)
                ids[-1], probs[-1] = last_ids[row], last_probs[row]
            # copies: views would keep the whole padded prefill alive until the pop
            aux_piece = aux[row, piece].clone() if aux is not None else None
            self._pieces[prompt] = [(hidden[row, piece].clone(), aux_piece, ids, probs)]

    def step(self, prompts: Sequence[int], rows: Sequence[int], logits: Tensor) -> None:
        """After a one-token step: keep the fed token's features for batch rows ``rows`` answering
        ``prompts``; ``logits`` B×V are the step's."""
        hidden, aux = self._rows()
        index = torch.tensor(rows, device=hidden.device)
        hidden, aux = hidden[index, -1], aux[index, -1] if aux is not None else None
        ids, probs = self._topk(logits[index]) if self.top_k else (None, None)
        hidden, aux, ids, probs = _to_host(hidden, aux, ids, probs)
        for n, prompt in enumerate(prompts):
            self._pieces[prompt].append(
                (
                    hidden[n : n + 1],
                    aux[n : n + 1] if aux is not None else None,
                    ids[n : n + 1] if ids is not None else None,
                    probs[n : n + 1] if probs is not None else None,
                )
            )

    def pop(self, prompt: int) -> CapturedFeatures:
        """The features of prompt ``prompt``'s whole sequence (forgotten here)."""
        columns = list(zip(*self._pieces.pop(prompt), strict=True))
        hidden, aux, ids, probs = (None if parts[0] is None else torch.cat(parts) for parts in columns)
        return CapturedFeatures(hidden, aux, ids, probs)


def _to_host(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """On the host: a chunk's features (4.6 kB a token on SmolLM2 with its aux layers: 5.6 GB
    for 4,096 sequences of 300 tokens) would otherwise pile up on the accelerator beside the KV
    cache sized to fill it. A no-op on a CPU; on a GPU each step syncs with the host already."""
    return tuple(None if t is None else t.to("cpu") for t in tensors)

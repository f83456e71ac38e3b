"""A draft language model as the drafter: classic speculative sampling."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from specdraft.data.kv_cache import PositionalKVCache
from specdraft.eval.drafters import Chain, Draft, Drafter, DraftNode, ScoreFilter, TreeGrowth
from specdraft.eval.kernels import compiled_step
from specdraft.eval.sampling import Sampling


class DraftModelDrafter(Drafter):
    """Classic speculative sampling (Leviathan et al. 2023; Chen et al. 2023, DeepMind): a small
    causal LM sharing the target's tokenizer drafts a chain with its own KV cache; at T>0 the
    drafts are sampled from it. After a rejection its cache is cropped back to the committed
    prefix. ``compile``: its forward through ``torch.compile``."""

    name = "draft_model"

    def __init__(
        self,
        model: PreTrainedModel,
        shape: Chain,
        score_filter: ScoreFilter | None = None,
        compile: bool = False,
    ) -> None:
        if not isinstance(shape, Chain):
            raise ValueError("a draft model drafts chains (shape Chain)")
        super().__init__(shape, score_filter)
        self.model = model
        self._forward = compiled_step(model) if compile else model
        self.vocab_size = model.get_output_embeddings().out_features
        parameter = next(model.parameters())
        self.to_target = torch.arange(self.vocab_size, device=parameter.device)
        # the cache is kept across sequences, written by position
        self.cache = PositionalKVCache.for_model(model, parameter.dtype, parameter.device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.fed = []
        self.cache.crop(0)

    @torch.no_grad()
    def _feed(self, tokens: list[int], contexts: list[list[int]]) -> Tensor:
        device = next(self.model.parameters()).device
        positions = torch.arange(len(self.fed), len(self.fed) + len(tokens), device=device)[None]
        self.cache.reserve(len(self.fed) + len(tokens))
        self.cache.write_at = len(self.fed)
        output = self._forward(
            input_ids=torch.tensor([tokens], device=device),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.fed.extend(tokens)
        self.cache.write_at = len(self.fed)
        log_probs = output.logits[0, -1:].float().log_softmax(-1)
        return self._filtered(contexts, 0, log_probs, self.to_target)[0]

    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        sequence = [*self.history, root]
        common = 0
        for fed, token in zip(self.fed, sequence, strict=False):
            if fed != token:
                break
            common += 1
        common = min(common, len(sequence) - 1)  # always feed at least the root
        self.cache.crop(common)
        self.fed = self.fed[:common]
        growth = TreeGrowth([DraftNode(root, -1, 0, ())])
        first = self._feed(sequence[common:], [sequence] if self.score_filter else [])

        def step(node: int) -> Tensor:
            contexts = [growth.context(self.history, node)] if self.score_filter else []
            return self._feed([growth.nodes[node].token], contexts)

        return self._chain(growth, first, step, self.to_target, sampling, generator)

"""The decoder's shortlist counted from a feature cache: the training vocabulary of the heads
trained on it.

By default the bench ranks tokens by how often they are assistant tokens of ``shortlist.source``
(ShareGPT's original answers). A head trained on other answers — the target's own, regenerated —
was trained over other tokens: for the quickstart's self-distilled cache only 4,753 of the 8,192
most frequent ShareGPT tokens were among its 8,192 most frequent training tokens (measured
2026-11-24). ``shortlist.cache=<a feature cache dir>`` counts the tokens under the loss mask of
that cache's samples instead — the ids the heads were trained on, as the cache holds them (also
for features captured during regeneration, whose ids are the ones generated).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.data.cache_dataset import FeatureCache


def cached_assistant_counts(cache_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """V int64: how often each token id lies under the loss mask of the samples of the feature
    cache at ``cache_dir`` (its tokens only: no feature is read)."""
    cache = FeatureCache(cache_dir, verify=False)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index in range(len(cache)):
        input_ids, loss_mask = cache.tokens(index)
        counts += torch.bincount(input_ids[loss_mask.bool()], minlength=vocab_size)
    return counts

"""The DataModule: FeatureBatches for training, from the feature cache or computed online.

``mode="cached"`` reads two caches written by ``specdraft-cache`` (``split=train`` and
``split=heldout``). ``mode="online"`` renders the conversation source, splits it the same way,
and runs the frozen target on each batch after it reached the training device
(``on_after_batch_transfer``, in the main process): the target never enters a DataLoader worker,
the LightningModule, or a checkpoint. Both modes batch the same samples in the same
length-bucketed order, so a run can switch mode without changing what it sees.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from functools import partial

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from specdraft.data.cache import StoredFields, tokenizer_fingerprint
from specdraft.data.cache_dataset import FeatureCache, FeatureCaches, collate_cached
from specdraft.data.chat import TokenizedConversation, tokenize_conversations
from specdraft.data.conversations import ConversationSet, split_conversations
from specdraft.data.features import (
    FeatureBatch,
    TokenBatch,
    collate,
    extract_features,
    pack_batches,
    pad_token_id,
)
from specdraft.data.target import Target

log = logging.getLogger(__name__)

SUPERVISE = ("assistant", "all")  # FeatureDataModule's choices of trained positions
# num_workers=auto: loader workers when the training runs on an accelerator; none on a CPU, where
# they would take cycles from the training's own threads (AMX Xeon, 2 cores, the quickstart
# experiment, 100 steps alternated: 47.3 / 48.5 s with none, 49.9 / 49.2 with one, 55.4 / 50.1
# with two).
ACCELERATOR_LOADER_WORKERS = 2


class UniformFeatureNoise:
    """EAGLE's training noise on the features the head reads: ``U(-amplitude, amplitude)`` added
    at real tokens. The clean ``hidden`` is kept as the regression target."""

    def __init__(self, amplitude: float = 0.1) -> None:
        if amplitude < 0:
            raise ValueError(f"noise amplitude must be >= 0, got {amplitude}")
        self.amplitude = amplitude

    def __call__(self, features: FeatureBatch, generator: torch.Generator | None = None) -> FeatureBatch:
        hidden = features.hidden
        noise = torch.rand(hidden.shape, generator=generator, device=hidden.device, dtype=torch.float32)
        noise = (noise * 2 - 1) * self.amplitude * features.attention_mask.unsqueeze(-1)
        features.input_hidden = (hidden.float() + noise).to(hidden.dtype)
        return features


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar-length samples with ``batch size × longest length <= max_batch_tokens``.

    Each epoch: a seeded shuffle, a stable sort by length (so equal lengths mix differently every
    epoch), greedy packing, then a seeded shuffle of the batch order. With ``num_replicas > 1``
    every replica gets the same number of batches (the surplus batches of an epoch are dropped).
    Call :meth:`set_epoch` before each epoch (Lightning does).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_batch_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        too_long = [n for n in lengths if n > max_batch_tokens]
        if too_long:
            raise ValueError(
                f"{len(too_long)} samples are longer than max_batch_tokens={max_batch_tokens} "
                f"(longest {max(too_long)}); raise max_batch_tokens or lower data.max_length"
            )
        self.lengths, self.max_batch_tokens = list(lengths), max_batch_tokens
        self.shuffle, self.seed, self.num_replicas, self.rank = shuffle, seed, num_replicas, rank
        self.epoch = 0
        self.skip = 0  # batches of this epoch already consumed (set when resuming mid-epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _all_batches(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = (
            torch.randperm(len(self.lengths), generator=generator).tolist()
            if self.shuffle
            else range(len(self.lengths))
        )
        order = sorted(order, key=lambda i: self.lengths[i])
        batches = pack_batches(order, self.lengths, self.max_batch_tokens)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        usable = len(batches) - len(batches) % self.num_replicas if self.num_replicas > 1 else len(batches)
        return batches[:usable]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._all_batches()[self.rank :: self.num_replicas][self.skip :])

    def __len__(self) -> int:
        return math.floor(len(self._all_batches()) / self.num_replicas)


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`LengthBucketBatchSampler` that Lightning can checkpoint
    mid-epoch: its state is the number of batches of the current epoch handed to the training
    loop, and a restored loader skips exactly those (without loading them) on its next pass."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._yielded, self._resume_skip = 0, 0

    def __iter__(self):
        self.batch_sampler.skip, self._resume_skip = self._resume_skip, 0
        self._yielded = self.batch_sampler.skip
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_skip = int(state["batches_yielded"])


class TokenizedDataset(Dataset):
    def __init__(self, samples: Sequence[TokenizedConversation]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> TokenizedConversation:
        return self.samples[index]

    @property
    def lengths(self) -> list[int]:
        return [len(s.input_ids) for s in self.samples]

    @property
    def sample_ids(self) -> list[str]:
        return [s.id for s in self.samples]


class FeatureDataModule(L.LightningDataModule):
    """Training / held-out FeatureBatches, ``cached`` or ``online``, for ``target``.

    cached: ``train_cache`` and ``val_cache`` directories, checked against the target's spec and
            the fields asked for (``aux_layers``: the target's EAGLE-3 taps; ``top_k``). Either
            may be a list of directories, read as one mixture (:class:`FeatureCaches`; a
            directory listed twice is read twice per epoch).
    online: ``conversations`` (a reader's ConversationSet) split by ``heldout_fraction`` /
            ``split_seed`` and rendered to ``max_length`` tokens.
    supervise: which positions the head is TRAINED to predict: ``assistant`` (the loss mask, as
            EAGLE and HASS train) or ``all`` (every real token: the target's features and
            distribution are known at the prompt's tokens too, so they are more of the target to
            distil, at no data cost). Validation always scores the assistant tokens only, the text
            a draft head drafts at decode time.
    num_workers: DataLoader worker processes, or ``auto``: ACCELERATOR_LOADER_WORKERS when the
            trainer runs on an accelerator, none on a CPU.
    """

    def __init__(
        self,
        mode: str,
        target: Target,
        aux_layers: bool = False,
        top_k: int = 0,
        train_cache: str | Sequence[str] | None = None,
        val_cache: str | Sequence[str] | None = None,
        conversations: ConversationSet | None = None,
        heldout_fraction: float = 0.02,
        split_seed: int = 0,
        max_length: int = 2048,
        max_batch_tokens: int = 8192,
        num_workers: int | str = 0,
        noise: UniformFeatureNoise | None = None,
        seed: int = 0,
        verify_cache: bool = True,
        progress: bool = True,
        supervise: str = "assistant",
    ) -> None:
        super().__init__()
        if mode not in ("cached", "online"):
            raise ValueError(f"data mode must be 'cached' or 'online', got {mode!r}")
        if supervise not in SUPERVISE:
            raise ValueError(f"datamodule.supervise must be one of {list(SUPERVISE)}, got {supervise!r}")
        if mode == "cached" and not (train_cache and val_cache):
            raise ValueError(
                "mode=cached needs train_cache and val_cache (directories written by specdraft-cache)"
            )
        if mode == "online" and conversations is None:
            raise ValueError("mode=online needs a conversation source")
        if num_workers != "auto" and not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(f"datamodule.num_workers must be an integer >= 0 or 'auto', got {num_workers!r}")
        if aux_layers and not target.spec.aux_layer_ids:
            raise ValueError(f"aux_layers=true but target {target.spec.name} has no aux_layer_ids configured")
        self.mode, self.target = mode, target
        self.fields = StoredFields(target.spec.aux_layer_ids if aux_layers else (), top_k)
        self.train_cache, self.val_cache, self.conversations = train_cache, val_cache, conversations
        self.heldout_fraction, self.split_seed, self.max_length = heldout_fraction, split_seed, max_length
        self.max_batch_tokens, self.num_workers, self.noise, self.seed = (
            max_batch_tokens,
            num_workers,
            noise,
            seed,
        )
        self.verify_cache, self.progress, self.supervise = verify_cache, progress, supervise
        self.datasets: dict[str, Dataset] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        self.pad_id = pad_token_id(self.target.spec)
        if self.mode == "cached":
            fingerprint = tokenizer_fingerprint(self.target.tokenizer)
            for split, directories in (("train", self.train_cache), ("val", self.val_cache)):
                listed = [directories] if isinstance(directories, str) else directories
                spec, fields, verify = self.target.spec, self.fields, self.verify_cache
                caches = [FeatureCache(d, spec, fields, verify, expect_tokenizer=fingerprint) for d in listed]
                for cache in caches:
                    if len(cache) == 0:
                        raise ValueError(f"{split} cache {cache.dir} holds no samples")
                    if (
                        "captured_by" in cache.manifest["source"]
                        and fields.top_k
                        and self.supervise != "assistant"
                    ):
                        raise ValueError(
                            f"{split} cache {cache.dir} was captured during regeneration: its top-k "
                            "is stored at the answer's positions and the prompt's last only, so "
                            f"datamodule.supervise={self.supervise} cannot read it there (use "
                            "supervise=assistant, or features from specdraft-cache)"
                        )
                self.datasets[split] = caches[0] if isinstance(directories, str) else FeatureCaches(caches)
            return
        train, heldout = split_conversations(
            self.conversations.conversations, self.heldout_fraction, self.split_seed
        )
        for split, conversations in (("train", train), ("val", heldout)):
            samples, _ = tokenize_conversations(
                self.target.tokenizer, conversations, self.max_length, self.progress
            )
            if not samples:
                hint = (
                    f" (held out: a hash of each id under heldout_fraction={self.heldout_fraction};"
                    " raise data.heldout_fraction or data.source.limit)"
                )
                raise ValueError(
                    f"the {split} split of the conversations ({len(conversations)} of "
                    f"{len(self.conversations.conversations)}) has no sample to train or validate on"
                    + (hint if split == "val" else "")
                )
            self.datasets[split] = TokenizedDataset(samples)

    def assistant_token_counts(self) -> Tensor:
        """V int64: how often each token occurs under the loss mask of the training split (what
        EAGLE-3's reduced draft vocabulary is chosen from)."""
        self.setup("fit")
        dataset = self.datasets["train"]
        counts = torch.zeros(self.target.spec.vocab_size, dtype=torch.long)
        for index in range(len(dataset)):
            if isinstance(dataset, (FeatureCache, FeatureCaches)):
                input_ids, loss_mask = dataset.tokens(index)
            else:
                sample = dataset[index]
                input_ids, loss_mask = torch.tensor(sample.input_ids), torch.tensor(sample.loss_mask)
            counts += torch.bincount(input_ids[loss_mask.bool()], minlength=counts.numel())
        return counts

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        dataset = self.datasets[split]
        trainer = self.trainer
        workers = self.num_workers
        if workers == "auto":
            on_cpu = trainer is None or trainer.strategy.root_device.type == "cpu"
            workers = 0 if on_cpu else ACCELERATOR_LOADER_WORKERS
        sampler = LengthBucketBatchSampler(
            dataset.lengths,
            self.max_batch_tokens,
            shuffle=shuffle,
            seed=self.seed,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )
        collate_fn = partial(collate_cached if self.mode == "cached" else collate, pad_token_id=self.pad_id)
        return ResumableDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_fn,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def on_after_batch_transfer(self, batch: TokenBatch | FeatureBatch, dataloader_idx: int) -> FeatureBatch:
        training = self.trainer is not None and self.trainer.training
        return self.features_for(batch, training)

    def features_for(self, batch: TokenBatch | FeatureBatch, training: bool) -> FeatureBatch:
        """Online: run the target on the batch; then, when training, supervise every real token if
        asked (``supervise="all"``) and apply the noise transform.
        The features sit on the device the batch was delivered to (the head's): online, the
        frozen target moves there once, the first time a batch arrives on another device."""
        if isinstance(batch, TokenBatch):
            device = batch.input_ids.device
            if self.target.device != device:
                log.info(
                    "moving the frozen target from %s to the training device %s", self.target.device, device
                )
                self.target.model.to(device)
            batch = extract_features(self.target, batch, self.fields.aux_layer_ids, top_k=self.fields.top_k)
        if training and self.supervise == "all":
            batch.loss_mask = batch.attention_mask
        if training:
            batch.seed = self._batch_seed()
        if training and self.noise is not None:
            generator = None
            if batch.seed is not None:
                generator = torch.Generator(batch.hidden.device).manual_seed(batch.seed)
            batch = self.noise(batch, generator)
        return batch

    def _batch_seed(self) -> int | None:
        """The seed of a training batch's randomness (the noise, a head's draws): (seed, rank,
        batches fetched so far), so a resumed run draws what an uninterrupted one would
        (Lightning does not checkpoint the global RNG). None outside a trainer."""
        if self.trainer is None:
            return None
        fetched = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready
        return (self.seed * 1_000_003 + self.trainer.global_rank) * 1_000_003 + fetched

from types import SimpleNamespace

import pytest
import torch

from specdraft.data.cache import StoredFields, write_cache
from specdraft.data.chat import tokenize_conversations
from specdraft.data.conversations import (
    Conversation,
    ConversationSet,
    Message,
    ReadReport,
    split_conversations,
)
from specdraft.data.datamodule import (
    ACCELERATOR_LOADER_WORKERS,
    FeatureDataModule,
    LengthBucketBatchSampler,
    UniformFeatureNoise,
)
from specdraft.data.features import FeatureBatch, TokenBatch


def conversation_set(count=60):
    generator = torch.Generator().manual_seed(1)
    conversations = []
    for i in range(count):
        n = int(torch.randint(1, 30, (1,), generator=generator))
        conversations.append(
            Conversation(f"d{i}", (Message("user", f"q{i}"), Message("assistant", "ab " * n)))
        )
    return ConversationSet(conversations, ReadReport(source="synthetic"))


def test_sampler_respects_the_budget_and_covers_each_sample_once_per_epoch():
    lengths = [int(x) for x in torch.randint(1, 50, (200,), generator=torch.Generator().manual_seed(0))]
    sampler = LengthBucketBatchSampler(lengths, max_batch_tokens=120, seed=3)
    epoch0 = list(sampler)
    assert sorted(i for b in epoch0 for i in b) == list(range(200))
    assert all(len(b) * max(lengths[i] for i in b) <= 120 for b in epoch0)
    assert len(epoch0) == len(sampler)
    assert list(sampler) == epoch0  # same epoch, same order
    sampler.set_epoch(1)
    assert list(sampler) != epoch0
    with pytest.raises(ValueError, match="longer than max_batch_tokens=120"):
        LengthBucketBatchSampler([121], 120)


def test_sampler_gives_replicas_disjoint_batches_of_equal_count():
    lengths = list(range(1, 100))
    replicas = [
        list(LengthBucketBatchSampler(lengths, 200, seed=0, num_replicas=3, rank=r)) for r in range(3)
    ]
    assert len({len(r) for r in replicas}) == 1
    seen = [i for r in replicas for b in r for i in b]
    assert len(seen) == len(set(seen))


def test_noise_is_uniform_bounded_and_only_on_real_tokens():
    hidden = torch.zeros(2, 50, 64)
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, 30:] = 0
    batch = FeatureBatch(torch.zeros(2, 50, dtype=torch.long), mask, mask, hidden.clone())
    noisy = UniformFeatureNoise(0.1)(batch, torch.Generator().manual_seed(0))
    assert torch.equal(noisy.hidden, hidden)  # the regression target stays clean
    assert noisy.input_hidden.abs().max() <= 0.1
    assert not noisy.input_hidden[1, 30:].any()
    assert abs(noisy.input_hidden[mask.bool()].mean()) < 0.01
    assert noisy.input_hidden[mask.bool()].std() == pytest.approx(0.1 / 3**0.5, rel=0.05)


def test_online_and_cached_modes_give_the_same_batches(tmp_path, tiny_target):
    source = conversation_set()
    train, heldout = split_conversations(source.conversations, 0.2, 0)
    for name, split in (("train", train), ("val", heldout)):
        samples, _ = tokenize_conversations(tiny_target.tokenizer, split, 512, progress=False)
        write_cache(
            tiny_target, samples, tmp_path / name, StoredFields((1, 2, 3), 3), {"d": 1}, progress=False
        )
    common = {
        "target": tiny_target,
        "aux_layers": True,
        "top_k": 3,
        "max_batch_tokens": 300,
        "heldout_fraction": 0.2,
        "max_length": 512,
        "progress": False,
    }
    online = FeatureDataModule("online", conversations=source, **common)
    cached = FeatureDataModule(
        "cached", train_cache=str(tmp_path / "train"), val_cache=str(tmp_path / "val"), **common
    )
    for module in (online, cached):
        module.setup("fit")
    for split in ("train_dataloader", "val_dataloader"):
        online_batches = [online.features_for(b, training=False) for b in getattr(online, split)()]
        cached_batches = [cached.features_for(b, training=False) for b in getattr(cached, split)()]
        assert len(online_batches) == len(cached_batches) > 1
        for a, b in zip(online_batches, cached_batches, strict=True):
            for name in ("input_ids", "attention_mask", "loss_mask", "topk_ids"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            # features agree to rounding: the cache computed them in other batches (see data/cache.py)
            for name in ("hidden", "aux", "topk_probs"):
                torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=2e-5, rtol=1e-5)


def test_cached_mode_with_workers(tmp_path, tiny_target):
    samples, _ = tokenize_conversations(
        tiny_target.tokenizer, conversation_set(20).conversations, 512, progress=False
    )
    for name in ("train", "val"):
        write_cache(tiny_target, samples, tmp_path / name, StoredFields(), {"d": 1}, progress=False)
    module = FeatureDataModule(
        "cached",
        tiny_target,
        train_cache=str(tmp_path / "train"),
        val_cache=str(tmp_path / "val"),
        num_workers=1,
        max_batch_tokens=400,
        noise=UniformFeatureNoise(0.1),
    )
    module.setup("fit")
    batches = [module.features_for(b, training=True) for b in module.train_dataloader()]
    assert sum(int(b.attention_mask.sum()) for b in batches) == sum(len(s.input_ids) for s in samples)
    assert all(b.input_hidden is not None and b.aux is None for b in batches)


def test_auto_loader_workers_only_on_an_accelerator(tmp_path, tiny_target):
    """num_workers=auto (the cached default): no worker processes when training on a CPU, whose
    cores the training's threads use; ACCELERATOR_LOADER_WORKERS on an accelerator."""
    samples, _ = tokenize_conversations(
        tiny_target.tokenizer, conversation_set(8).conversations, 512, progress=False
    )
    for name in ("train", "val"):
        write_cache(tiny_target, samples, tmp_path / name, StoredFields(), {"d": 1}, progress=False)
    caches = {"train_cache": str(tmp_path / "train"), "val_cache": str(tmp_path / "val")}
    module = FeatureDataModule("cached", tiny_target, num_workers="auto", **caches)
    module.setup("fit")
    assert module.train_dataloader().num_workers == 0  # no trainer: as on a CPU

    def on(device: str) -> SimpleNamespace:
        return SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device(device)), world_size=1, global_rank=0
        )

    module.trainer = on("cpu")
    assert module.train_dataloader().num_workers == 0
    module.trainer = on("meta")  # any accelerator
    assert module.val_dataloader().num_workers == ACCELERATOR_LOADER_WORKERS
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0 or 'auto'"):
        FeatureDataModule("cached", tiny_target, num_workers="two", **caches)


def test_a_list_of_train_caches_is_one_mixture_read_in_full_each_epoch(tmp_path, tiny_target):
    """Two caches (one listed twice: weighted up) → every sample of each listed cache once per
    epoch, features as stored, the vocabulary counts over the whole mixture."""
    conversations = conversation_set(30).conversations
    parts = {"a": conversations[:12], "b": conversations[12:]}
    stored = {}
    for name, part in parts.items():
        samples, _ = tokenize_conversations(tiny_target.tokenizer, part, 512, progress=False)
        write_cache(tiny_target, samples, tmp_path / name, StoredFields(), {"d": name}, progress=False)
        stored[name] = samples
    mixture = [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "a")]
    module = FeatureDataModule(
        "cached", tiny_target, train_cache=mixture, val_cache=str(tmp_path / "b"), max_batch_tokens=400
    )
    module.setup("fit")
    expected = stored["a"] + stored["b"] + stored["a"]
    assert len(module.datasets["train"]) == len(expected)
    assert module.datasets["train"].lengths == [len(s.input_ids) for s in expected]
    seen = sorted(
        tuple(row[mask.bool()].tolist())
        for batch in module.train_dataloader()
        for row, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
    )
    assert seen == sorted(tuple(s.input_ids) for s in expected)
    counts = torch.zeros(tiny_target.spec.vocab_size, dtype=torch.long)
    for sample in expected:
        ids, mask = torch.tensor(sample.input_ids), torch.tensor(sample.loss_mask)
        counts += torch.bincount(ids[mask.bool()], minlength=counts.numel())
    assert torch.equal(module.assistant_token_counts(), counts)
    with pytest.raises(ValueError, match="needs train_cache and val_cache"):
        FeatureDataModule("cached", tiny_target, train_cache=[], val_cache=str(tmp_path / "b"))


def test_supervise_all_trains_every_real_token_and_validates_the_assistant_tokens(tiny_target):
    module = FeatureDataModule(
        "online",
        tiny_target,
        conversations=conversation_set(30),
        heldout_fraction=0.3,
        max_batch_tokens=400,
        supervise="all",
    )
    module.setup("fit")
    tokens = next(iter(module.train_dataloader()))
    assistant = tokens.loss_mask.clone()
    assert 0 < int(assistant.sum()) < int(tokens.attention_mask.sum())  # the prompts are not assistant text
    trained = module.features_for(tokens, training=True)
    assert torch.equal(trained.loss_mask, tokens.attention_mask)
    validated = module.features_for(
        TokenBatch(tokens.input_ids, tokens.attention_mask, assistant), training=False
    )
    assert torch.equal(validated.loss_mask, assistant)
    with pytest.raises(ValueError, match="supervise must be one of"):
        FeatureDataModule("online", tiny_target, conversations=conversation_set(2), supervise="prompt")


def test_bad_configurations_are_clear_errors(tmp_path, tiny_target):
    with pytest.raises(ValueError, match="'cached' or 'online'"):
        FeatureDataModule("offline", tiny_target)
    with pytest.raises(ValueError, match="needs train_cache and val_cache"):
        FeatureDataModule("cached", tiny_target, train_cache="x")
    with pytest.raises(ValueError, match="needs a conversation source"):
        FeatureDataModule("online", tiny_target)


def test_a_lightning_trainer_receives_feature_batches(tiny_target):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(
                ("train", type(batch).__name__, batch.input_hidden is not None, batch.aux.shape[-1])
            )
            return (self.weight * batch.hidden.float().mean()).sum()

        def validation_step(self, batch, batch_idx):
            self.seen.append(
                ("val", type(batch).__name__, batch.input_hidden is not None, batch.aux.shape[-1])
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = FeatureDataModule(
        "online",
        tiny_target,
        aux_layers=True,
        conversations=conversation_set(30),
        heldout_fraction=0.3,
        max_batch_tokens=400,
        noise=UniformFeatureNoise(),
        progress=False,
    )
    recorder = Recorder()
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=2,
        use_distributed_sampler=False,
    )
    trainer.fit(recorder, datamodule=module)
    assert ("train", "FeatureBatch", True, 192) in recorder.seen
    assert ("val", "FeatureBatch", False, 192) in recorder.seen

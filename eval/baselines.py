"""Baselines that run outside our decode loop: HF ``generate`` (plain, prompt lookup decoding,
assisted generation), and the small draft LM that classic speculative sampling and HF assisted
generation use.

Without a model hub, the draft LM is built from the target itself: its first ``num_layers``
decoder layers with the target's own embedding, final norm and lm_head (an untrained
layer-skip draft that shares the tokenizer). Any local HF model directory works too.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Collection

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from specdraft.data.target import Target
from specdraft.eval.decode import Generation
from specdraft.eval.sampling import Sampling


def truncated_target(target: Target, num_layers: int) -> PreTrainedModel:
    """A causal LM made of the target's first ``num_layers`` layers (+ embedding, final norm,
    lm_head), sharing the target's weights in memory."""
    total = target.model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"draft_model.num_layers must be in 1..{total - 1} for this target, got {num_layers}"
        )
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = type(target.model)(config).to(device=target.device, dtype=target.dtype)  # then share weights:
    state = {
        name: tensor
        for name, tensor in target.model.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    draft.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        draft.tie_weights()
    return draft.eval().requires_grad_(False)


def load_draft_model(target: Target, path: str | None, num_layers: int) -> PreTrainedModel:
    """A local HF model directory, or (path None) the target truncated to ``num_layers``."""
    if path is None:
        return truncated_target(target, num_layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype, local_files_only=True)
    if model.get_output_embeddings().out_features != target.spec.vocab_size:
        raise ValueError(
            f"draft model {path}: vocabulary differs from the target's ({target.spec.vocab_size})"
        )
    return model.to(target.device).eval().requires_grad_(False)


@torch.no_grad()
def hf_generate(
    target: Target,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: Collection[int],
    seed: int,
    prompt_lookup_tokens: int | None = None,
    assistant: PreTrainedModel | None = None,
    assistant_tokens: int | None = None,
) -> Generation:
    """HF ``generate`` on the target: plain, prompt lookup (``prompt_lookup_tokens``) or
    assisted (``assistant``). HF samples from the global RNG, so it is seeded here per call."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not sampling.greedy,
        temperature=sampling.temperature if not sampling.greedy else None,
        top_p=sampling.top_p if not sampling.greedy else None,
        top_k=sampling.top_k if not sampling.greedy else None,
        eos_token_id=list(eos_ids),
        pad_token_id=target.spec.pad_token_id
        if target.spec.pad_token_id is not None
        else next(iter(eos_ids)),
        prompt_lookup_num_tokens=prompt_lookup_tokens,
        num_assistant_tokens=assistant_tokens,
    )
    torch.manual_seed(seed)
    device = target.device
    start = time.perf_counter()
    output = target.model.generate(
        input_ids=prompt_ids[None].to(device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
        generation_config=config,
        assistant_model=assistant,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total = time.perf_counter() - start
    tokens = output[0, len(prompt_ids) :].tolist()
    stop = "eos" if tokens and tokens[-1] in eos_ids else "length"
    return Generation(tokens, prefill_s=None, total_s=total, stop=stop)

"""What a draft head needs to know about its frozen target.

The head never holds the target model; it is built from a ``TargetSpec`` (plus frozen
embedding / lm_head weights handed over as buffers). The spec is plain data so that it can be
written into checkpoints and export configs as JSON and compared on load.

Layer indexing convention (the one every ``aux_layer_ids`` in specdraft uses)
-----------------------------------------------------------------------------
``aux_layer_ids`` index HF ``hidden_states`` as returned by ``model(..., output_hidden_states=True)``
for a target with N decoder layers:

* ``hidden_states[0]``   = the embedding output = the residual stream ENTERING layer 0;
* ``hidden_states[i]``   = the residual stream entering layer i = the output of layer i-1 (pre-norm);
* ``hidden_states[N]``   = the output of the last layer AFTER the final norm (the "last hidden
  state" EAGLE-1/2 heads read; it is not an aux layer).

So ``i`` is valid for ``0 <= i < N``. This is vLLM's convention ("the stream entering layer i").
SGLang names layer OUTPUTS instead: SGLang id = our id - 1. EAGLE-3's default taps are
``(2, N // 2, N - 3)``, i.e. (2, 15, 27) for the 30-layer SmolLM2-135M.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SPEC_FORMAT_VERSION = 1


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / mid / high taps ``(2, N//2, N-3)`` in hidden_states indexing.

    Needs at least 6 layers for three distinct increasing taps; smaller targets must name
    their taps explicitly.
    """
    if num_layers < 6:
        raise ValueError(
            f"default EAGLE-3 aux layers (2, N//2, N-3) need N >= 6 decoder layers, the target has "
            f"{num_layers}; set aux_layer_ids explicitly (valid ids: 0..{num_layers - 1})"
        )
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class TargetSpec:
    """Shape and identity of a frozen target LLM (JSON-serialisable).

    ``dtype`` is the torch dtype name the target runs in (``"bfloat16"``, ``"float32"``).
    ``eos_token_ids`` holds every id that ends an assistant turn (tokenizer eos, generation
    config eos, and the chat template's end-of-turn token).
    """

    name: str
    revision: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None
    aux_layer_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        # JSON round trips turn tuples into lists; keep the spec hashable and comparable.
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not self.eos_token_ids:
            raise ValueError(f"TargetSpec {self.name!r}: eos_token_ids is empty")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"TargetSpec {self.name!r}: aux_layer_ids {list(self.aux_layer_ids)} contains {bad}; "
                f"valid hidden_states indices are 0..{self.num_layers - 1} (see heads/spec.py)"
            )
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ValueError(
                f"TargetSpec {self.name!r}: aux_layer_ids {list(self.aux_layer_ids)} must be distinct "
                "and increasing"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": SPEC_FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetSpec:
        data = dict(data)
        version = data.pop("format_version", None)
        if version != SPEC_FORMAT_VERSION:
            raise ValueError(
                f"TargetSpec format_version {version!r} is not supported (expected {SPEC_FORMAT_VERSION})"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.name != "aux_layer_ids")
        if unknown or missing:
            raise ValueError(f"TargetSpec: unknown fields {unknown}, missing fields {missing}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TargetSpec:
        return cls.from_dict(json.loads(text))

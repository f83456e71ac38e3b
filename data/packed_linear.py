"""Linear layers pre-packed for oneDNN: the frozen target's few-row and batched matmuls on a CPU.

By default PyTorch runs a CPU linear through MKL (fp32) or oneDNN (bf16), re-packing the weight
into the kernel's blocked layout on every call. For the frozen target, whose weights never
change, the layout can be made once:

* Decoding (eval). On a 2-core AMD EPYC with AVX2 only (fp32, 2 threads, SmolLM2-135M's 211
  linear layers with distinct weights, median of 7) the default path cost 59 ms for 1 token,
  114 ms for 4 and 104–117 ms for 12–24: a 4-node verification cost ~2× a plain step. Pre-packed
  once, the same weights cost 44 / 51 / 64 / 79 ms.
* Regeneration (data/generate.py). On a 2-core AMX-bf16 Xeon (bf16, 2 threads, 128 ShareGPT
  first turns answered with up to 256 tokens, continuously batched) the 32-row batch made 286
  tokens/s by default and 358 with packed weights.

The weights are packed IN PLACE of the model's nn.Linear modules (their class is switched to
:class:`PackedLinear`, a subclass): the original ``weight`` stays where it was (tied embeddings,
the heads' shared lm_head and state dicts are untouched), and every caller of the model — our
decoder, regeneration and the HF ``generate`` baselines alike — runs the same kernels. With a
gradient (training) a packed linear is a plain nn.Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

# oneDNN picks a weight layout for an expected number of rows; a verification tree's node count
# is of this order, and one token (and a batch of 32–64 rows) runs as fast with it (measured above).
PACKING_ROWS_HINT = 16


class PackedLinear(nn.Linear):
    """An nn.Linear that also holds its weight pre-packed for oneDNN and uses it when no gradient
    is needed (a frozen target in inference); otherwise it is a plain nn.Linear."""

    packed_weight: Tensor

    def forward(self, x: Tensor) -> Tensor:
        # Under torch.compile inductor lowers the linear itself (it cannot lower the packed op).
        if (
            x.device.type != "cpu"
            or x.dtype != self.packed_weight.dtype
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
        ):
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every CPU nn.Linear of ``model`` for oneDNN, in place; the number packed (0 when
    already packed). Where this CPU cannot pack the dtype (bf16 without AVX-512 / avx_ne_convert)
    the first weight fails and nothing is packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.device.type != "cpu":
            continue
        try:
            weight = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), batch_size=PACKING_ROWS_HINT
            )
        except RuntimeError as error:  # e.g. bf16 without AVX-512 / avx_ne_convert
            log.info("linear weights not packed (%s): %s", module.weight.dtype, str(error).splitlines()[0])
            return packed
        # Switching the class keeps the module object, its weight and every reference to it.
        module.__class__ = PackedLinear
        module.packed_weight = weight
        packed += 1
    return packed

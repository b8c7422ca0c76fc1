"""A quantizing reference that rounds the served model's values, not its own.

The served model and transformers' reference compute every value in another float32 order, so they differ by
summation noise; quantizing them (fp8 or int8 per token) rounds a value lying within that noise of a rounding
midpoint one way in one model and the other way in the other, on one machine and not another, and one flipped
rounding moves a logit by up to 0.4. `ServedInputs` records the inputs of the served experts' two products (the
layer's hidden state, and the activation ``silu(gate) * up``, as `kernels.reference.fused_moe` computes on the CPU)
and of its fp8 linears; `snap_reference` makes transformers' experts (`fp8_checkpoint_reference._fp8_experts_forward`)
and quantized linears (`Fp8Reference`'s) quantize the recorded rows nearest their own, after asserting the two equal
to float32 noise. The rest stays independent: transformers'
attention, routing and products of the dequantized weights against ours, with the same values quantized.
"""

from __future__ import annotations

import re

import torch

from asyncllm.kernels import reference

LINEAR = "linear"
NOISE = 1e-4
"""|served row - reference row| / max(1, |row|), float32: the same values summed in another order."""


class ServedInputs:
    """Each decoder layer's experts' product inputs in ``model`` (asyncllm's) from construction on: rows by (layer,
    product, width) where product 0 is gate/up's input, 1 down's, and `LINEAR` any fp8 linear's. ``monkeypatch`` (pytest's)
    undoes the recording."""

    def __init__(self, model, monkeypatch) -> None:
        self.rows: dict[tuple[int, int | str, int], list[torch.Tensor]] = {}
        self.layer = -1
        for layer, block in enumerate(model.model.layers):
            for module in block.modules():
                if hasattr(module, "w13_weight"):  # the experts
                    module.forward = self._in_layer(layer, module.forward)
                elif getattr(getattr(module, "weight", None), "dtype", None) == torch.float8_e4m3fn:
                    module.register_forward_pre_hook(self._linear_input(layer))
        monkeypatch.setattr(reference, "_expert_product", self._recording(reference._expert_product))

    def _in_layer(self, layer: int, forward):
        def run(*args):
            self.layer = layer
            return forward(*args)
        return run

    def _linear_input(self, layer: int):
        def record(_module, args):
            self._add(layer, LINEAR, args[0].detach().reshape(-1, args[0].shape[-1]))
        return record

    def _recording(self, product):
        def record(x, w, expert, quant, which):
            self._add(self.layer, which, x.detach())
            return product(x, w, expert, quant, which)
        return record

    def _add(self, layer: int, which: int | str, rows: torch.Tensor) -> None:
        self.rows.setdefault((layer, which, rows.shape[-1]), []).append(rows.clone())

    def nearest(self, layer: int, which: int | str, rows: torch.Tensor) -> torch.Tensor:
        """The served rows of ``layer``'s product ``which`` nearest each of ``rows`` (transformers')."""
        served = torch.cat(self.rows[layer, which, rows.shape[-1]])
        nearest = served[torch.cdist(rows.detach(), served).argmin(dim=1)]
        gap = float((nearest - rows).abs().max())
        assert gap < NOISE * max(1.0, float(rows.abs().max())), f"layer {layer} product {which}: rows differ by {gap}"
        return nearest


def snap_reference(reference_model: torch.nn.Module, served: ServedInputs) -> None:
    """transformers' experts in ``reference_model`` quantize the served rows nearest theirs."""
    assert served.rows, "the served model has not run"
    for name, module in reference_model.named_modules():
        found = re.search(r"layers\.(\d+)\.", name)
        if found is None:
            continue
        layer = int(found.group(1))
        if hasattr(module, "gate_up_proj"):
            module.served = lambda which, rows, layer=layer: served.nearest(layer, which, rows)
        elif isinstance(module, torch.nn.Linear) and (layer, LINEAR, module.in_features) in served.rows:
            module.served = lambda rows, layer=layer: served.nearest(
                layer, LINEAR, rows.reshape(-1, rows.shape[-1])).view(rows.shape)

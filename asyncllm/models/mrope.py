"""Multimodal rotary position embedding (M-RoPE) of Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Each token has three positions (time, height, width) instead of one, and each
rotary frequency takes its angle from one of them: ``mrope_section`` (e.g.
[16, 24, 24]) splits the ``rotary_dim / 2`` frequencies into a time, a height and
a width band (Qwen3-VL interleaves them: `frequency_axes`). Text tokens have three equal positions, so they rotate exactly as
with the ordinary rope at that position; an image's placeholder tokens take the
row and column of their merged patch (offset by the text before the image), and
the text after an image resumes at the largest position so far plus one.

So a prompt's positions are a ``[3, prompt_len]`` table computed once per
request from its images' grids (`mrope_positions`, transformers'
``get_rope_index``), and every token after the prompt (generated, or drafted) is
at ``index + delta`` on all three axes, ``delta`` being the table's maximum + 1
minus the prompt's length (negative once an image is in it: an image of h x w
merged patches spans ``max(h, w)`` positions but ``h * w`` tokens). The KV
cache's slots keep following the token index; only the rotation uses these.

`MRotaryEmbedding` turns a step's ``[3, T]`` positions into a ``[T, rotary_dim]``
cos/sin table whose row t is token t's rotation; the attention backends then
rotate with that table at positions ``0 .. T-1`` (their usual gather), so the
torch and triton backends need nothing new. Steps whose positions are all text
(``[T]`` positions, ``index + delta``) use the ordinary table.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator, Sequence

import numpy as np
import torch

from asyncllm.errors import ConfigError
from asyncllm.models.rotary import RotaryEmbedding, rope_parameters

__all__ = ["MRopePositions", "MRotaryEmbedding", "frequency_axes", "mrope_positions", "mrope_section"]


def mrope_section(hf_config: Any, rotary_dim: int, default: Sequence[int] = ()) -> list[int]:
    """The config's ``mrope_section`` (time, height, width frequencies; ``default`` when it names none, as
    transformers' classes do), checked against the rotary width."""
    section = [int(n) for n in rope_parameters(hf_config).get("mrope_section") or default]
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ConfigError("rope_parameters.mrope_section", section,
                          f"three band sizes adding up to rotary_dim / 2 = {rotary_dim // 2}")
    return section


def frequency_axes(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Each rotary frequency's axis (0 time, 1 height, 2 width): Qwen2-VL's bands of ``section`` frequencies in a
    row; Qwen3-VL's interleaved ``t h w t h w ...`` (height on frequencies 1, 4, ... below ``3 * section[1]``,
    width on 2, 5, ... below ``3 * section[2]``, time on the rest)."""
    if not interleaved:
        # output_size: a meta tensor (the roofline's build) cannot count its own repeats
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)), output_size=sum(section))
    axes = torch.zeros(sum(section), dtype=torch.int64)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


def mrope_positions(prompt_len: int, images: Sequence[tuple[int, int, Sequence[int]] | tuple[int, int, Sequence[int], float]],
                    spatial_merge_size: int,
                    times: Callable[[int, float], np.ndarray] | None = None) -> tuple[np.ndarray, int]:
    """(``[3, prompt_len]`` int64 positions, delta) of a prompt whose images and videos are ``(offset, length,
    (t, h, w)[, time_interval])`` (grid in patches, placeholders in order); text positions count on from where the
    last item left off (its largest position + 1). A video's temporal patch i is at time ``int(i * time_interval)``
    past its start (float32, as transformers' Qwen2.5-VL; ``time_interval`` 1 when not given), or ``times(t,
    time_interval)`` of a model that gives its own rule (Qwen2.5-Omni's).

    This is the Qwen models' own rule (vLLM's, and transformers' ``get_rope_index`` up to 5.2). From 5.3 on,
    transformers starts the text after a video ``max(h, w) / merge`` past the video's start and continues decoding
    from the last prompt position: the same for images, different for videos whose time axis reaches further
    than their rows and columns (docs/multimodal.md)."""
    table = np.empty((3, prompt_len), dtype=np.int64)
    cursor = position = 0
    for offset, length, (t, h, w), *interval in images:
        table[:, cursor:offset] = position + np.arange(offset - cursor)
        position += offset - cursor
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        if t * rows * cols != length:
            raise ValueError(f"an image of grid {(t, h, w)} has {length} placeholder tokens, not {t * rows * cols}")
        grid = np.indices((t, rows, cols)).reshape(3, -1)
        if times is not None:
            grid[0] = times(t, interval[0] if interval else 1.0)[grid[0]]
        elif interval and interval[0] != 1.0:
            grid[0] = (np.arange(t, dtype=np.float32) * np.float32(interval[0])).astype(np.int64)[grid[0]]
        table[:, offset : offset + length] = grid + position
        position = int(table[:, offset : offset + length].max()) + 1
        cursor = offset + length
    table[:, cursor:] = position + np.arange(prompt_len - cursor)
    delta = int(table.max()) + 1 - prompt_len if prompt_len else 0
    return table, delta


class MRotaryEmbedding(RotaryEmbedding):
    """The ordinary cos/sin table, and per step a table of each token's three-axis rotation (see above)."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int, interleaved: bool = False,
                 default_section: Sequence[int] = ()) -> None:
        super().__init__(hf_config, head_dim, max_position)
        axis = frequency_axes(mrope_section(hf_config, self.rotary_dim, default_section), interleaved)
        self.register_buffer("column_axis", torch.cat([axis, axis]), persistent=False)  # cos columns, then sin

    def step_table(self, positions: torch.Tensor) -> torch.Tensor:
        """``[3, T]`` positions -> ``[T, rotary_dim]`` float32 cos/sin, column by column from its axis' position."""
        rows = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
        index = self.column_axis.view(1, 1, -1).expand(1, rows.shape[1], -1)
        return rows.gather(0, index)[0]

    @contextmanager
    def rotating_by(self, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """While inside, the layers' table is this step's (`step_table`); yields the positions to rotate at."""
        table = self.cos_sin_cache
        self.cos_sin_cache = self.step_table(positions)
        try:
            yield torch.arange(positions.shape[1], device=positions.device)
        finally:
            self.cos_sin_cache = table


class MRopePositions:
    """Mixin of a module whose layers rotate by its ``rotary_emb`` (an `MRotaryEmbedding` where ``[3, T]`` positions
    come: Qwen-VL's decoders, an M-RoPE EAGLE head): `layer_positions`."""

    rotary_emb: Any

    def layer_positions(self, positions: torch.Tensor) -> ContextManager[torch.Tensor]:
        """``[3, T]`` M-RoPE positions: the step's table while inside (`MRotaryEmbedding.rotating_by`); ``[T]`` ones
        as they are (text only: three equal positions are the ordinary rope)."""
        return nullcontext(positions) if positions.dim() == 1 else self.rotary_emb.rotating_by(positions)

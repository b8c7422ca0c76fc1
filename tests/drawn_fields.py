"""Drawn keyword arguments for a parameters class's property tests (SamplingParams, PoolingParams), and the check of
what admission made of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from asyncllm import InvalidRequestError


def drawn_fields(fields: dict[str, st.SearchStrategy], valid: dict[str, st.SearchStrategy], min_size: int,
                 max_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """One field from its whole pool (`fields`) and a few others from `valid` (so that a wrong value is often the
    only one), or, one draw in four, several from their whole pools."""

    @st.composite
    def requests(draw: st.DrawFn) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(sorted(fields)), min_size=min_size, max_size=max_size, unique=True))
        wild = draw(st.integers(0, 3)) == 0
        return {name: draw(fields[name] if wild or i == 0 else valid[name]) for i, name in enumerate(names)}

    return requests()


def admitted(admit: Callable[[], Any], expected: dict[str, Any] | None, may_name: set[str],
             same: Callable[[Any, Any], bool]) -> Any:
    """The params `admit` makes, each field `same` as `expected`'s, or None when it refused them as `expected`
    (None) says, naming one of `may_name`: the fields the reference found bad."""
    try:
        params = admit()
    except InvalidRequestError as exc:
        assert expected is None, f"refused valid params: {exc}"
        assert exc.field in may_name, f"{exc} names {exc.field!r}, expected one of {sorted(may_name)}"
        return None
    assert expected is not None, f"accepted params with bad {sorted(may_name)}: {params}"
    for name in type(params).__struct_fields__:
        assert same(getattr(params, name), expected[name]), (name, getattr(params, name), expected[name])
    return params

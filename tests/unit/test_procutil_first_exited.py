"""`procutil.first_exited`: which peer of a tensor/pipeline-parallel group died (the executor names it)."""

from __future__ import annotations

from asyncllm.procutil import first_exited


class _Proc:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_a_killed_peer_is_found_and_one_that_exited_with_a_code_only_when_asked() -> None:
    assert first_exited([_Proc(None), _Proc(-9)], 0.0, skip=0, killed=True) == (1, -9)
    assert first_exited([_Proc(1), _Proc(1)], 0.0, skip=0, killed=True) is None  # it sent its own error (a config's)
    assert first_exited([_Proc(1), _Proc(1)], 0.0, skip=0) == (1, 1)
    assert first_exited([_Proc(-9), _Proc(None)], 0.0, skip=0) is None  # the sender itself is skipped

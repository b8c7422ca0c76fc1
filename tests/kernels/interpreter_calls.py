"""Triton's interpreter without its per-call cost for ``@triton.jit`` helpers (tests on the CPU only).

Each call of a jit helper from inside a kernel (ours, and `tl.sum`, `tl.zeros`, ...) makes the interpreter patch
the language modules its source names (`triton.language`, `triton.language.core`) again: an `inspect.getmembers`
of each per call, a fifth of an interpreted model's time. Within one launch a module once patched stays patched
(the kernel's own patch is restored when it returns; a helper's never is), so a helper whose modules the launch or
an earlier helper of it has patched runs as the interpreter would run it, without patching them again. Anything
unexpected in the installed Triton leaves the interpreter as it is.
"""

from __future__ import annotations

import os


def install() -> bool:
    """Skip the repeated patch; True when installed (TRITON_INTERPRET=1 and a Triton with these internals)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    launch, helper = interpreter.GridExecutor, interpreter.InterpretedFunction
    if not all(hasattr(o, n) for o, n in ((launch, "__call__"), (helper, "rewrite"), (interpreter, "_patch_lang"),
                                          (interpreter, "InterpreterError"))):
        return False
    patched: list[set[int]] = []  # the language modules patched within each running launch
    languages = (id(tl), id(tl.core))
    original_launch, original_helper = launch.__call__, helper.__call__

    def modules(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if id(v) in languages)

    def run_launch(self, *args, **kwargs):
        patched.append(set(modules(self.fn)))
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def run_helper(self, *args, **kwargs):
        if not patched:
            return original_helper(self, *args, **kwargs)
        names = modules(self.fn)
        if not names <= patched[-1]:
            patched[-1] |= names  # patched by the call below, for the rest of the launch
            return original_helper(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise interpreter.InterpreterError(repr(exc)) from exc

    launch.__call__, helper.__call__ = run_launch, run_helper
    return True

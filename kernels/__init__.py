"""asyncllm.kernels: the Triton kernels (docs/kernels.md).

Imported as the top-level ``kernels`` instead (a checkout's root on ``sys.path``: ``python -m`` or ``python -c`` run
there), this folder would shadow the installed ``kernels`` distribution, Hugging Face's hub kernels, which
transformers 5.25 and later import with every model: it then hands the name to the installed one, where there is one.
"""

import sys

if __name__ == "kernels":
    import importlib.util
    import os
    from importlib.machinery import PathFinder

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = PathFinder.find_spec("kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed  # what `import kernels` returns
        _spec.loader.exec_module(_installed)

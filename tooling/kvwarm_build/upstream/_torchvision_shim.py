"""Let a CUDA torchvision wheel import on a CPU-only torch (tests' venv only).

The gate's sitecustomize (_sitecustomize.py, on PYTHONPATH) imports this, so it also
acts in the subprocesses vLLM starts (model inspection runs in one).

torchvision's compiled ops (_C) link against libtorch_cuda and cannot load on
the CPU torch build; torchvision then still registers fake kernels for
torchvision::nms/qnms unconditionally and the import dies. Defining those two
schemas first lets the pure-Python parts (transforms) import; the compiled ops
stay unavailable, which vLLM's scheduler-level tests never use.
"""

import importlib.abc
import sys


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return
        sys.meta_path.remove(self)
        _define_missing_ops()
        return  # let the normal finders import torchvision


def _define_missing_ops():
    import importlib.util
    from pathlib import Path

    import torch

    spec = importlib.util.find_spec("torchvision")
    compiled = next(Path(spec.origin).parent.glob("_C*.so"), None) if spec else None
    try:
        torch.ops.load_library(str(compiled))
        return  # ops load: nothing to fake
    except (OSError, RuntimeError, TypeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    sys.modules[__name__]._keep = lib  # a Library deregisters when collected


sys.meta_path.insert(0, _Hook())

"""The sitecustomize of the gate's pytest runs (run_suite puts its folder on PYTHONPATH, so it
acts in the subprocesses vLLM starts too): each shim installs its import hook."""

import kvwarm_cpu_platform_shim  # noqa: F401
import kvwarm_torchvision_shim  # noqa: F401

"""Lift vLLM's x86 Triton refusal from its CPU platform (the gate's runs of a release whose
row says `cpu_platform = false`; KVWARM_CPU_PLATFORM_WITHOUT_TRITON=1 turns it on).

A release's CPU platform may refuse, in `check_and_update_config`, any config on x86 without
Triton (triton-cpu, which no index we reach has), so every upstream test that builds a config
fails on both sides; vLLM's unspecified platform infers no device for them and lacks the
hybrid KV cache and the rest the tests expect of the CPU platform. This module, imported by
the gate's sitecustomize, compiles `vllm/platforms/cpu.py` without that one statement and
leaves everything else as it is: the scheduler-level tests never run a Triton kernel (a test
that does still fails, on both sides alike). A release without the statement gets an
ImportError that says so (the row's cpu_platform no longer fits).
"""

import importlib.abc
import importlib.util
import os
import sys

MODULE = "vllm.platforms.cpu"
REFUSAL = 'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")'
SWITCH = "KVWARM_CPU_PLATFORM_WITHOUT_TRITON"


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or not hasattr(spec.loader, "get_source"):
            return spec
        loader = spec.loader

        def exec_module(module):
            source = loader.get_source(name)
            if REFUSAL not in source:
                raise ImportError(
                    f"{spec.origin} has no x86 Triton refusal ({REFUSAL}) for {SWITCH} to lift: "
                    "this release's CPU platform may run here (cpu_platform in releases.toml)"
                )
            # `pass` in its place: the same lines, so tracebacks still point at the file's own.
            lifted = source.replace(REFUSAL, "pass  # lifted by kvwarm's upstream gate")
            exec(compile(lifted, spec.origin, "exec"), module.__dict__)  # noqa: S102  (vLLM's own file, one line off)

        loader.exec_module = exec_module
        return spec


if os.environ.get(SWITCH) == "1":
    sys.meta_path.insert(0, _Hook())

"""Build tooling: turn an official vLLM release wheel into a patched `+kvwarm.N` wheel.

Pipeline (each step a module): releases (what to build) -> fetch (hash-pinned download)
-> series (read and lint a patch series) -> apply (check the whole series, then patch)
-> repack (labelled, reproducible wheel) -> validate (behaviour of the result).
"""

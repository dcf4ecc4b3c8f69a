"""The planners' formats, written from a finished sweep (or a served-step trace): Dynamo's
self-benchmark artifact (`dynamo`: the envelope; `dynamo_rows`: its rows; `dynamo_engine`: its
engine provenance), the pre-deployment profiler's tables (`profiler`), Dynamo's forward-pass
metrics capture of a trace (`fpm`), reading a finished sweep's ranks (`input`), writing the
files and the sweep's own hook (`write`), and `python -m vllm.kvwarm export` (`command`).
Plain data: nothing here imports vLLM."""

"""`python -m vllm.kvwarm validate`: a table held against a served-step trace. `predict`: the one
predictor; `match`: which records' fields refuse a pair; `validation`: every traced step
predicted (`validate()`, its result `Validation`); `metrics`: the figures per kind and band and
the repeat noise; `output`: the printed table, JSON and CSV; `plot`; `command`: the command line.
Plain data: nothing here imports vLLM."""

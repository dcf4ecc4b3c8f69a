"""The record room: the measurement record as plain data (vocabulary, artifact, schema, the
combined view) and what reads it (runs, plot, report). Imports nothing of vLLM (checked by a
test), so artifacts can be read and rendered anywhere."""

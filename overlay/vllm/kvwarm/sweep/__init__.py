"""The sweep room: the measurement controller and its inputs (points, settings, dataset,
gate, plan, rows, ranks), and the run that ties them to an engine (run, writer, command).
Imports vLLM's engine-side modules only where it drives them; never the report."""

"""The served-step trace (docs/validate-reference.md#the-trace): with the adapter as the scheduler class
and the trace setting on, every step the engine runs outside a sweep is one JSON line.

  settings    the setting (additional_config's kvwarm_trace, or DYN_BENCH_TRACE_DIR) and its bounds
  recorder    what the adapter calls in each step; the header; each step's plain data
  contracts   what the trace relies on of vLLM's behaviour (docs/hooks.md H1 to H6), checked as it runs
  step_parts  a step's parts read from its SchedulerOutput as plain data, in the engine's thread
  writer      the engine's side of the writer process: starts it, hands it the steps, waits for it
  sink        the writer process (standard library alone): the lines, the files and their rotation
"""

"""The served-step trace (docs/validate.md#the-trace): with the adapter as the scheduler class
and the trace setting on, every step the engine runs outside a sweep is one JSON line.

  settings  the setting (additional_config's kvwarm_trace, or DYN_BENCH_TRACE_DIR) and its bounds
  recorder  what the adapter calls in each step; the header; one line per traced step
  shape     a step's composition, read from its SchedulerOutput in the writer's thread
  writer    the files (rotated at a size cap) and the thread that writes them
"""

"""The pieces of benchmarks/step_fidelity.py, the script that runs them (argument parsing and
main); not a benchmark itself (`nox -s bench-S` skips names that start with `_`). It is
imported as the script imports `_engine`: from the benchmarks folder, which Python puts first
on the path of a script it runs.

- `cases`: what is measured: the settings (full, quick, the variance study's variants and
  allocators), the models (CASES) and each one's ladder of points;
- `paired`: one engine's paired run: the steps seen around the adapter (Steps), the shadows
  measured by the Sweep and the natural requests in ABBA turns (PairedRun);
- `runner`: an engine process: the case run in it (run_case), started and read back by
  the main process (run_engine);
- `stats`: the figures of a point: medians, the paired ratio with its bootstrap interval,
  A/A, carry-over, spread;
- `report`: the printed tables and the JSON result line, the variance study, the machine
  floor.
"""

"""Test support for kvwarm (never shipped): one package the tests, the benchmarks and the
smoke import alike.

  tiny_models     random-weight models and a ShareGPT file, made on the spot
  real_kv         builders for the real vLLM v1 KV-cache classes and a real Scheduler
  engine          the CPU engine's environment (one home) and an LLM with handles on its parts
  fidelity        the shadow fidelity oracle: shadows decode like natural requests
  exact_fidelity  the same for exact recurrent state on hybrid models
  multi_rank      data- and tensor-parallel engines in subprocesses
  rank_sweeps     data-parallel ranks of one sweep stepped in one process, through the real
                  exchanges
  plugin          a vLLM general plugin the multi-rank tests switch on (CPU communicator gaps,
                  forced faults)
"""

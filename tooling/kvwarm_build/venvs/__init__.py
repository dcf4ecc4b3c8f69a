"""The venvs room: the venvs vLLM runs in here (deps: a deps venv per set of pins and the
venvs layered on it; engine: the CPU engine's), filled by uv (installer). It imports only
the shared modules."""

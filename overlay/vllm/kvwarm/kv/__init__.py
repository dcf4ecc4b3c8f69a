"""The KV-borrowing room: everything that touches vLLM's KV-cache internals (what
docs/hooks.md lists): layout and capability probes, shadow registration per group, the
state hand-off, chains, fake KV, catch-ups and the injector. It changes when vLLM's
internals do; it never imports the sweep."""

"""The bundles room: an offline bundle of a patched wheel for a host without a package index
(resolve: the wheels the target lacks; make: the folder and its manifest; install: copied
into every bundle as install.py, so it imports nothing but the standard library); and the
kit, the little a known host lacks for a few paths in parts a transfer can take (kit_spec:
the kit file held against pip's plan; kit: the parts and manifest; kit_install: copied into
every part folder as install.py, standard library only; kit_check: its offline install on
the host's package set; kit_cli: the commands)."""

"""The bundles room: an offline bundle of a patched wheel for a host without a package index
(resolve: the wheels the target lacks; make: the folder and its manifest; install: copied
into every bundle as install.py, so it imports nothing but the standard library)."""

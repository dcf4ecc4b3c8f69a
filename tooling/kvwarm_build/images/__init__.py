"""The images room: images/Dockerfile built on a release's official base (dockerfile, with
its labels and arguments from refs and whichever OCI builder is here from builders), or on a
local stand-in base where the official one cannot be pulled (standin, with apt_sources and
host_tools for debootstrap)."""

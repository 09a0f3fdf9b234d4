"""Bytes between files and memory: direct I/O, vectored reads and writes, the streaming writers, staged outputs."""

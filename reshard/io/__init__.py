"""Bytes between files and memory: streaming writers of checkpoint formats."""

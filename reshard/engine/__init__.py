"""Planning a conversion from headers and executing it: gather, hash, split, write, one tensor at a time."""

"""Running one conversion for every command that writes (``conversion``): stage the output, keep the journal a
``--resume`` reads (``resume``), share the files among workers (``workers``, ``worker_shares``, ``group_staging``),
move the bytes, write the manifest (``conversion_manifest``) and publish; ``route`` is where a conversion went,
``warmup`` starts torch's import while the rest is checked."""

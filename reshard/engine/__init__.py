"""A conversion in three rooms, each importing only the ones before it: ``plan`` (headers -> every unit of work),
``move`` (the bytes of each unit: streamed or gathered, hashed, split, written) and ``run`` (staging, journal,
workers, manifest, publish)."""

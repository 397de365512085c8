"""Where the bytes live: safetensors files and their headers, checkpoint locations (paths, Hub ids), the index of a
sharded checkpoint, side files (``config.json``) and the natural key order. The bottom layer: imports nothing of
hp_fastload but ``errors``, ``formats`` and ``_core``.
"""

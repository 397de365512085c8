"""Where the bytes live: safetensors files and their headers, checkpoint locations (paths, Hub ids, ``s3://`` URLs),
the index of a checkpoint (local or in object storage), side files (``config.json``) and the natural key order.
Imports nothing of hp_fastload but ``errors``, ``formats`` and ``_core``.
"""

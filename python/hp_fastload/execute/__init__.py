"""Execution: plans become engine batches (``_core.execute``), in either direction. Owns the item records, staging
(pinned host slabs for device targets), reads into local shards, writes of export regions and the engine's thread
count. Decides nothing.
"""
